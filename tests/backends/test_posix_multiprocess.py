"""Two processes share one posix directory: nothing lost, no partial file read, bound kept."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.testing import make_key

SHAPE = (3, 2, 2500)  # padded layers
FILE_SIZE = cf.ALIGN + 3 * cf.align_up(2 * 2500)


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
        mgr.batched_put([make_key(i)], [obj])
        obj.ref_down()
        for k in (theirs[j], theirs[(j * 7) % n]):  # read the neighbour's files as they land
            got = mgr.get(make_key(k))
            if got is not None:
                hits += 1
                wrong += not torch.equal(got.byte_view, _expect(k))
                got.ref_down()
    mgr.flush(60)
    missing = []
    deadline = time.time() + 60
    for k in [*mine, *theirs]:
        while True:
            got = mgr.get(make_key(k))
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


def _evictor(root: str, how: str, keys: list[int]) -> None:
    """Another process on the same directory: evicts ``keys`` by name, or by capacity pressure
    (a bound of one file, then one store of its own)."""
    from kvplug.storage_manager import StorageManager

    cap = FILE_SIZE if how == "capacity" else "1GiB"
    opts = {"path": root, "capacity": cap, "io_threads": 1, "rescan_interval_s": 0}
    with StorageManager({"tiers": [{"backend": "posix", "options": opts}], "chunk_size": 16}) as mgr:
        if how == "evict":
            mgr.evict([make_key(i) for i in keys])
        else:
            obj = mgr.allocate(SHAPE, num_tokens=16)
            obj.byte_view.copy_(_expect(500))
            mgr.batched_put([make_key(500)], [obj])
            obj.ref_down()
            assert mgr.flush(60)


@pytest.mark.parametrize("how", ["evict", "capacity"])
def test_a_pin_holds_against_another_process(tmp_path, how):
    """Process A pins key 1 (contains(pin=True)); process B deletes A's files (evict(keys), or
    its own capacity bound). A's get of the pinned key still returns the exact bytes; key 2,
    not pinned, is a miss (control: B really deleted the files). After unpin the fd is gone."""
    from kvplug.backends.posix import PosixBackend
    from kvplug.hookspecs import TierContext
    from kvplug.memory import heap_memory_obj

    be = PosixBackend(TierContext("posix", PosixBackend.Options(path=str(tmp_path)), heap_memory_obj))
    for i in (1, 2):
        obj = heap_memory_obj(SHAPE, torch.uint8, num_tokens=16)
        obj.byte_view.copy_(_expect(i))
        be.batched_submit_put(keys=[make_key(i)], objs=[obj])
    assert be.flush(timeout=30)
    assert be.contains(keys=[make_key(1)], pin=True) == [True]
    assert be.contains(keys=[make_key(2)], pin=False) == [True]
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_evictor, args=(str(tmp_path), how, [1, 2]))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, f"evicting process exited with {proc.exitcode}"
    for i in (1, 2):
        assert not cf.chunk_path(tmp_path, make_key(i)).exists(), f"process B did not delete {i}"
    assert be.get(key=make_key(2)) is None, "control: an unpinned evicted file must miss"
    got = be.get(key=make_key(1))
    assert got is not None, "a pinned chunk was lost to another process's eviction"
    assert torch.equal(got.byte_view, _expect(1))
    got.ref_down()
    part = be.get_layers(key=make_key(1), first_layer=1, num_layers=2)
    assert part is not None and torch.equal(part.byte_view, _expect(1).view(3, -1)[1:].reshape(-1))
    part.ref_down()
    assert be.stats()["pinned_fds"] == 1
    be.unpin(keys=[make_key(1)])
    assert be.stats()["pinned_fds"] == 0 and be.get(key=make_key(1)) is None
    be.close()


def _shared_manager(root, capacity: int, rescan_interval_s: float):
    """A StorageManager on the posix directory ``root``/shared: one process's view of it."""
    from kvplug.storage_manager import StorageManager

    return StorageManager({"tiers": [{"backend": "posix", "options": {
        "path": str(root / "shared"), "capacity": capacity,
        "rescan_interval_s": rescan_interval_s}}]})


def _shared_files(root) -> list:
    return list((root / "shared").rglob("*" + cf.FILE_SUFFIX))


def _chunk_file_size(root) -> int:
    """The size of one ``put_random`` chunk's file (stored once, then evicted)."""
    from tests.support.tier_workload import put_random

    with _shared_manager(root, 1 << 30, 0) as probe:
        put_random(probe, make_key(0), 0)
        assert probe.flush(timeout=60)
        size = _shared_files(root)[0].stat().st_size
        probe.evict([make_key(0)])
    return size


def test_two_managers_evicting_the_same_file_keep_the_capacity(tmp_path):
    """Two processes' views of a shared directory pick the same LRU victim: the second finds it
    already deleted, so its delete freed nothing, and the other's new file is not in its view. It
    must look again and evict one more, or the directory stays a chunk over for good (and each
    such race adds one). Two managers in one process, in a fixed order, with rescans off."""
    from tests.support.tier_workload import put_random

    size = _chunk_file_size(tmp_path)
    a = _shared_manager(tmp_path, 10 * size, 1e6)
    try:
        for i in range(10):
            put_random(a, make_key(i), i)
            assert a.flush(timeout=60)
            time.sleep(0.02)  # distinct mtimes: one LRU order for both views
        b = _shared_manager(tmp_path, 10 * size, 1e6)
        try:
            assert b.backend(0).wait_indexed(60) and len(_shared_files(tmp_path)) == 10
            put_random(a, make_key(10), 10)  # A evicts the oldest file (chunk 0)
            assert a.flush(timeout=60) and len(_shared_files(tmp_path)) == 10
            put_random(b, make_key(11), 11)  # B's view still has chunk 0, and not chunk 10
            assert b.flush(timeout=60)
            files = _shared_files(tmp_path)
            assert len(files) == 10, [p.name for p in files]
            assert b.stats()["posix"]["evictions"] == 2  # chunk 0 (already gone), then one more
        finally:
            b.close()
    finally:
        a.close()


@pytest.mark.parametrize("rescan_interval_s", [0, 1e6])
def test_a_view_with_room_looks_again_before_each_write(tmp_path, rescan_interval_s):
    """B indexes the directory while it is empty; A then fills it to capacity. B's view has
    room, the directory has none. With ``rescan_interval_s`` 0 each of B's writes looks at the
    directory first and evicts, so it stays within capacity. With a long interval B does not
    look (the documented cost): the control that B's view really was stale."""
    from tests.support.tier_workload import put_random

    size = _chunk_file_size(tmp_path)
    a = _shared_manager(tmp_path, 10 * size, rescan_interval_s)
    b = _shared_manager(tmp_path, 10 * size, rescan_interval_s)
    try:
        assert b.backend(0).wait_indexed(60) and _shared_files(tmp_path) == []
        for i in range(10):
            put_random(a, make_key(i), i)
            assert a.flush(timeout=60)
        assert len(_shared_files(tmp_path)) == 10
        for i in range(10, 13):
            put_random(b, make_key(i), i)
            assert b.flush(timeout=60)
        files = len(_shared_files(tmp_path))
        if rescan_interval_s == 0:
            assert files == 10 and b.stats()["posix"]["evictions"] == 3, files
        else:
            assert files == 13 and b.stats()["posix"]["evictions"] == 0, files
    finally:
        b.close()
        a.close()
