"""A multi-turn chat on a real vLLM engine (CPU): turn N+1 = turn N's prompt + answer + a new
message, and kvplug's warm turns are bit-identical to vLLM's own prefix cache serving the same
turns.

Like with like: both engines have the same configuration (kvplug connector, vLLM's prefix cache
on, a small KV space), so their cold first turns are identical. In the kvplug engine, filler
prompts evict the chat's blocks from vLLM's KV space before each later turn, so the turn's prefix
comes from kvplug (the KV of turn N's prompt *and answer*, stored at request end); in the
reference engine nothing evicts them and the turn asks kvplug for nothing, so vLLM's own cache
serves the same prefix. The answers are sized so that both hits end at the same place (the
answer's last computed token ends a chunk), and the tokens after it are computed in one step in
both engines."""

from __future__ import annotations

import json

import pytest

from tests.support.vllm_helpers import REPO, RESULT, kvplug_config, prompt, run_script, same_output, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

FIRST = prompt(700, 21)
# (answer tokens, next message): turn 1 computes 700 + 69 - 1 = 768 tokens (3 chunks), turn 2
# 1009 + 16 - 1 = 1024 (4 chunks); turn 3 is the last.
TURNS = [(69, prompt(240, 22)), (16, prompt(240, 23)), (8, [])]
FILLERS = [[prompt(1200, 100 + 10 * t + i) for i in range(3)] for t in range(len(TURNS))]
ENGINE = {"enable_prefix_caching": True, "num_gpu_blocks_override": 20,  # 20 x 128 tokens
          "max_model_len": 2048}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


def _chat(spec: dict) -> list[dict]:
    """In the engine's process: run the chat; ``evict``: fillers before every later turn."""
    from tests.support import vllm_helpers as h

    llm = h.make_llm(spec["model"], spec["kv"], **spec["engine"])
    history, out = list(spec["first"]), []
    for i, (answer, message) in enumerate(spec["turns"]):
        if spec["evict"] and i:
            h.generate_full(llm, spec["fillers"][i], max_tokens=1)
        r = h.generate_full(llm, [history], max_tokens=answer, params=[spec["params"]])[0]
        r["prompt_len"] = len(history)
        out.append(r)
        if i == len(spec["turns"]) - 1:  # control: one token of the last message changed
            changed = list(history)
            changed[-5] = changed[-5] % 4000 + 3
            out.append(h.generate_full(llm, [changed], max_tokens=answer,
                                       params=[spec["params"]])[0])
        history = history + r["tokens"] + message
    return out


def chat(model, tmp_path, evict: bool, params: dict | None) -> list[dict]:
    spec = {"model": str(model), "kv": transfer_config("kvplug", kvplug_config(tmp_path)),
            "engine": ENGINE, "first": FIRST, "turns": TURNS, "fillers": FILLERS,
            "evict": evict, "params": params}
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); "
            "from tests.engine import test_connector_engine_chat as t; "
            f"print({RESULT!r} + json.dumps(t._chat(json.loads({json.dumps(spec)!r}))), "
            "flush=True)")
    return run_script(code, timeout=900)


def test_warm_turns_equal_vllms_own_prefix_cache(model, tmp_path):
    kv = chat(model, tmp_path / "kvplug", evict=True, params=None)
    native = chat(model, tmp_path / "native", evict=False, params={"kvplug_load": False})
    assert [t["prompt_len"] for t in kv[:3]] == [700, 1009, 1265]
    # the hits: kvplug's (the fillers evicted vLLM's copy) and vLLM's own, both 768 then 1024
    assert [(t["kvplug"] or {}).get("loaded_tokens", 0) for t in kv[:3]] == [0, 768, 1024]
    assert [t["cached"] for t in kv[:3]] == [0, 768, 1024]
    assert [t["cached"] for t in native[:3]] == [0, 768, 1024]
    assert [(t["kvplug"] or {}).get("loaded_tokens", 0) for t in native[:3]] == [0, 0, 0]
    for i in range(3):  # turn 1 is cold in both: the like-for-like precondition
        assert same_output(kv[i], native[i]), f"turn {i + 1} differs"
    assert not same_output(kv[3], kv[2]) and same_output(kv[3], native[3])  # control: output follows context
