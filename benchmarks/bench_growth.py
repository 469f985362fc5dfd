"""Cost as the cache grows: a posix tier of 10k / 100k / 1M chunk files, and L1 with a large pool.

    .venv/bin/python -m benchmarks.bench_growth --dir /tmp/kvplug-growth --sizes 10000,100000,1000000
    .venv/bin/python -m benchmarks.bench_growth --l1-gib 8          # L1 start-up only

Each size gets its own directory of small real chunk files (1 layer, 256-byte page: ~4.4 KiB on
disk, every header valid) written once and reused by later runs (``--keep``; removed otherwise).
For each size, in one process:

* startup: time until ``PosixBackend(...)`` returns and ``get`` of a stored key returns its bytes
  (serving can start), and until the index holds every file (``wait_indexed``);
  baseline: a bare ``os.scandir`` + ``stat`` of the same tree (the floor of any scan);
* index memory per chunk: ``tracemalloc`` of what a completed index keeps;
* ``contains`` of 512 indexed keys (and of 512 keys never stored), median of 20 calls;
* eviction: ``evict(None, nbytes)`` of 64 chunks' bytes, median of 20 calls (the files are deleted
  in the background: the time to finish the deletes still queued after the calls is reported
  beside it); and one store into a
  full tier (capacity = what is on disk), which may rescan the directory;
* ``kvplug inspect`` (header of every file) in-process;
* the index's own share of an eviction: ``take_victims`` of 64 entries of an in-memory index of
  the same size (no file deleted; the rest of ``evict`` is the file system's ``unlink``).

Growth is reported as the ratio of each figure at a size to the same figure at the smallest size
in the same run ("flat" = ~1x). L1: ``local_cpu`` with a ``--l1-gib`` pool: time for the
constructor, until the background prefault has backed every page, RSS after; the first 4 MiB store
while the prefault runs and after it, against a plain ``torch.empty`` + fill of the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time
import tracemalloc
from pathlib import Path

import torch
from kvplug import chunkfile as cf
from kvplug.backends.local_cpu import LocalCPUBackend
from kvplug.backends.posix import PosixBackend
from kvplug.backends.posix.index import PosixIndex, ScanResult, pack_rel, scan
from kvplug.cli.inspect import Store
from kvplug.cli.inspect import scan as inspect_scan
from kvplug.hookspecs import TierContext
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, heap_memory_obj

MODEL = "Qwen/Qwen2.5-7B-Instruct"  # a realistic name length (file names carry it)


def key(i: int) -> CacheKey:
    return CacheKey(MODEL, "bfloat16", "LBHNC-bs16", 1, 0, i.to_bytes(8, "big") * 4)


def populate(root: Path, n: int) -> int:
    """``n`` real chunk files under ``root`` (skipped if a marker says they are there)."""
    marker = root / ".populated"
    if marker.exists() and int(marker.read_text()) == n:
        return n
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    obj = heap_memory_obj((1, 1, 256), torch.uint8, MemoryFormat.KV_PAGES, 16)
    obj.byte_view.copy_(torch.randint(0, 256, (256,), dtype=torch.uint8))
    made: set[str] = set()
    t0 = time.perf_counter()
    for i in range(n):
        k = key(i)
        shard = cf.shard_of(k)
        if shard not in made:
            (root / shard).mkdir(exist_ok=True)
            made.add(shard)
        header, bufs = cf.encode_chunk(k, obj)
        with open(root / cf.relative_chunk_path(k), "wb") as f:
            f.write(header)
            for b in bufs:
                f.write(b)
        if i and i % 200_000 == 0:
            print(f"  populated {i} files ({time.perf_counter() - t0:.0f} s)", flush=True)
    marker.write_text(str(n))
    return n


def bare_scan(root: Path) -> int:
    n = 0
    for shard in os.scandir(root):
        if shard.is_dir():
            for f in os.scandir(shard.path):
                f.stat()
                n += 1
    return n


def median_ms(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def index_bytes_per_chunk(root: Path, n: int) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PosixIndex()
    index.merge(scan(root))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(index) == n, (len(index), n)
    del index
    return used / n


def measure(root: Path, n: int, inspect_too: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    assert bare_scan(root) == n
    out["bare_scan_ms"] = (time.perf_counter() - t0) * 1e3

    t0 = time.perf_counter()
    be = PosixBackend(TierContext("disk", PosixBackend.Options(path=str(root), capacity=1 << 50),
                                  heap_memory_obj))
    out["ctor_ms"] = (time.perf_counter() - t0) * 1e3
    probe = key(n // 2)
    assert be.contains([probe], pin=False) == [True]
    obj = be.get(probe)
    assert obj is not None
    obj.ref_down()
    out["first_hit_ms"] = (time.perf_counter() - t0) * 1e3
    wait = getattr(be, "wait_indexed", None)
    if wait is not None:
        assert wait(600)
    out["indexed_ms"] = (time.perf_counter() - t0) * 1e3
    assert be.stats()["entries"] == n

    hits = [key(i) for i in range(0, n, max(1, n // 512))][:512]
    misses = [key(n + i) for i in range(512)]
    out["contains_hit_ms"] = median_ms(lambda: be.contains(hits, pin=False))
    out["contains_miss_ms"] = median_ms(lambda: be.contains(misses, pin=False))
    size = os.path.getsize(root / cf.relative_chunk_path(key(0)))
    evicted = []

    def evict() -> None:  # deletes files: put them back afterwards (outside the timing)
        before = be.stats()["evictions"]
        be.evict(keys=None, nbytes=64 * size)
        evicted.append(be.stats()["evictions"] - before)

    out["evict64_ms"] = median_ms(evict)
    assert all(e == 64 for e in evicted), evicted
    t0 = time.perf_counter()  # the deletes queued by those calls (background, .reaper)
    assert be.flush(600)
    out["evict_deletes_left_ms"] = (time.perf_counter() - t0) * 1e3
    be.close()
    del be
    populate_missing(root, n)

    # one store into a full tier: make room evicts one file (and may rescan the directory)
    be = PosixBackend(TierContext("disk", PosixBackend.Options(path=str(root), capacity=n * size),
                                  heap_memory_obj))
    if getattr(be, "wait_indexed", None):
        assert be.wait_indexed(600)
    extra = heap_memory_obj((1, 1, 256), torch.uint8, MemoryFormat.KV_PAGES, 16)
    times = []
    for j in range(3):
        t0 = time.perf_counter()
        be.batched_submit_put([key(10 * n + j)], [extra])
        assert be.flush(600)
        times.append((time.perf_counter() - t0) * 1e3)
    out["full_put_first_ms"], out["full_put_next_ms"] = times[0], statistics.median(times[1:])
    assert be.stats()["writes"] == 3
    be.close()
    populate_missing(root, n, drop_extra=True)

    out["index_B_per_chunk"] = index_bytes_per_chunk(root, n)
    out["index_evict64_ms"] = index_evict_ms(n)
    if inspect_too:
        t0 = time.perf_counter()
        report = inspect_scan(Store(str(root), {}), verify=False)
        out["inspect_ms"] = (time.perf_counter() - t0) * 1e3
        assert report["chunks"] == n and not report["corrupt"]
    return out


def index_evict_ms(n: int) -> float:
    """``take_victims`` of 64 entries from an in-memory index of ``n`` (no file deleted): the
    index's own share of an eviction, median of 20."""
    import random

    rng = random.Random(1)
    entries = {}
    for i in range(n):
        k = CacheKey(MODEL, "bfloat16", "LBHNC-bs16", 1, 0, rng.randbytes(32))
        entries[pack_rel(cf.relative_chunk_path(k))] = (int((1.7e9 + i) * 1000) << 44) | 4400
    index = PosixIndex()
    index.merge(ScanResult(entries, 1.8e9))
    return median_ms(lambda: index.take_victims(64 * 4400))


def populate_missing(root: Path, n: int, drop_extra: bool = False) -> None:
    """Rewrite files that a measurement evicted (and delete the extra ones a store added)."""
    obj = heap_memory_obj((1, 1, 256), torch.uint8, MemoryFormat.KV_PAGES, 16)
    for i in range(n):
        path = root / cf.relative_chunk_path(key(i))
        if not path.exists():
            header, bufs = cf.encode_chunk(key(i), obj)
            path.write_bytes(header + b"".join(bytes(b) for b in bufs))
    if drop_extra:
        for j in range(3):
            (root / cf.relative_chunk_path(key(10 * n + j))).unlink(missing_ok=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def l1_startup(gib: float) -> dict[str, float]:
    out: dict[str, float] = {}
    chunk = 4 << 20
    ref = torch.empty(chunk, dtype=torch.uint8)
    t0 = time.perf_counter()
    ref.fill_(1)  # baseline: a fresh buffer's first touch
    out["baseline_first_touch_ms"] = (time.perf_counter() - t0) * 1e3
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    be = LocalCPUBackend(TierContext("l1", LocalCPUBackend.Options(capacity=int(gib * (1 << 30))),
                                     None))
    out["ctor_ms"] = (time.perf_counter() - t0) * 1e3

    def store(i: int) -> float:
        t = time.perf_counter()
        obj = be.pool.allocate((chunk,), torch.uint8, MemoryFormat.KV_PAGES, 256)
        assert obj is not None
        obj.tensor.fill_(i)
        be.batched_submit_put([key(i)], [obj])
        obj.ref_down()
        got = be.get(key(i))
        assert got is not None
        got.ref_down()
        return (time.perf_counter() - t) * 1e3

    out["first_store_during_prefault_ms"] = store(0)
    from kvplug.pool import PREFAULT_AHEAD  # the pool backs this much ahead of its allocations

    ahead = min(be.pool.capacity, PREFAULT_AHEAD)
    while be.pool._frontier is not None and be.pool._frontier.backed < ahead:
        time.sleep(0.001)
    out["prefault_done_ms"] = (time.perf_counter() - t0) * 1e3  # the margin ahead is backed
    out["rss_growth_gib"] = (rss_bytes() - rss0) / (1 << 30)
    out["store_after_prefault_ms"] = statistics.median(store(i) for i in range(1, 6))
    be.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/kvplug-growth")
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--no-inspect", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the populated directories")
    ap.add_argument("--l1-gib", type=float, default=0, help="also measure L1 with this pool")
    ap.add_argument("--skip-posix", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows = {}
    if not args.skip_posix:
        for n in sizes:
            root = Path(args.dir) / str(n)
            populate(root, n)
            rows[n] = measure(root, n, not args.no_inspect)
            print(n, {k: round(v, 2) for k, v in rows[n].items()}, flush=True)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        base = rows[sizes[0]]
        cols = list(base)
        print("\n| figure | " + " | ".join(f"{n:,}" for n in sizes) + " | growth (largest/smallest) |")
        print("|---|" + "---|" * (len(sizes) + 1))
        for c in cols:
            vals = " | ".join(f"{rows[n][c]:.2f}" for n in sizes)
            print(f"| {c} | {vals} | {rows[sizes[-1]][c] / max(base[c], 1e-9):.2f}x |")
    if args.l1_gib:
        print("L1", {k: round(v, 2) for k, v in l1_startup(args.l1_gib).items()})


if __name__ == "__main__":
    main()
