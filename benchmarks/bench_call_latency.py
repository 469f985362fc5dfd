"""Per-call latency at batch 1: the resp tier alone (``StorageManager.get`` / ``lookup_prefix``
of one key) against redis-py ``GET`` / ``EXISTS`` of the same value, interleaved call by call, so
a load spike on a shared machine hits every case alike (medians, ms).

    .venv/bin/python -m benchmarks.bench_call_latency [--calls 1500] [--label NAME]

It uses only the StorageManager's public calls, so the same script measures another kvplug tree
(a ``git archive`` of main imported instead of this one) for a before/after on one machine.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch
from kvplug.memory import MemoryObj, heap_memory_obj
from kvplug.storage_manager import StorageManager
from kvplug.testing.conformance import make_key

from tests.support.redis_server import RedisServer

CASES = ("raw GET", "tier get", "raw EXISTS", "tier lookup")


def _chunk(mib: float, seed: int) -> MemoryObj:
    obj = heap_memory_obj((32, 2, int(mib * (1 << 20)) // 64), num_tokens=256)
    gen = torch.Generator().manual_seed(seed)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def measure(url: str, raw: redis.Redis, mib: float, calls: int) -> dict[str, float]:
    """Median ms per case over ``calls`` calls each, the cases' order rotated call by call."""
    tier = {"backend": "resp", "timeout_s": 60.0,
            "options": {"url": url, "timeout_s": 15.0, "negative_cache_s": 0.0}}
    writer, reader = StorageManager({"tiers": [tier]}), StorageManager({"tiers": [tier]})
    try:
        keys = [make_key(int(mib * 100) * 1000 + i) for i in range(8)]
        writer.batched_put(keys, [_chunk(mib, i) for i in range(8)])
        assert writer.flush(60), "stores did not finish"
        names = [writer.backend(0).name_of(k) for k in keys]
        for k in keys:  # warm: connections, layouts, headers
            reader.get(k, promote=False).ref_down()
        times: dict[str, list[float]] = {c: [] for c in CASES}
        for i in range(calls):
            key, name = keys[i % len(keys)], names[i % len(keys)]
            cases: list[tuple[str, Callable[[], object]]] = [
                ("raw GET", lambda n=name: raw.get(n)),
                ("tier get", lambda k=key: reader.get(k, promote=False).ref_down()),
                ("raw EXISTS", lambda n=name: raw.exists(n)),
                ("tier lookup", lambda k=key: reader.lookup_prefix([k])),
            ]
            r = i % len(cases)
            for case, call in cases[r:] + cases[:r]:
                t = time.perf_counter()
                call()
                times[case].append(time.perf_counter() - t)
        return {c: statistics.median(v) * 1e3 for c, v in times.items()}
    finally:
        writer.evict(None)
        writer.close()
        reader.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--label", default="kvplug")
    args = ap.parse_args()
    logging.getLogger("kvplug").setLevel(logging.ERROR)
    srv = RedisServer(Path(tempfile.mkdtemp(prefix="kvplug-bench-calls-")) / "redis",
                      maxmemory="1gb")
    raw = redis.Redis.from_url(srv.url, socket_timeout=60)
    try:
        for mib in (0.25, 1.0):
            m = measure(srv.url, raw, mib, args.calls)
            print(f"{args.label} {mib:g} MiB: raw GET {m['raw GET']:.3f} tier get "
                  f"{m['tier get']:.3f} ({m['raw GET'] / m['tier get']:.2f}x) | raw EXISTS "
                  f"{m['raw EXISTS']:.3f} tier lookup {m['tier lookup']:.3f} "
                  f"({m['raw EXISTS'] / m['tier lookup']:.2f}x)", flush=True)
    finally:
        raw.close()
        srv.stop()


if __name__ == "__main__":
    main()
