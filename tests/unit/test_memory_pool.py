"""MemoryObj reference counting and the host pool under concurrent use."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from kvplug.errors import ConfigError, MemoryObjFreedError
from kvplug.memory import MemoryFormat
from kvplug.pool import ALIGN, HostMemoryPool


def test_refs_free_on_last_release():
    pool = HostMemoryPool(1 << 20)
    obj = pool.allocate((4, 1024), torch.uint8, MemoryFormat.KV_PAGES, 64)
    obj.ref_up()
    obj.ref_up()
    obj.ref_down()
    obj.ref_down()
    assert not obj.is_freed and pool.stats().used > 0, "freed while still referenced"
    obj.ref_down()
    assert obj.is_freed and pool.stats().used == 0
    with pytest.raises(MemoryObjFreedError):
        obj.tensor  # noqa: B018 - use after free must raise
    with pytest.raises(MemoryObjFreedError):
        obj.ref_down()


def test_never_grows_and_reports_fragmentation():
    pool = HostMemoryPool(16 * ALIGN)
    objs = [pool.allocate((ALIGN,)) for _ in range(16)]
    assert all(o is not None for o in objs)
    assert pool.allocate((1,)) is None, "pool grew past its capacity"
    for o in objs[::2]:
        o.ref_down()
    st = pool.stats()
    assert st.free == 8 * ALIGN and st.largest_free == ALIGN
    assert st.fragmentation == pytest.approx(1 - 1 / 8)
    assert pool.allocate((2 * ALIGN,)) is None  # free space exists but not contiguous
    for o in objs[1::2]:
        o.ref_down()
    assert pool.stats().fragmentation == 0.0 and pool.stats().largest_free == 16 * ALIGN


def test_allocations_are_aligned():
    pool = HostMemoryPool(1 << 20)
    objs = [pool.allocate((n,)) for n in (1, 4095, 4097, 12345)]
    assert all(o.tensor.data_ptr() % ALIGN == 0 for o in objs)


def test_capacity_too_small():
    with pytest.raises(ConfigError, match="capacity=100"):
        HostMemoryPool(100)


def test_threads_hammering_the_pool_never_share_or_reuse_live_memory():
    """Each thread stamps its allocations and checks the stamp before freeing: any overlap
    between live allocations, or reuse before free, changes a stamp."""
    pool = HostMemoryPool(64 * ALIGN)
    errors: list[str] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        live = []
        for step in range(3000):
            if live and (rng.random() < 0.5 or len(live) > 6):
                obj, stamp = live.pop(rng.randrange(len(live)))
                if not bool((obj.tensor == stamp).all()):
                    errors.append(f"thread {tid} step {step}: allocation overwritten")
                obj.ref_down()
            else:
                obj = pool.allocate((rng.randint(1, 3 * ALIGN),))
                if obj is None:
                    continue
                stamp = (tid * 31 + step) % 251
                obj.tensor.fill_(stamp)
                live.append((obj, stamp))
        for obj, _ in live:
            obj.ref_down()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]
    st = pool.stats()
    assert st.used == 0 and st.num_allocations == 0 and st.largest_free == 64 * ALIGN
