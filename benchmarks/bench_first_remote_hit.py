"""The first remote hit after an engine starts vs the second, and vs a first request that misses.

    flock /tmp/kvplug-engine.lock .venv/bin/python -m benchmarks.bench_first_remote_hit \\
        [--prompt-len 2816] [--model small]

A ``redis-server`` on 127.0.0.1 (started here) is the only tier (``resp``, no L1), as in the
measurement that found a first hit of 3.7 s. One engine process stores four prompts; then two
fresh engine processes on the same server, each timing requests of ``max_tokens=2`` (TTFT):

* ``hit first``: hit, hit (another prompt), miss (a prompt nobody stored), the first hit again;
* ``miss first``: miss, hit, hit.

If the first request of a fresh engine is slow whether it hits or misses, the time is the
engine's own first step (vLLM's warm-up on this CPU), not kvplug's; if only a first *hit* is
slow, it is kvplug's (connection set-up, lookups answered "ask again", a load's thread start).
Each request's kvplug report (``report_to_client``) is printed beside it (which tier served, the
load's milliseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT = "FIRST-REMOTE "


def run(cfg: dict) -> dict:
    from kvplug.connector.demo.model import PRESETS
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    tiers = [{"backend": "resp", "timeout_s": 10.0, "options": {"url": cfg["url"]}}]
    kv = KVTransferConfig(kv_connector="KVPlugConnector", kv_role="kv_both",
                          kv_connector_module_path="kvplug.connector",
                          kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"tiers": tiers, "log_every_load": False,
                                                     "report_to_client": True})
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=8192, max_num_batched_tokens=8192,
              dtype="bfloat16", disable_log_stats=True, kv_transfer_config=kv)
    started = time.perf_counter() - t0
    rng = random.Random(5)
    vocab = PRESETS[cfg["preset"]]["vocab_size"]
    prompts = {name: [rng.randrange(3, vocab) for _ in range(cfg["prompt_len"])]
               for name in ("h1", "h2", "h3", "h4", "m1", "m2")}
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = []
    for name in cfg["order"]:
        t = time.perf_counter()
        (res,) = llm.generate([TokensPrompt(prompt_token_ids=prompts[name])], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        rep = (res.kv_transfer_params or {}).get("kvplug") or {}
        out.append([name, round(dt * 1e3, 1), rep])
    return {"startup_s": round(started, 1), "requests": out}


def child(cfg: dict) -> dict | None:
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--one", json.dumps(cfg)],
                          capture_output=True, timeout=900)
    line = next((x for x in proc.stdout.decode().splitlines() if x.startswith(RESULT)), None)
    if line is None:
        print(proc.stderr.decode()[-3000:], file=sys.stderr)
        return None
    return json.JSONDecoder().raw_decode(line[len(RESULT):])[0]


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        print(RESULT + json.dumps(run(json.loads(sys.argv[2]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompt-len", type=int, default=2816)
    args = ap.parse_args()
    from kvplug.connector.demo.model import make_model

    from tests.support.redis_server import RedisServer

    work = Path(tempfile.mkdtemp(prefix="kvplug-first-remote-"))
    srv = RedisServer(work / "redis", maxmemory="2gb")
    base = {"model": str(make_model(args.model, weights=True, max_len=8192)),
            "preset": args.model, "prompt_len": args.prompt_len, "url": srv.url}
    try:
        runs = {"store": ["h1", "h2", "h3", "h4"], "hit first": ["h1", "h2", "m1", "h1"],
                "miss first": ["m2", "h3", "h4"]}
        for label, order in runs.items():
            r = child(dict(base, order=order))
            if r is None:
                return 1
            reqs = ", ".join(f"{n} {ms:.0f} ms ({json.dumps(rep, separators=(',', ':'))})"
                             for n, ms, rep in r["requests"])
            print(f"{label}: engine start {r['startup_s']} s; {reqs}", flush=True)
            if label == "store":  # the chunks land in the server from the writer threads
                want = len(order) * (args.prompt_len // 256)
                deadline = time.monotonic() + 60
                while srv.client().dbsize() < want and time.monotonic() < deadline:
                    time.sleep(0.2)
        print(f"keys in the server: {srv.client().dbsize()}")
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
