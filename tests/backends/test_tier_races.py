"""Races in the tiers' bookkeeping, each forced deterministically (a hook held at the racy
moment):

* posix: a key pinned while its write is queued must be held open once its file lands, even when
  the write lands between the pin's look at the queue and its count (another process's eviction
  would take the promised hit);
* posix: ``flush()`` is true only when the writer holds no object any more;
* value tiers: a read whose scratch buffer cannot be had gives back what it already allocated;
  a put whose ``ref_up`` raises leaves ``flush()`` able to become true.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from kvplug.backends.posix import PosixBackend
from kvplug.backends.posix import io as posix_io
from kvplug.hookspecs import TierContext
from kvplug.memory import MemoryFormat, heap_memory_obj
from kvplug.testing import make_key

from tests.support.redis_server import redis_server  # noqa: F401 - fixture

HANG_S = 30  # only catches a hang


def obj_for(i: int):
    obj = heap_memory_obj((3, 2, 2500), torch.uint8, MemoryFormat.KV_PAGES, 32)
    gen = torch.Generator().manual_seed(i)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def posix(path, **opts) -> PosixBackend:
    be = PosixBackend(TierContext("disk", PosixBackend.Options(path=str(path), **opts),
                                  heap_memory_obj))
    assert be.wait_indexed(HANG_S)
    return be


def test_posix_a_pin_taken_as_the_write_lands_holds_the_file(tmp_path, monkeypatch):
    """The pin sees the write queued; the write lands before the pin is counted (forced: the
    count waits for the write, at most 1 s); then another process evicts the file. The pinned
    key must still read back (through the descriptor held since the file landed)."""
    be = posix(tmp_path, io_threads=1)
    gate = threading.Event()
    real_prepare = posix_io.ChunkFileIO.prepare_write

    def held_back(self, k, rel, obj):
        gate.wait(HANG_S)
        return real_prepare(self, k, rel, obj)

    monkeypatch.setattr(posix_io.ChunkFileIO, "prepare_write", held_back)
    real_hold = be.held.hold

    def late_hold(rel, path):
        if path is None:  # the pin saw the write queued: let it land first
            gate.set()
            t_end = time.monotonic() + 1.0
            while rel in be.writer.pending and time.monotonic() < t_end:
                time.sleep(0.005)
        return real_hold(rel, path)

    monkeypatch.setattr(be.held, "hold", late_hold)
    src = obj_for(3)
    want = src.byte_view.clone()
    be.batched_submit_put(keys=[make_key(3)], objs=[src])
    assert be.contains(keys=[make_key(3)], pin=True) == [True]
    gate.set()
    assert be.flush(HANG_S)
    for f in tmp_path.rglob("*.safetensors"):  # another process's eviction
        os.unlink(f)
    got = be.get(key=make_key(3))
    assert got is not None, "a key pinned while its write landed was lost to another " \
                            "process's eviction (its file was never held open)"
    assert torch.equal(got.byte_view, want)
    got.ref_down()
    be.unpin(keys=[make_key(3)])
    be.close()


def test_posix_flush_is_true_only_once_the_writer_holds_nothing(tmp_path, monkeypatch):
    """The writer's last act on a queued object is dropping its reference: forced slow (0.2 s on
    the writer's thread), ``flush()`` must still not return before it (the simulation's I5 of
    seed 11008900: L1's pool still in use after a flush)."""
    from kvplug.memory import MemoryObj

    real = MemoryObj.ref_down

    def slow_on_writer(self):
        if threading.current_thread().name.startswith("kvplug-disk"):
            time.sleep(0.2)
        return real(self)

    be = posix(tmp_path, io_threads=1)
    monkeypatch.setattr(MemoryObj, "ref_down", slow_on_writer)
    objs = [obj_for(i) for i in range(3)]
    be.batched_submit_put(keys=[make_key(i) for i in range(3)], objs=objs)
    assert be.flush(HANG_S)
    refs = [o.ref_count for o in objs]
    assert refs == [1, 1, 1], f"flush() returned while the writer held objects (refs {refs})"
    be.close()


def test_value_tier_a_read_without_scratch_gives_back_its_objects(redis_server):  # noqa: F811
    """resp against a real redis-server, reads in place into L1's pool: when the thread's
    scratch buffer cannot be had (``io.scratch`` raises), the pool objects already allocated for
    the read are given back (before: leaked; L1's pool stayed in use with every entry evicted)."""
    from kvplug.storage_manager import StorageManager
    from kvplug.testing.conformance import make_key

    from tests.support.in_place_reads import L1, _store

    def tier() -> dict:
        return {"backend": "resp", "timeout_s": 5.0,
                "options": {"url": redis_server.url, "timeout_s": 2.0, "negative_cache_s": 0}}

    writer = StorageManager({"tiers": [tier()], "chunk_size": 16})
    reader = StorageManager({"tiers": [L1, tier()], "chunk_size": 16})
    try:
        refs = _store(writer, {i: (4, 2, 12288) for i in range(4)})
        first = reader.get(make_key(0), promote=False)  # teaches the layout
        assert first is not None and torch.equal(first.byte_view, refs[0])
        first.ref_down()
        resp = reader.backend(1)

        def no_scratch(nbytes):
            raise MemoryError(f"no scratch of {nbytes} B")

        resp.io.scratch = no_scratch
        got = reader.batched_get([make_key(i) for i in range(1, 4)])
        for i, g in enumerate(got, start=1):  # read whole instead
            assert g is not None and torch.equal(g.byte_view, refs[i]), f"chunk {i}"
            g.ref_down()
        reader.evict(tiers=["l1"], nbytes=1 << 30)
        used = reader.stats()["l1"]["pool_used"]
        assert used == 0, f"{used} B of L1's pool still in use after a read without scratch"
    finally:
        reader.close()
        writer.close()


def test_value_writer_a_put_whose_ref_up_raises_leaves_flush_reachable(redis_server):  # noqa: F811
    """A store of an object that cannot be referenced any more (``ref_up`` raises: it was freed)
    is refused without leaving its name counted as in flight: ``flush()`` becomes true, and the
    next store of that key is written (before: flush() false forever)."""
    from kvplug.backends.resp import RespBackend
    from kvplug.memory import MemoryObjFreedError

    opts = RespBackend.Options(url=redis_server.url, timeout_s=2.0, negative_cache_s=0)
    be = RespBackend(TierContext("resp", opts, heap_memory_obj, chunk_size=16))
    try:
        freed = obj_for(1)
        freed.ref_down()  # freed: ref_up raises
        try:
            be.batched_submit_put(keys=[make_key(1)], objs=[freed])
        except MemoryObjFreedError:
            pass  # the StorageManager counts a tier's exception as a fault
        assert be.flush(5), "a put whose ref_up raised left flush() false"
        good = obj_for(1)
        be.batched_submit_put(keys=[make_key(1)], objs=[good])
        assert be.flush(HANG_S)
        assert be.contains(keys=[make_key(1)], pin=False) == [True]
        got = be.get(key=make_key(1))
        assert got is not None and torch.equal(got.byte_view, good.byte_view)
        got.ref_down()
    finally:
        be.close()
