"""The first store and the first load after a worker starts, against the second, per tier.

    .venv/bin/python -m benchmarks.bench_first_request [--runs 3] [--tiers local_cpu,posix,resp]

Each measurement is a fresh Python process (what is set up lazily is set up once per process: an
import, a thread pool's threads, a connection, a first call of a torch kernel), built as vLLM's
worker builds kvplug's: a ``WorkerSide`` over KV caches of the tiny demo model's shape (4
layers, 64 KiB pages, 128-token blocks), ``register_kv_caches`` timed as its start-up. Two
requests of ``--prompt-len`` tokens (other chunks each) are stored, then loaded:

* **store**: from ``wait_for_save`` (the engine step's share in brackets) until the tier holds
  every chunk (the asynchronous save's put is over and the tier's queued writes landed: what a
  disaggregated consumer, or the next request, can then find);
* **load**: from the lookup until the blocks hold the chunks (in the step from L1 and from a local
  disk within the step's budget; in the background, as vLLM waits for it, from a remote tier).

``local_cpu``: one process stores and loads (L1 is the process's own memory). ``posix`` and
``resp`` (a redis-server on loopback, started here): L1 in front, as configured in practice;
one process stores (the producer), a second fresh one loads from the tier (the consumer: its L1
is empty). The anchor is the second request in the same process, after the same pause as the
first (``--settle``: vLLM warms its engine up between start-up and the first request, and a
server's requests arrive with gaps): the ratio first / second. Back to back (``--pause 0``) the
second also gains what a thread and a core woken seconds ago give (1-3 ms of 5-8 here), which is
not set-up the warm-up could do.
``--compare``: each measurement also without the start-up warm-up (``Transfers.warm_up`` and
``Runtime.start_threads`` patched out in the child: every pool, thread and copy path set up by
the first request that needs it, as before), interleaved with the warmed one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT = "FIRST-REQUEST "
LAYERS, HEADS, HEAD_DIM, BLOCK = 4, 4, 64, 128  # tiny's pages: K and V of 2 heads, bf16


def _worker(cfg: dict):
    """A WorkerSide as vLLM's worker builds it, over fresh KV caches; (worker, kv, startup s)."""
    import uuid

    import torch
    from kvplug.connector.protocol.config import ConnectorConfig
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.worker.side import WorkerSide

    from tests.support.gpu_kv_fixture import KVFixture

    fx = KVFixture("LBHNC", torch.bfloat16, L=LAYERS, B=cfg["blocks"], H=HEADS, N=BLOCK,
                   C=HEAD_DIM, seed=cfg["seed"])
    conn = ConnectorConfig(log_every_load=False, tiers=cfg["tiers"])
    w = WorkerSide(conn, Identity("bench-first", f"LBHNC-bs{BLOCK}", 1, 0,
                                  f"first-{uuid.uuid4().hex[:8]}"))
    t0 = time.perf_counter()
    w.register_kv_caches(fx.caches)
    return w, fx, time.perf_counter() - t0


def _hashes(tag: int, n: int) -> list[bytes]:
    import hashlib

    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def _store(w, tag: int, blocks: list[int], tokens: int) -> tuple[float, float]:
    """Store ``tokens`` tokens from ``blocks`` as request ``tag``: (seconds until every chunk
    is in the tiers, seconds of ``wait_for_save`` itself)."""
    from kvplug.connector.protocol.metadata import KVPlugMetadata, ReqMeta, SaveSpec

    chunk_size = w.cfg.chunk_size
    hashes = _hashes(tag, tokens // chunk_size)
    metadata = KVPlugMetadata(chunk_size, BLOCK, [ReqMeta(f"s{tag}", blocks, save=SaveSpec(0, tokens, 0,
                                                                                           hashes))])
    t0 = time.perf_counter()
    w.bind(metadata)
    w.wait_for_save(metadata)
    step = time.perf_counter() - t0
    saves = w._saves
    if saves is not None:
        assert saves.settle([w.key(h) for h in hashes], timeout=120)
    assert w.storage.flush(120)
    return time.perf_counter() - t0, step


def _load(w, tag: int, blocks: list[int], tokens: int) -> tuple[float, float, str]:
    """Look up and load request ``tag`` into ``blocks``: (seconds until they hold it, seconds
    of the lookup, how)."""
    from kvplug.connector.protocol.lookup import Lookup
    from kvplug.connector.protocol.metadata import KVPlugMetadata, LoadSpec, ReqMeta

    chunk_size = w.cfg.chunk_size
    hashes = _hashes(tag, tokens // chunk_size)
    req = f"l{tag}"
    t0 = time.perf_counter()
    found, slow, local = w._on_lookup(Lookup(tag, req, hashes))
    looked = time.perf_counter() - t0
    assert found == tokens, f"lookup found {found} of {tokens} tokens"
    background = bool(slow) or (bool(local) and tokens * LAYERS * HEADS * HEAD_DIM * 2
                                > int(w.cfg.in_step_load_bytes))
    metadata = KVPlugMetadata(chunk_size, BLOCK, [ReqMeta(req, blocks, load=LoadSpec(
        0, tokens, 0, hashes, background=background))])
    w.bind(metadata)
    w.start_load_kv(metadata)
    w.wait_for_save(metadata)
    while background:
        _, recving = w.get_finished(set(), idle=True)
        if req in recving:
            break
    seconds = time.perf_counter() - t0
    assert not w.take_load_errors(), "the load failed"
    return seconds, looked, "background" if background else "inline"


def child(cfg: dict) -> dict:
    """One fresh process's measurements (see the module docstring)."""
    t0 = time.perf_counter()
    import kvplug.connector.worker.side  # noqa: F401 - imported before the clock starts

    if not cfg.get("warm", True):  # the lazy set-up, as before the warm-up existed
        from kvplug.connector.worker.transfers import Transfers
        from kvplug.runtime import Runtime

        Transfers.warm_up = lambda self: None  # type: ignore[method-assign]
        Runtime.start_threads = lambda self, pool, workers, timeout=1.0: None  # type: ignore

    imported = time.perf_counter() - t0
    w, fx, startup = _worker(cfg)
    n = cfg["prompt_len"] // BLOCK
    out: dict = {"role": cfg["role"], "import_s": imported, "startup_s": startup}
    try:
        if cfg["role"] in ("store", "both"):
            for i, tag in enumerate((1, 2)):
                time.sleep(cfg["pause_s"][i])
                total, step = _store(w, tag, list(range(1 + i * n, 1 + (i + 1) * n)),
                                     cfg["prompt_len"])
                out[f"store{i + 1}_s"], out[f"store{i + 1}_step_s"] = total, step
        if cfg["role"] in ("load", "both"):
            for i, tag in enumerate((1, 2)):
                time.sleep(cfg["pause_s"][i])
                dst = list(range(1 + (2 + i) * n, 1 + (3 + i) * n))
                out[f"load{i + 1}_s"], out[f"lookup{i + 1}_s"], out["load_kind"] = _load(
                    w, tag, dst, cfg["prompt_len"])
                src = list(range(1 + i * n, 1 + (i + 1) * n)) if cfg["role"] == "both" else None
                if src is not None:  # the bytes arrived (same process: the source is here)
                    for layer in range(LAYERS):
                        for s, d in zip(src, dst, strict=True):
                            assert fx.ref_page(layer, d).equal(fx.ref_page(layer, s))
    finally:
        w.close()
    return out


def _run_child(cfg: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_first_request", "--child",
                           json.dumps(cfg)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(line[len(RESULT):])


def measure(tier: str, run: int, args: argparse.Namespace, workdir: Path, redis_url: str,
            warm: bool = True) -> dict:
    l1 = {"backend": "local_cpu", "options": {"capacity": "512MiB"}}
    blocks = 1 + 4 * (args.prompt_len // BLOCK)
    base = {"prompt_len": args.prompt_len, "blocks": blocks, "seed": run, "warm": warm,
            "pause_s": [args.settle, args.settle if args.pause is None else args.pause]}
    run = 2 * run + (not warm)  # its own directory and key prefix
    if tier == "local_cpu":
        return child({**base, "tiers": [l1], "role": "both"}) if args.inline \
            else _run_child({**base, "tiers": [l1], "role": "both"})
    if tier == "posix":
        lower = {"backend": "posix", "options": {"path": str(workdir / f"posix-{run}"),
                                                 "capacity": "4GiB"}}
    else:
        lower = {"backend": "resp", "options": {"url": redis_url, "prefix": f"first{run}:"}}
    stored = _run_child({**base, "tiers": [l1, lower], "role": "store"})
    loaded = _run_child({**base, "tiers": [l1, lower], "role": "load"})
    return {**stored, **{k: v for k, v in loaded.items() if k.startswith(("load", "lookup"))},
            "load_startup_s": loaded["startup_s"]}


def report(rows: dict[str, list[dict]]) -> None:
    """Medians over the runs (ms), and the median of each run's own ratio first / second."""
    ms = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    print(f"\n{'tier':17} {'store 1st':>10} {'2nd':>8} {'ratio':>6} {'load 1st':>10} {'2nd':>8} "
          f"{'ratio':>6}  {'(step 1st/2nd ms)':>18}  {'(lookup 1st/2nd ms)':>19}  start-up ms"
          "   load")
    for tier, runs in rows.items():
        s1, s2 = ms([r["store1_s"] for r in runs]), ms([r["store2_s"] for r in runs])
        l1, l2 = ms([r["load1_s"] for r in runs]), ms([r["load2_s"] for r in runs])
        st1, st2 = ms([r["store1_step_s"] for r in runs]), ms([r["store2_step_s"] for r in runs])
        lk1, lk2 = ms([r["lookup1_s"] for r in runs]), ms([r["lookup2_s"] for r in runs])
        start = ms([r["startup_s"] for r in runs])
        rs = statistics.median(r["store1_s"] / r["store2_s"] for r in runs)
        rl = statistics.median(r["load1_s"] / r["load2_s"] for r in runs)
        print(f"{tier:17} {s1:10.1f} {s2:8.1f} {rs:6.2f} {l1:10.1f} {l2:8.1f} {rl:6.2f}"
              f"  {st1:8.1f} / {st2:7.1f}  {lk1:9.2f} / {lk2:7.2f}  {start:11.1f}   "
              f"{runs[0]['load_kind']}")
        worst_s = max(r["store1_s"] / r["store2_s"] for r in runs)
        worst_l = max(r["load1_s"] / r["load2_s"] for r in runs)
        print(f"{'':17} worst of {len(runs)} runs: store {worst_s:.2f}x, load {worst_l:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per tier")
    ap.add_argument("--tiers", default="local_cpu,posix,resp")
    ap.add_argument("--prompt-len", type=int, default=2816, help="tokens per request (chunks "
                    "of 256)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between a worker's "
                    "start-up and its first request (vLLM warms its engine up meanwhile)")
    ap.add_argument("--pause", type=float, default=None, help="seconds before the second "
                    "request (default: --settle, as before the first; 0: back to back)")
    ap.add_argument("--raw", help="write every run's figures (JSON) to this file")
    ap.add_argument("--compare", action="store_true", help="also measure without the start-up "
                    "warm-up (interleaved)")
    ap.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    workdir = Path(tempfile.mkdtemp(prefix="kvplug-first-"))
    redis = None
    try:
        tiers = args.tiers.split(",")
        url = ""
        if "resp" in tiers:
            from tests.support.redis_server import RedisServer

            redis = RedisServer(workdir / "redis")
            url = redis.url
        arms = [True, False] if args.compare else [True]
        rows: dict[str, list[dict]] = {f"{t}{'' if w else ' (lazy)'}": [] for t in tiers
                                       for w in arms}
        for run in range(args.runs):  # tiers and arms alternate within a run: load spread evenly
            for tier in tiers:
                for warm in arms:
                    rows[f"{tier}{'' if warm else ' (lazy)'}"].append(
                        measure(tier, run, args, workdir, url, warm))
        if args.raw:
            Path(args.raw).write_text(json.dumps(rows))
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        report(rows)
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
