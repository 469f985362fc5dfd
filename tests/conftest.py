"""Suite-wide isolation: no test reads the user's kvplug config or writes to ~/.cache.

Engines (tests/support/vllm_helpers.py), kept to the suite's 15-minute budget on 2 cores:

* an engine start is the expensive part: a module with ``ENGINES_IN_PROCESS = True`` runs its
  ``run_scenario``/``run_script`` engines in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
  ``_engine_layout`` below; see ``vllm_helpers.engine_env``): one Python start instead of three.
  Other modules, servers (server_helpers), the demo and the soak keep vLLM's multi-process layout;
* share one engine between scenarios that have its configuration: put them in one
  ``run_scenario(model, kv, steps)`` (steps run in order in the same engine; a module-scoped
  fixture returning the step results serves many tests, as ``bulk`` in test_connector_engine.py);
  start a fresh engine only for a restart (a fresh process reading what another stored) or another
  configuration;
* a ``kvplug`` command or a child that needs torch and kvplug (not a fresh interpreter's own
  imports): ``engine_processes.run_console_script``/``start_python`` fork it from the suite's
  forkserver (~2 s of imports less per process than ``subprocess`` with ``sys.executable``);
* the tiny model: ``make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")`` builds it
  once per session (the same folder for every worker's modules);
* no torch.compile in the tests' engines (``TORCHDYNAMO_DISABLE=1``, set below for every process
  the suite starts): vLLM compiles its sampler's logprob-rank helper with inductor in every engine
  asked for logprobs (the scenarios are; ~19 s of CPU cold, ~1.6 s warm, each engine), its
  speculative decoding's pieces, and traces PP=2's model. Eager gives the same tokens and
  logprobs (measured: cold runs and a warm hit, equal with it on and off); CPU s of a module on
  and off: test_connector_engine_spec 129.6 / 94.8, test_parallel_engine 156.5 / 125.6. It
  changes nothing kvplug does; an explicit ``TORCHDYNAMO_DISABLE=0`` turns it back on;
* one OpenMP thread per engine and no core binding (``OMP_NUM_THREADS=1``,
  ``VLLM_CPU_OMP_THREADS_BIND=nobind``, set below unless the environment has them; TP=2 ranks too):
  torch's default, a thread per core, has four workers' engines spin-wait on each other's cores,
  and vLLM's auto binding pins every multi-process engine's worker to core 0 (four engines at
  once: 13x slower in-process, 1.6x multi-process; ``benchmarks/bench_engine_threads.py``);
* ``make test``'s whole-suite pass runs four pytest-xdist workers on the 2 cores, a module at a
  time (``--dist loadfile``: a module's engines and fixtures stay in one worker): while one
  worker waits (a server or an engine process starting, a subprocess, a bounded wait for a
  store) another computes. Measured, the whole suite on a 2-core VM: 803 s with two workers
  (CI), 702 s with three, 629 s with four, the cores busy throughout (vmstat idle ~1%). The
  0.33 pass (CPU-bound, few modules) keeps two: 43 s, against 71 s with four. The heaviest modules are
  queued first so that the workers finish together (``pytest_collection_modifyitems`` below).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
#: the layers (tests/README.md): a test in tests/LAYER/ carries the marker LAYER, so that
#: ``pytest -m unit`` and ``pytest tests/unit`` run the same tests (pyproject.toml registers them)
LAYERS = ("unit", "backends", "engine", "faults", "sim")
#: pytest modules that run only inside a private network namespace: the test that makes one runs
#: them by path (tests/support/mooncake_store.py: ``run_in_private_netns``)
collect_ignore_glob = ["*/test_*_netns.py"]


def pytest_itemcollected(item: pytest.Item) -> None:
    layer = item.path.relative_to(TESTS).parts[0]
    if layer in LAYERS:
        item.add_marker(layer)


#: modules measured slowest (worker seconds in a whole-suite pass on 2 cores, 2026-11-29: engine
#: start-ups mostly), queued first so that the workers finish together (xdist keeps this order
#: only with ``--no-loadscope-reorder``, scripts/run_tests.sh; by default it queues the modules
#: with the most tests first); then the other ``vllm``-marked modules, then the rest, each group
#: in collection order
HEAVIEST = ["test_parallel_engine", "test_template_venv", "test_soak", "test_manage_engine",
            "test_simulation", "test_connector_engine_spec", "test_connector_engine",
            "test_kv_events_engine", "test_cli", "test_mooncake", "test_demo",
            "test_prom_metrics", "test_codecs_engine", "test_reliability_outage",
            "test_cli_bench", "test_connector_hma", "test_fsspec_vllm", "test_secrets",
            "test_crash_durability", "test_reliability_shared", "test_pd_engines",
            "test_auth_chunks", "test_connector_engine_weights", "test_fsspec_conformance",
            "test_mooncake_engine", "test_identity", "test_resp_cluster_faults",
            "test_posix_multiprocess", "test_management"]


#: inherited by every process the suite starts (engines, servers, the demo, the soak; the
#: forkserver imports torch with it); see the docstring
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
#: one OpenMP thread per engine, unbound: four workers' engines share 2 cores (see the docstring)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def weight(item: pytest.Item) -> int:
        name = item.module.__name__.rpartition(".")[2] if item.module else ""
        if name in HEAVIEST:
            return HEAVIEST.index(name)
        return len(HEAVIEST) + (0 if item.get_closest_marker("vllm") else 1)

    items.sort(key=weight)  # stable: a module's own tests keep their order



def _no_engine_here() -> str | None:
    """Why no vLLM engine can run in this environment: vLLM's CUDA build (0.33 has no CPU wheel;
    scripts/setup.sh's .venv-vllm033) on a machine without a CUDA device. None where one can."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("vllm")
    except PackageNotFoundError:
        return None  # vllm-cpu (or no vLLM at all: those tests skip themselves)
    import torch

    if torch.cuda.is_available():
        return None
    return (f"needs a vLLM engine: vLLM {v} is the CUDA build and this machine has no CUDA "
            "device (engine tests run on vllm-cpu 0.32)")


#: engine tests (marker ``vllm``) skip with this reason; vLLM's configs get the CPU platform
#: (``VLLM_TARGET_DEVICE``), without which the CUDA build has no device for a ``VllmConfig``
#: ("Device string must not be empty"); its own cache folder (vLLM keeps one model-info file
#: per model class, which two versions on one machine would each find stale and rebuild in a
#: subprocess, ~10-40 s per class)
NO_ENGINE = _no_engine_here()
if NO_ENGINE:
    from importlib.metadata import version as _version

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    HEAVIEST.insert(0, "test_vllm_versions")  # the 0.33 pass's slowest module: the simulation
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), f"vllm-{_version('vllm')}"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if NO_ENGINE and item.get_closest_marker("vllm"):
        pytest.skip(NO_ENGINE)

#: One tenant key for the session's processes (sdk/policies/tenants.py), never the user's own: the
#: tenant ids a test computes (some at import) are those its engines, servers and tiers compute.
_TENANT_KEY_DIR = tempfile.mkdtemp(prefix="kvplug-test-tenant-key-")
TENANT_KEY_FILE = os.path.join(_TENANT_KEY_DIR, "tenant.key")
os.environ["KVPLUG_TENANT_KEY_FILE"] = TENANT_KEY_FILE
atexit.register(shutil.rmtree, _TENANT_KEY_DIR, True)


@pytest.fixture(autouse=True)
def _isolated_kvplug_env(monkeypatch, tmp_path_factory):
    for name in list(os.environ):
        if name.startswith("KVPLUG_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVPLUG_CACHE_DIR", str(tmp_path_factory.mktemp("kvplug-cache")))
    monkeypatch.setenv("KVPLUG_TENANT_KEY_FILE", TENANT_KEY_FILE)


@pytest.fixture(scope="module", autouse=True)
def _engine_layout(request):
    """Engines in-process for a module that asks (``ENGINES_IN_PROCESS = True``)."""
    if not getattr(request.module, "ENGINES_IN_PROCESS", False):
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield
    mp.undo()
