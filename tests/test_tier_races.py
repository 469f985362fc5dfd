"""Issue 33's races in the tiers' bookkeeping, each forced deterministically (a hook held at the
racy moment), each failing before its fix:

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
from kvplug.backends.posix import backend as posix_mod
from kvplug.hookspecs import TierContext
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, heap_memory_obj

HANG_S = 30  # only catches a hang


def key(i: int) -> CacheKey:
    return CacheKey("org/m", "bfloat16", "LBHNC-bs16", 1, 0, i.to_bytes(4, "big") * 8)


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
    real_prepare = posix_mod.PosixBackend._prepare_write

    def held_back(self, k, rel, obj):
        gate.wait(HANG_S)
        return real_prepare(self, k, rel, obj)

    monkeypatch.setattr(posix_mod.PosixBackend, "_prepare_write", held_back)
    real_hold = be._held.hold

    def late_hold(rel, path):
        if path is None:  # the pin saw the write queued: let it land first
            gate.set()
            t_end = time.monotonic() + 1.0
            while rel in be._pending and time.monotonic() < t_end:
                time.sleep(0.005)
        return real_hold(rel, path)

    monkeypatch.setattr(be._held, "hold", late_hold)
    src = obj_for(3)
    want = src.byte_view.clone()
    be.batched_submit_put(keys=[key(3)], objs=[src])
    assert be.contains(keys=[key(3)], pin=True) == [True]
    gate.set()
    assert be.flush(HANG_S)
    for f in tmp_path.rglob("*.safetensors"):  # another process's eviction
        os.unlink(f)
    got = be.get(key=key(3))
    assert got is not None, "a key pinned while its write landed was lost to another " \
                            "process's eviction (its file was never held open)"
    assert torch.equal(got.byte_view, want)
    got.ref_down()
    be.unpin(keys=[key(3)])
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
    be.batched_submit_put(keys=[key(i) for i in range(3)], objs=objs)
    assert be.flush(HANG_S)
    refs = [o.ref_count for o in objs]
    assert refs == [1, 1, 1], f"flush() returned while the writer held objects (refs {refs})"
    be.close()
