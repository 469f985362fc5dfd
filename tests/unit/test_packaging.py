"""Packaging: every module of the design card's folders ships in the wheel, under its import name.

setuptools cannot discover sub-packages under pyproject's ``package-dir`` mapping, so the package
list is written by hand; these tests fail when a package folder is missing from it (an editable
install would hide that: it imports sub-packages straight from the folders).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Import name -> folder of every package below the mapped folders (a dir with __init__.py)."""
    found: dict[str, Path] = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if any(part.startswith("{{") or part == "__pycache__" for part in rel.parts):
                continue  # the cookiecutter template's own (unrendered) package
            found[".".join((name, *rel.parts))] = init.parent
    return found


def test_every_package_folder_is_listed():
    folders = _package_folders()
    assert "kvplug.backends" in folders, "the walk found nothing: the test would pass vacuously"
    missing = sorted(set(folders) - set(SETUPTOOLS["packages"]))
    assert not missing, f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"
    stale = sorted(set(SETUPTOOLS["packages"]) - set(folders))
    assert not stale, f"pyproject.toml lists packages that have no folder: {stale}"


def test_every_entry_point_imports():
    from kvplug.plugins import import_object

    targets = PYPROJECT["project"]["entry-points"]["kvplug.backends"]
    assert set(targets) >= {"local_cpu", "posix", "gds", "fsspec"}
    for name, target in targets.items():
        assert isinstance(import_object(target), type), f"{name} -> {target} is not a class"


@pytest.mark.timeout(300)
def test_wheel_holds_every_module(tmp_path):
    """Build the wheel for real and look for every .py file of the mapped folders in it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=280,
    )
    (wheel,) = tmp_path.glob("kvplug-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "/".join((*pkg.split("."), py.name))
        for pkg, folder in _package_folders().items()
        for py in folder.glob("*.py")
    }
    assert "kvplug/chunkfile/format.py" in expected
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"


def test_no_import_circle_among_the_product_modules():
    """Each room imports only the rooms below it (scripts/import_circles.py, module-level imports);
    the circle finder itself is checked on a graph with one, so an empty answer means none."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_circles
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    known = import_circles.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert [sorted(c) for c in known] == [["a", "b", "c"]]
    edges = import_circles.graph(ROOT, typing=False)
    assert len(edges) > 100, "the walk found no modules: the test would pass vacuously"
    assert import_circles.circles(edges) == []
