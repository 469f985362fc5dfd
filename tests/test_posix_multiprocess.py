"""Two processes share one posix directory: nothing lost, no partial file read, bound kept."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch
from kvplug import chunkfile as cf
from kvplug.keys import CacheKey

SHAPE = (3, 2, 2500)  # padded layers
FILE_SIZE = cf.ALIGN + 3 * cf.align_up(2 * 2500)


def _key(i: int) -> CacheKey:
    return CacheKey("org/shared", "bfloat16", "LBHNC-bs16", 1, 0, i.to_bytes(4, "big") * 8)


def _expect(i: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (3 * 2 * 2500,), dtype=torch.uint8, generator=gen)


def _worker(root: str, me: int, other: int, n: int, capacity: int, out) -> None:
    from kvplug.storage_manager import StorageManager

    opts = {"path": root, "capacity": capacity or "1GiB", "io_threads": 2, "rescan_interval_s": 0}
    mgr = StorageManager({"tiers": [{"backend": "posix", "options": opts}], "chunk_size": 16})
    mine = range(me * 1000, me * 1000 + n)
    theirs = list(range(other * 1000, other * 1000 + n))
    wrong = hits = 0
    for j, i in enumerate(mine):
        obj = mgr.allocate(SHAPE, num_tokens=16)
        obj.byte_view.copy_(_expect(i))
        mgr.batched_put([_key(i)], [obj])
        obj.ref_down()
        for k in (theirs[j], theirs[(j * 7) % n]):  # read the neighbour's files as they land
            got = mgr.get(_key(k))
            if got is not None:
                hits += 1
                wrong += not torch.equal(got.byte_view, _expect(k))
                got.ref_down()
    mgr.flush(60)
    missing = []
    deadline = time.time() + 60
    for k in [*mine, *theirs]:
        while True:
            got = mgr.get(_key(k))
            if got is not None:
                wrong += not torch.equal(got.byte_view, _expect(k))
                got.ref_down()
                break
            if capacity or time.time() > deadline:  # with a bound, misses are expected
                missing.append(k)
                break
            time.sleep(0.01)
    stats = mgr.stats()["posix"]
    mgr.close()
    out.put({"me": me, "wrong": wrong, "hits": hits, "missing": missing,
             "corrupt": stats["corrupt"], "failed": stats["failed_puts"]})


def _run(root, n: int, capacity: int, monitor=None) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(root), me, 1 - me, n, capacity, out))
             for me in (0, 1)]
    for p in procs:
        p.start()
    results = []
    while len(results) < 2:
        if monitor:
            monitor()
        try:
            results.append(out.get(timeout=0.05))
        except Exception:  # noqa: BLE001 - queue.Empty
            if not any(p.is_alive() for p in procs) and out.empty():
                break
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"
    assert len(results) == 2
    return results


def _dir_bytes(root) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(cf.FILE_SUFFIX):
                try:
                    total += os.path.getsize(os.path.join(d, f))
                except FileNotFoundError:
                    pass
    return total


def test_two_processes_share_a_directory(tmp_path):
    results = _run(tmp_path, n=60, capacity=0)
    for r in results:
        assert r["wrong"] == 0, f"process {r['me']} read wrong bytes"
        assert r["corrupt"] == 0, f"process {r['me']} saw a partial/corrupt file"
        assert r["failed"] == 0 and r["missing"] == [], f"process {r['me']} lost {r['missing']}"
    assert sum(r["hits"] for r in results) > 0, "no cross-process read happened during writes"
    assert len(list(tmp_path.rglob("*" + cf.FILE_SUFFIX))) == 120
    assert not list(tmp_path.rglob("*.tmp"))


def test_two_processes_keep_the_capacity(tmp_path):
    capacity = 12 * FILE_SIZE
    peak = [0]

    def monitor() -> None:
        peak[0] = max(peak[0], _dir_bytes(tmp_path))

    results = _run(tmp_path, n=50, capacity=capacity, monitor=monitor)
    for r in results:
        assert r["wrong"] == 0 and r["corrupt"] == 0
    assert _dir_bytes(tmp_path) <= capacity, "directory over its bound after both closed"
    # While both run, each sees the other's files by rescanning before it evicts; writes in
    # flight in the other process (2 threads each) are the only slack.
    assert peak[0] <= capacity + 4 * FILE_SIZE, f"peak {peak[0]} > {capacity}"
