"""Two vLLM engine processes share one redis-server through the resp tier (its only tier).

Engine A serves some prompts (its loads off): it stores their chunks in the server this test
started on 127.0.0.1. Engine B, a separate process, computes its own references for every prompt
(loading and saving off), then serves the prompts again with kvplug on. Checked: every chunk B
loads came from the resp tier, written by A; B's outputs with those hits are bit-identical to B's
references and to A's outputs; every full chunk of A's prompts hits; prompts A never served get
no hit (the negative control); no load failed, nothing is corrupt, nothing stays pinned.
"""

from __future__ import annotations

import json

import pytest
from redis_server import RedisServer
from vllm_helpers import REPO, prompt, run_script, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

CHUNK = 256  # tokens per scheduler step (chunked prefill)
BLOCK = 128  # vLLM's block size for this engine: hits (and a chunk's partial tail) are whole blocks
SHARED = [prompt(600 + 50 * i, 700 + i) for i in range(3)]  # A serves these
FRESH = [prompt(520, 800)]  # nobody stores these before B looks them up
OFF = {"kvplug_load": False, "kvplug_save": False}


def tier_state(_worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.storage.stats()


def _engine(spec: dict) -> dict:
    import vllm_helpers as h
    from test_resp_engine import FRESH, OFF, SHARED, tier_state

    llm = h.make_llm(spec["model"], spec["kv"], max_num_batched_tokens=CHUNK, max_model_len=2048,
                     num_gpu_blocks_override=32)
    out: dict = {}
    if spec["role"] == "writer":
        out["served"] = [h.generate_full(llm, [p], params=[{"kvplug_load": False}])[0]
                         for p in SHARED]
    else:
        out["refs"] = [h.generate_full(llm, [p], params=[OFF])[0] for p in SHARED + FRESH]
        out["served"] = [h.generate_full(llm, [p])[0] for p in SHARED + FRESH]
    out["state"] = llm.collective_rpc(tier_state)[0]
    return out


def _run(spec: dict) -> dict:
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO / 'tests')!r}); "
            "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'; "
            "import vllm_helpers as h; from test_resp_engine import _engine; "
            f"print(h.RESULT + json.dumps(_engine(json.loads({json.dumps(spec)!r}))), flush=True)")
    return run_script(code, timeout=420)


def test_two_engines_share_one_redis(tmp_path):
    from kvplug.connector.demo.model import make_model

    srv = RedisServer(tmp_path / "redis", maxmemory="512mb")
    try:
        model = make_model("tiny", root=tmp_path / "models")
        # L1 in front, as deployed: B's loads are read in place into its pool
        tiers = [{"backend": "local_cpu", "options": {"capacity": "64MiB"}},
                 {"backend": "resp", "timeout_s": 10.0,
                  "options": {"url": srv.url, "timeout_s": 5.0, "negative_cache_s": 0}}]
        kv = transfer_config("kvplug", {"tiers": tiers})
        a = _run({"model": str(model), "kv": kv, "role": "writer"})
        stored = srv.client().dbsize()
        b = _run({"model": str(model), "kv": kv, "role": "reader"})
    finally:
        srv.stop()

    same = lambda x, y: (x["tokens"], x["logprobs"]) == (y["tokens"], y["logprobs"])  # noqa: E731
    # hits cover every full block; stores are chunks of CHUNK tokens, the last one partial
    full_chunks = [len(p) // BLOCK * BLOCK for p in SHARED]
    keys = sum(-(-n // CHUNK) for n in full_chunks)
    # B's references agree with what A computed, and every output of B is exact
    assert all(same(x, y) for x, y in zip(a["served"], b["refs"]))
    assert all(same(x, y) for x, y in zip(b["served"], b["refs"], strict=True))
    reports = [x["kvplug"] for x in b["served"]]
    # every full chunk of A's prompts was loaded from the resp tier; A's own loads were off
    assert [r["tiers"].get("resp", 0) for r in reports[: len(SHARED)]] == full_chunks, reports
    assert all(x["kvplug"]["loaded_tokens"] == 0 for x in a["served"])
    # the negative control: a prompt nobody stored before hits nothing
    assert reports[len(SHARED)]["lookup_hit_tokens"] == 0, reports[len(SHARED)]
    assert all(r["failed_blocks"] == 0 for r in reports)
    for st in (a["state"]["resp"], b["state"]["resp"]):
        assert st["corrupt"] == 0 and st["pinned"] == 0 and st["breaker_trips"] == 0, st
    assert stored == keys and a["state"]["resp"]["written"] >= keys, (stored, keys, a["state"])
    # all but the first chunk B read (which taught the layout) and chunks of another shape (a
    # partial last chunk) went straight into B's pool
    st = b["state"]["resp"]
    assert st["reads_in_place"] >= keys - 1 - st["layout_misses"] > 0, st
    print(json.dumps({"stored_keys": stored, "loaded": [r["tiers"] for r in reports],
                      "a_written": a["state"]["resp"]["written"],
                      "b_bytes_got": b["state"]["resp"]["bytes_got"],
                      "b_reads_in_place": st["reads_in_place"]}))
