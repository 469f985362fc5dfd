"""The local_cpu tier: conformance plus its own guarantees (pins, readers, full pool)."""

from __future__ import annotations

import pytest
import torch
from kvplug.storage_manager import StorageManager
from kvplug.testing import BackendConformance, fill_random, make_key


class TestLocalCPUConformance(BackendConformance):
    @pytest.fixture
    def make_tiers(self):
        return lambda capacity: [{"backend": "local_cpu", "options": {"capacity": capacity}}]


def _manager(capacity: int) -> StorageManager:
    return StorageManager({"tiers": [{"backend": "local_cpu", "options": {"capacity": capacity}}]})


def test_get_is_zero_copy():
    with _manager(1 << 20) as mgr:
        obj = fill_random(mgr)
        mgr.batched_put([make_key(0)], [obj])
        got = mgr.get(make_key(0))
        assert got is obj and got.tensor.data_ptr() == obj.tensor.data_ptr()
        got.ref_down()
        obj.ref_down()


def test_never_evicts_what_a_reader_holds():
    chunk = 16 * 1024
    with _manager(4 * chunk) as mgr:
        held = []
        for i in range(4):
            obj = fill_random(mgr, seed=i)
            mgr.batched_put([make_key(i)], [obj])
            held.append(obj)  # the caller keeps its reference: nothing is evictable
        extra = mgr.allocate((2, 2, 4096))
        assert extra is None, "allocation succeeded by evicting an object a reader still holds"
        assert mgr.stats()["local_cpu"]["alloc_failures"] == 1
        for obj in held:
            assert not obj.is_freed
            obj.ref_down()
        extra = mgr.allocate((2, 2, 4096))
        assert extra is not None, "allocation failed although unheld entries can be evicted"
        extra.ref_down()


def test_full_of_pinned_entries_skips_store_without_blocking():
    chunk = 16 * 1024
    with _manager(2 * chunk) as mgr:
        for i in range(2):
            obj = fill_random(mgr, seed=i)
            mgr.batched_put([make_key(i)], [obj])
            obj.ref_down()
        mgr.lookup_prefix([make_key(0), make_key(1)], pin=True)
        outsider = torch.zeros(chunk, dtype=torch.uint8)
        from kvplug.memory import MemoryFormat, MemoryObj, MemoryObjMeta

        foreign = MemoryObj(outsider, MemoryObjMeta((chunk,), torch.uint8, MemoryFormat.BINARY, 0))
        mgr.batched_put([make_key(9)], [foreign])
        assert mgr.get(make_key(9)) is None
        assert mgr.stats()["local_cpu"]["skipped_puts"] == 1
        assert mgr.lookup_prefix([make_key(0), make_key(1)]).num_chunks == 2
