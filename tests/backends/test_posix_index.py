"""The posix tier's index at scale: compact entries, merges that keep concurrent changes, and a
startup scan that runs in the background while lookups and reads are already served."""

from __future__ import annotations

import gc
import random
import threading
import tracemalloc

import torch
from kvplug import chunkfile as cf
from kvplug.backends.posix import directory as posix_dir
from kvplug.backends.posix.index import PosixIndex, ScanResult, pack_rel, unpack_rel
from kvplug.keys import CacheKey
from kvplug.testing import make_key

from tests.backends.test_posix import backend, obj_for, put


def rel_of(rng: random.Random, model: str = "Qwen/Qwen2.5-7B-Instruct") -> str:
    k = CacheKey(model, "bfloat16", "LBHNC-bs16", 1, 0, rng.randbytes(32))
    return cf.relative_chunk_path(k)


def test_pack_round_trips_canonical_names_and_keeps_others_as_strings():
    rng = random.Random(1)
    rels = [rel_of(rng) for _ in range(300)] + [rel_of(rng, "org/other") for _ in range(30)]
    rels.append(cf.relative_chunk_path(CacheKey("m", "uint8", "t", 1, 0, b"\x00" * 32)))  # zeros
    for rel in rels:
        packed = pack_rel(rel)
        assert isinstance(packed, int) and unpack_rel(packed) == rel
    good = rels[0]
    shard, name = good.split("/")
    digits = name[:-len(cf.FILE_SUFFIX)].rsplit(".", 1)[1]
    odd = [
        good.replace(digits, digits.upper()),  # int() accepts it; not the name a key makes
        good.replace(digits, "0x" + digits[2:]),
        good.replace(digits, digits[:10] + "_" + digits[11:]),
        good.replace(digits, digits[:-1]),  # odd length
        "zz/" + name,  # shard is not the hash's first byte
        good[:-len(cf.FILE_SUFFIX)] + ".bin",
        f"{shard}/{digits}{cf.FILE_SUFFIX}",  # no namespace
    ]
    for rel in odd:
        assert pack_rel(rel) == rel, rel
    index = PosixIndex()
    for i, rel in enumerate(rels + odd):
        index.add(rel, 1000 + i, 100.0 + i)
    assert len(index) == len(rels + odd) and all(r in index for r in rels + odd)
    victims = index.take_victims(10**9)
    assert [v[0] for v in victims] == rels + odd  # oldest first, paths as added
    assert [v[1].size for v in victims] == [1000 + i for i in range(len(rels + odd))]


def test_index_memory_is_at_most_200_bytes_per_chunk():
    rng = random.Random(2)
    n = 20_000
    started = 1.7e9
    entries = {pack_rel(rel_of(rng)): 0 for _ in range(n)}
    result = ScanResult({k: (int((started - i) * 1000) << 44) | 4_200_000 for i, k in
                         enumerate(entries)}, started)
    del entries
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = PosixIndex()
        index.merge(result)
        del result
        gc.collect()
        per_chunk = (tracemalloc.get_traced_memory()[0] - base) / n
    finally:
        tracemalloc.stop()
    assert len(index) == n and index.bytes == n * 4_200_000
    assert per_chunk <= 200, f"{per_chunk:.0f} B per indexed chunk"


def test_merge_keeps_changes_made_while_the_scan_ran():
    rng = random.Random(3)
    rels = [rel_of(rng) for _ in range(8)]
    index = PosixIndex()
    for i, rel in enumerate(rels[:5]):
        index.add(rel, 10 + i, 100.0 + i)
    current = index.begin_merge()
    # meanwhile: one evicted, one read (newest now), one new file written
    index.remove(rels[0])
    index.touch(rels[1], 500.0)
    index.add(rels[5], 15, 501.0)
    # the scan (started at 200) saw rels 0..4 (0 was still there) plus 6 and 7, another process's
    seen = {pack_rel(r): (int(t * 1000) << 44) | s for r, s, t in [
        (rels[0], 10, 100.0), (rels[1], 11, 101.0), (rels[2], 12, 150.0), (rels[3], 13, 102.0),
        (rels[4], 14, 103.0), (rels[6], 16, 90.0), (rels[7], 17, 199.0)]}
    index.finish_merge(PosixIndex.prepare_merge(current, ScanResult(seen, 200.0)))
    order = [v[0] for v in index.take_victims(10**9)]
    # by stamp: 6 (90), 3 (102), 4 (103), 2 (150), 7 (199); then the changed ones: 1, 5
    assert order == [rels[6], rels[3], rels[4], rels[2], rels[7], rels[1], rels[5]]
    assert index.bytes == 0 and len(index) == 0


def test_merge_bytes_match_the_entries():
    rng = random.Random(4)
    index = PosixIndex()
    rels = [rel_of(rng) for _ in range(50)]
    for i, rel in enumerate(rels[:30]):
        index.add(rel, 100 + i, 10.0 + i)
    current = index.begin_merge()
    for rel in rels[:5]:
        index.remove(rel)
    for rel in rels[30:35]:
        index.add(rel, 7, 1000.0)
    # a scan started at 50 s: rels 0..9 had vanished; it saw 10..49 (size 3, stamp 20 s)
    seen = {pack_rel(r): (20_000 << 44) | 3 for r in rels[10:50]}
    index.finish_merge(PosixIndex.prepare_merge(current, ScanResult(seen, 50.0)))
    assert len(index) == 40 and index.bytes == 35 * 3 + 5 * 7  # 30..34 as written meanwhile
    taken = index.take_victims(10**9)
    assert {r for r, _ in taken} == set(rels[10:50])
    assert sum(e.size for _, e in taken) == 35 * 3 + 5 * 7 and index.bytes == 0


def test_serving_starts_before_the_startup_scan_finishes(tmp_path, monkeypatch):
    be = backend(tmp_path, capacity=10 << 20)
    stored = {i: put(be, i) for i in range(6)}
    be.close()
    size = cf.chunk_path(tmp_path, make_key(0)).stat().st_size

    gate, scanning = threading.Event(), threading.Event()
    real_scan = posix_dir.scan

    def slow_scan(root, *a, **kw):  # a directory of a million files: the scan takes a while
        scanning.set()
        assert gate.wait(60)
        return real_scan(root, *a, **kw)

    monkeypatch.setattr(posix_dir, "scan", slow_scan)
    made: list = []
    t = threading.Thread(target=lambda: made.append(
        backend(tmp_path, wait=False, capacity=4 * size + size // 2)), daemon=True)
    t.start()
    t.join(30)
    assert made, "the constructor waited for the startup scan"
    be = made[0]
    try:
        assert scanning.wait(30) and be.stats()["indexed"] == 0
        assert be.contains([make_key(i) for i in range(7)], pin=False) == [True] * 6 + [False]
        got = be.get(make_key(3))
        assert got is not None and torch.equal(got.byte_view, stored[3].byte_view)
        got.ref_down()
        new = obj_for(99)
        be.batched_submit_put([make_key(99)], [new])
        assert not be.flush(0.5)  # the store waits for the index (capacity is not known yet)
        gate.set()
        assert be.wait_indexed(30) and be.flush(30)
        st = be.stats()
        assert st["indexed"] == 1 and st["writes"] == 1
        # capacity of 4 files: the startup trim and the store left 4; key 3, read last, is kept
        on_disk = {i for i in [*range(6), 99] if cf.chunk_path(tmp_path, make_key(i)).exists()}
        assert st["entries"] == len(on_disk) == 4 and st["bytes"] == 4 * size
        assert {3, 99} <= on_disk
    finally:
        gate.set()
        be.close()
