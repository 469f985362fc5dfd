"""Corruption while serving: random byte flips and truncations of random chunk
files while a real vLLM engine (CPU) serves from the posix tier.

One engine process. Every prompt is first served cold (its reference: like for like, the chunked
prefill cuts at kvplug's chunk boundaries, so a warm hit does the same work as the cold run). Then
rounds: a thread damages random chunk files (a flipped byte in the header or a layer, or the file
cut short) at a random moment while the main thread serves every prompt again; a last round
damages nothing and reads whatever is still damaged. Checks: every output equals its reference
(0 wrong outputs); every damaged file is either gone (quarantined) or still the damaged file
(never read since); the posix tier's ``corrupt`` counter equals the number quarantined (each bad
file counted once); every other file on disk still verifies. The damage is chosen by the test's
own seeded RNG, not by the code under test.
"""

from __future__ import annotations

import json

import pytest

from tests.support.corruption_campaign import run_corruption, summary
from tests.support.vllm_helpers import prompt, same_output

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

PROMPTS = [prompt(1100, 500 + i) for i in range(5)]  # 4 chunks each (1024 tokens loadable)
ROUNDS = 4
SEED = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")
    store = tmp_path_factory.mktemp("corrupt-store")
    out = run_corruption(model, store, PROMPTS, ROUNDS, SEED)
    print("FIGURES corruption", json.dumps(summary(out)))  # for docs/reliability.md (pytest -s)
    return out


def test_no_wrong_output(run):
    wrong = [(r, i) for r, outs in enumerate(run["rounds"]) for i, o in enumerate(outs)
             if not same_output(o, run["cold"][i])]
    assert wrong == []
    # the control: hits happened (the check is not vacuous) and damage made loads fail
    assert sum(o["kvplug"]["loaded_tokens"] for outs in run["rounds"] for o in outs) > 0
    assert sum(o["kvplug"]["failed_blocks"] for outs in run["rounds"] for o in outs) > 0


def test_each_bad_file_quarantined_and_counted_once(run):
    damaged = run["damaged"]
    assert len(damaged) >= ROUNDS * 2
    gone = [d for d in damaged if d["path"] not in run["present"]]
    # still on disk: either the damaged file itself (no load reached it yet: it does not verify)
    # or a whole file stored again after the damaged one was quarantined
    unread = [d for d in damaged if d["path"] in run["present"] and run["files"][d["path"]] != "ok"]
    rewritten = [d for d in damaged
                 if d["path"] in run["present"] and run["files"][d["path"]] == "ok"]
    quarantined = len(gone) + len(rewritten)
    assert quarantined > 0
    assert run["stats"]["corrupt"] == quarantined
    # every file on disk verifies, except damaged ones no load has reached yet
    bad = {p for p, why in run["files"].items() if why != "ok"}
    assert bad == {d["path"] for d in unread}
    assert run["stats"]["read_errors"] == 0
    fig = summary(run)  # the figures reported in docs/reliability.md agree with the above
    assert (fig["wrong_outputs"], fig["quarantined"]) == (0, quarantined)
