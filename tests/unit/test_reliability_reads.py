"""A hit larger than L1 must not fail for want of L1 room.

Lower tiers read into memory from ``ctx.allocate`` (the L1 pool). A load holds every object of a
request's hit until it scatters them, so with a small L1 the pool fills with objects in use (not
evictable) and the next read got no memory: the promised hit became a load error and vLLM
recomputed (found with two engines sharing tiers, tests/engine/test_reliability_shared.py). Reads now
fall back to the heap when the pool is full, and count it.
"""

from __future__ import annotations

import torch
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

CHUNK_BYTES = 2 * 2 * 4096  # kvplug.testing's chunk shape


def test_a_hit_larger_than_l1_is_read_whole():
    l1 = {"backend": "local_cpu", "name": "l1", "options": {"capacity": 4 * CHUNK_BYTES}}
    lower = {"backend": "tests.support.tiers_for_tests:DictTier", "name": "lower"}
    with StorageManager({"tiers": [l1, lower]}) as mgr:
        keys = [make_key(i) for i in range(10)]
        expect = []
        for i, k in enumerate(keys):
            obj = fill_random(mgr, seed=100 + i)
            expect.append(obj.byte_view.clone())
            mgr.batched_put([k], [obj])
            obj.ref_down()
        assert mgr.lookup_prefix(keys).num_chunks == 10  # L1 holds the last 4, lower all 10
        got = [mgr.get(k) for k in keys]  # held together, as a load holds one request's hit
        missing = [i for i, o in enumerate(got) if o is None]
        assert missing == [], f"reads {missing} got no memory with L1 full of objects in use"
        for o, e in zip(got, expect, strict=True):
            assert torch.equal(o.byte_view, e)
            o.ref_down()
        assert mgr.read_heap_fallbacks > 0
        # the pool holds only what L1 stores: the heap buffers went with their last reference
        st = mgr.stats()["l1"]
        assert st["pool_used"] <= st["bytes"] <= st["capacity"]
