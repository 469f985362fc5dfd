"""Faults on a real engine: a chunk that vanishes between lookup and load, a tier that raises,
stalls, or returns fewer tokens than promised, a lookup that stalls. Generation completes with the
cold output (the blocks are recomputed) and the failure is reported."""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import prompt, run_scenario, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

MODES = ["vanish", "raise", "stall", "truncate", "stall_lookup"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")
    control = tmp_path_factory.mktemp("fault") / "mode"
    extra = {"tiers": [{"backend": "tests.support.vllm_helpers:FaultTier", "options": {"control": str(control)},
                        "timeout_s": 1.0}],
             "lookup_timeout_s": 1.0}
    steps: list[tuple] = []
    for i, mode in enumerate(MODES):
        p = prompt(1100, 100 + i)
        steps += [("write", str(control), "ok"), ("gen", p, None), ("gen", p, None),
                  ("write", str(control), mode), ("gen", p, None)]
    out = run_scenario(model, transfer_config("kvplug", extra), steps,
                       {"max_num_batched_tokens": 256})
    # per mode: [write ok, cold, warm, write mode, faulty]
    return {mode: out[5 * i: 5 * i + 5] for i, mode in enumerate(MODES)}


@pytest.mark.parametrize("mode", MODES)
def test_fault_recomputes_exactly(results, mode):
    _, cold, warm, _, faulty = results[mode]
    same = lambda a, b: a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]  # noqa: E731
    assert warm["kvplug"]["loaded_tokens"] == 1024  # the tier works before the fault
    assert warm["kvplug"]["async_load"] is True  # a tier that may block: a background load
    assert same(warm, cold)
    assert same(faulty, cold)
    assert faulty["kvplug"]["loaded_tokens"] == 0
    if mode == "stall_lookup":
        assert faulty["kvplug"]["lookup_hit_tokens"] == 0  # a late worker is a miss
    else:
        assert faulty["kvplug"]["failed_blocks"] == 8  # counted, then recomputed
