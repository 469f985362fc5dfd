"""Weights changed in a running engine (vLLM's ``reload_weights``, as RL frameworks and hot swaps
do) and ``reset_prefix_cache(reset_connector=True)``: the next request is computed, not loaded
from what kvplug stored under the old weights, and equals a fresh engine started on the new
weights. Control: without the reset kvplug serves the old weights' KV (so the check can fail).

Two engines (one at a time): A starts on one set of random weights and reloads another set from
disk through vLLM's own loading path; B starts on the second set. Like with like: both compare a
cold prefill under the same chunked-prefill settings (see test_connector_engine.py).
"""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import kvplug_config, prompt, run_scenario, same_output, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

CHUNK = 256
P = prompt(1600, 1)  # 6 chunks (1536 tokens) loadable
R = prompt(700, 5)  # never cached: shows the reload changed the answers
NO_CACHE = {"kvplug_load": False, "kvplug_save": False}
CHUNKED = {"max_num_batched_tokens": CHUNK}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    root = tmp_path_factory.mktemp("weights-models")  # its own: an engine here reloads weights
    return make_model("tiny", root=root), make_model("tiny", seed=4321, root=root)


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    old, new = models
    kv = transfer_config("kvplug", kvplug_config(tmp_path_factory.mktemp("store-a")))
    steps = [("gen", R, NO_CACHE), ("gen", P, None), ("gen", P, None),
             ("reload", str(new)), ("gen", R, NO_CACHE),
             ("gen", P, None),  # control: no reset yet
             ("reset", True), ("gen", P, None), ("gen", P, None)]
    names = ["r_old", "cold", "warm", "reload", "r_new", "stale", "reset", "after", "again"]
    a = dict(zip(names, run_scenario(old, kv, steps, CHUNKED), strict=True))
    kv_b = transfer_config("kvplug", kvplug_config(tmp_path_factory.mktemp("store-b")))
    a["fresh"] = run_scenario(new, kv_b, [("gen", P, None)], CHUNKED)[0]
    return a


def test_the_reload_changed_the_weights(runs):
    assert not same_output(runs["r_new"], runs["r_old"])  # an uncached prompt's answer changed
    assert runs["warm"]["kvplug"]["loaded_tokens"] == 1536  # kvplug was serving hits


def test_control_without_reset_serves_stale_kv(runs):
    assert runs["stale"]["kvplug"]["loaded_tokens"] == 1536
    assert not same_output(runs["stale"], runs["fresh"])


def test_after_reset_computed_and_equal_to_a_fresh_engine(runs):
    assert runs["reset"] is True
    assert runs["after"]["kvplug"]["loaded_tokens"] == 0
    assert runs["after"]["kvplug"]["lookup_hit_tokens"] == 0
    assert same_output(runs["after"], runs["fresh"])
    # and the new weights' KV is cached again (under the new epoch)
    assert runs["again"]["kvplug"]["loaded_tokens"] == 1536
    assert same_output(runs["again"], runs["fresh"])
