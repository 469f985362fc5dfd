"""From ``kvplug new-backend mystore`` to a vLLM engine using ``mystore`` as its second tier.

Both of the template's variants are generated and installed into the same fresh environment (one
build): ``mystore`` (a bounded in-memory store to replace hook by hook) and ``mykv``
(``--key-value``: a tier over a key-value store on kvplug's value-store base); each passes its
own generated tests there (kvplug's conformance kit and the deterministic simulation).

The generated package is ``pip install``-ed into a **fresh virtual environment** next to kvplug,
never into the project's own environment (other tests would then discover it). Installing torch,
vLLM and kvplug into a new environment would take many minutes, so the fresh environment gets one
``.pth`` line, ``import site; site.addsitedir(<project site-packages>)``: it sees the project's
packages (kvplug's editable install included) *behind* its own site-packages, exactly as a
``--system-site-packages`` environment sees the system's. Everything else is real: the template is
rendered by the ``kvplug`` CLI, pip builds a wheel from the generated pyproject.toml with
setuptools and installs it into the fresh environment's site-packages (``--no-index``: pip must
find kvplug, the package's dependency, already installed), and every check below runs in that
environment's interpreter, where the backend is found only through its installed entry point.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NAME = "mystore"
KV = "mykv"  # the --key-value variant, installed beside NAME
#: backend name -> (class name, new-backend flags)
PACKAGES = {NAME: ("MystoreBackend", []), KV: ("MykvBackend", ["--key-value"])}


def run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "250", **kw.pop("env", {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict[str, Path]:
    """Generate ``mystore`` and ``mykv`` with the CLI, make a fresh venv, pip install both
    packages into it (one pip call)."""
    root = tmp_path_factory.mktemp("newcomer")
    for name, (_, flags) in PACKAGES.items():
        # The CLI through this interpreter (a copied environment's console scripts may point at
        # another one, and so render another checkout's template).
        gen = run([sys.executable, "-m", "kvplug.cli", "new-backend", name, "-o", str(root),
                   "--author", "Newcomer", *flags])
        assert gen.returncode == 0, gen.stderr
    pkgs = {name: root / f"kvplug-{name}" for name in PACKAGES}
    env_dir = root / "env"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    assert made.returncode == 0, made.stderr
    python = env_dir / "bin" / "python"
    site_dir = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                            "['purelib'])"]).stdout.strip())
    host = sysconfig.get_paths()["purelib"]
    (site_dir / "_kvplug_host.pth").write_text(f"import site; site.addsitedir({host!r})\n")
    inst = run([str(python), "-m", "pip", "install", "--no-index", "--no-build-isolation",
                "--disable-pip-version-check", *map(str, pkgs.values())], cwd=root)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    for name in PACKAGES:
        assert (site_dir / f"kvplug_{name}").is_dir(), f"{name}: not installed into the fresh env"
    return {"root": root, "pkg": pkgs[NAME], "pkgs": pkgs, "python": python, "site": site_dir}


def test_project_environment_is_untouched(venv):
    """The packages live only in the fresh environment."""
    from kvplug.plugins import discover_backends

    for name in PACKAGES:
        assert name not in discover_backends()
        out = run([sys.executable, "-c", f"import kvplug_{name}"])
        assert out.returncode != 0


def test_kvplug_backends_lists_them_as_valid(venv):
    out = run([str(venv["python"]), "-m", "kvplug.cli", "backends"])
    assert out.returncode == 0, out.stderr
    rows = json.loads(run([str(venv["python"]), "-m", "kvplug.cli", "backends", "--json"]).stdout)
    for name, (cls, _) in PACKAGES.items():
        line = next(ln for ln in out.stdout.splitlines() if f" {name} " in ln)
        assert f"kvplug-{name}" in line and "0.1.0" in line and "valid" in line
        assert "invalid" not in line and cls in line
        row = next(r for r in rows if r["name"] == name)
        assert row["status"] == "valid" and row["error"] is None


@pytest.mark.parametrize("name", list(PACKAGES))
def test_generated_conformance_tests_pass(venv, name):
    """Each package's own tests: kvplug's conformance kit (alone and behind local_cpu) and the
    deterministic simulation (``KVPLUG_SIM_SEEDS``: a few seeds here). The key-value variant's
    store keeps its values across a reopen (``persistent``), so none of its tests is skipped."""
    out = run([str(venv["python"]), "-m", "pytest", "-q", "-rsp", "-p", "no:cacheprovider"],
              cwd=venv["pkgs"][name], timeout=600, env={"KVPLUG_SIM_SEEDS": "4"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 20 and "failed" not in out.stdout, out.stdout[-2000:]
    assert ("PASSED tests/test_backend.py::TestSimulation::test_simulation_holds_every_invariant"
            in out.stdout), f"the simulation did not run and pass: {out.stdout[-2000:]}"
    if name == KV:
        assert "skipped" not in out.stdout, out.stdout[-2000:]


ROUND_TRIP = """
import json, sys, torch
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key
results = {}
for name in sys.argv[1:]:  # one process for every generated tier: torch is imported once
    tiers = [{"backend": "local_cpu", "options": {"capacity": "1MiB"}},
             {"backend": name, "options": {"capacity": "4MiB"}}]
    out = results[name] = {}
    with StorageManager({"tiers": tiers}) as mgr:
        expect = {}
        for i in range(8):
            obj = fill_random(mgr, seed=i)
            expect[i] = obj.byte_view.clone()
            mgr.batched_put([make_key(i)], [obj])
            obj.ref_down()
        assert mgr.flush(timeout=30)  # a key-value tier writes on its writer threads
        mgr.evict([make_key(i) for i in range(8)], tiers=["local_cpu"])
        out["where_before"] = [mgr.contains(make_key(i)) for i in range(8)]
        got = mgr.batched_get([make_key(i) for i in range(8)])
        out["exact"] = [g is not None and torch.equal(g.byte_view, expect[i])
                        for i, g in enumerate(got)]
        for g in got:
            g.ref_down()
        out["where_after"] = [mgr.contains(make_key(i)) for i in range(8)]
        out["stats"] = mgr.stats()[name]
print(json.dumps(results))
"""


def test_storage_manager_round_trips_through_them(venv):
    """local_cpu + each generated tier: chunks evicted from L1 come back bit-exact from it and
    are promoted into L1."""
    out = run([str(venv["python"]), "-c", ROUND_TRIP, *PACKAGES])
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for name in PACKAGES:
        res = results[name]
        assert res["where_before"] == [name] * 8
        assert res["exact"] == [True] * 8
        assert res["where_after"] == ["local_cpu"] * 8
    # the in-memory store's own count (a value store counts its encoded values)
    assert results[NAME]["stats"]["entries"] == 8
    assert results[NAME]["stats"]["bytes"] == 8 * 16384


ENGINE = """
import json, sys
sys.path.insert(0, REPO)
from tests.support.vllm_helpers import generate, make_llm, prompt, transfer_config
from kvplug.connector.demo.model import make_model

model = make_model("tiny")
config = {"chunk_size": 256, "tiers": [
    {"backend": "local_cpu", "options": {"capacity": "3MiB"}},   # ~6 chunks of the tiny model
    {"backend": "NAME", "options": {"capacity": "256MiB"}}]}
llm = make_llm(model, transfer_config("kvplug", config))
target = prompt(1034, seed=1)                       # 4 whole chunks + 10 tokens
cold = generate(llm, [target])[0]
for seed in (2, 3, 4):                              # push target's chunks out of local_cpu
    generate(llm, [prompt(1034, seed=seed)])
warm = generate(llm, [target])[0]
print("RESULT " + json.dumps({"cold": cold, "warm": warm}), flush=True)
"""


@pytest.mark.vllm
def test_vllm_engine_serves_a_warm_hit_from_the_generated_tier(venv):
    """A real vLLM CPU engine with local_cpu + mystore: after the prompt's chunks were evicted
    from local_cpu, the repeated prompt loads them from mystore and generates exactly the same
    tokens (and logprobs) as the cold run."""
    check = run([str(venv["python"]), "-c", "import vllm, kvplug.connector.connector"])
    if check.returncode != 0:
        pytest.skip(f"vLLM or kvplug's connector is not importable: {check.stderr[-300:]}")
    code = ENGINE.replace("REPO", repr(str(REPO))).replace("NAME", NAME)
    # vLLM's in-process layout (its one-GPU UniProcExecutor): the fresh environment's interpreter
    # imports torch and vLLM once, not three times (tests/conftest.py)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO),
           "TORCHDYNAMO_DISABLE": os.environ["TORCHDYNAMO_DISABLE"]}  # tests/conftest.py
    out = run([str(venv["python"]), "-c", code], timeout=900, env=env, cwd=venv["root"])
    assert out.returncode == 0, out.stderr[-6000:]
    res = json.loads(next(ln[7:] for ln in out.stdout.splitlines() if ln.startswith("RESULT ")))
    logs = out.stdout + out.stderr  # vLLM logs to stdout
    loads = re.findall(r"kvplug: request \S+ loaded (\d+) tokens \(([^)]*)\)", logs)
    from_mystore = [int(n) for _, parts in loads
                    for n, tier in re.findall(r"(\d+) from (\w+)", parts) if tier == NAME]
    assert from_mystore and max(from_mystore) >= 1024, (
        f"no load from {NAME}; kvplug load lines: {loads}\n{logs[-4000:]}")
    assert res["warm"][0] == res["cold"][0], "a cache hit changed the generated tokens"
    for a, b in zip(res["warm"][1], res["cold"][1], strict=True):
        assert abs(a - b) < 1e-3, (res["warm"][1], res["cold"][1])
