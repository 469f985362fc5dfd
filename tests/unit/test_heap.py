"""Heap memory of a StorageManager whose tiers own no pool: freed buffers reused, bounded."""

from __future__ import annotations

import pytest
import torch
from kvplug.errors import MemoryObjFreedError
from kvplug.heap import HeapBuffers
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key


def test_a_freed_buffer_serves_the_next_object_of_its_size():
    heap = HeapBuffers(keep_bytes=1 << 20)
    a = heap.allocate((4, 2, 1024), torch.uint8)
    addr = a.tensor.data_ptr()
    assert addr % 4096 == 0
    a.ref_down()
    with pytest.raises(MemoryObjFreedError):
        _ = a.tensor  # the object is gone even though its buffer lives on
    b = heap.allocate((4, 2, 1024), torch.uint8)
    assert b.tensor.data_ptr() == addr and b.tensor.shape == (4, 2, 1024)
    c = heap.allocate((2, 2, 1024), torch.float16)  # another size: a fresh buffer
    assert c.tensor.data_ptr() != addr and c.tensor.dtype == torch.float16
    assert heap.counts == {"heap_reused": 1, "heap_fresh": 2}
    b.ref_down()
    c.ref_down()
    assert heap.kept == 8192 + 8192


def test_kept_bytes_are_bounded_and_the_least_wanted_size_goes_first():
    heap = HeapBuffers(keep_bytes=3 * 4096)
    small = [heap.allocate((4096,), torch.uint8) for _ in range(4)]
    for obj in small:
        obj.ref_down()
    assert heap.kept == 3 * 4096, "more than keep_bytes kept"
    big = heap.allocate((2 * 4096,), torch.uint8)  # makes room: two small buffers dropped
    big.ref_down()
    assert heap.kept == 3 * 4096
    again = heap.allocate((2 * 4096,), torch.uint8)
    assert heap.counts["heap_reused"] == 1
    again.ref_down()
    heap.clear()
    assert heap.kept == 0


def test_a_tier_alone_reads_into_reused_heap_memory(tmp_path):
    """posix alone (no pool): repeated reads of one chunk land in one reused buffer and return
    the stored bytes each time."""
    mgr = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(tmp_path)}}]})
    src = mgr.allocate((4, 2, 4096), torch.uint8)
    src.tensor.copy_(torch.randint(0, 256, (4, 2, 4096), dtype=torch.uint8))
    expect = src.tensor.clone()
    mgr.batched_put([make_key(1)], [src])
    src.ref_down()
    assert mgr.flush(30)
    addresses = set()
    for _ in range(3):
        got = mgr.get(make_key(1))
        assert got is not None and torch.equal(got.tensor, expect)
        addresses.add(got.tensor.data_ptr())
        got.ref_down()
    assert len(addresses) == 1
    st = mgr.stats()["posix"]
    assert st["heap_reused"] >= 2 and st["heap_kept_bytes"] > 0
    mgr.close()


def test_a_buffer_first_made_in_inference_mode_is_written_outside_it():
    """vLLM's step runs in inference mode, a background load's thread outside it: a buffer made
    by a store in the step and reused by a load was an inference tensor the load could not
    write into (before: ``RuntimeError: Inplace update to inference tensor outside
    InferenceMode``, every first background load of an engine without L1 a miss)."""
    heap = HeapBuffers(keep_bytes=1 << 20)
    with torch.inference_mode():
        a = heap.allocate((4, 2, 1024), torch.uint8)
        a.tensor.fill_(1)
        addr = a.tensor.data_ptr()
        a.ref_down()
    b = heap.allocate((4, 2, 1024), torch.uint8)
    assert b.tensor.data_ptr() == addr  # the same buffer, reused
    data = torch.randint(0, 256, (4, 2, 1024), dtype=torch.uint8)
    b.tensor.copy_(data)
    assert torch.equal(b.tensor, data)
    b.ref_down()
