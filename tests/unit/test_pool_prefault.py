"""The host pool backs its pages ahead of use (``kvplug.pool.populate_pages``) without touching contents.

Why: an untouched pool made every first store pay a page fault per 4 KiB inside vLLM's step
(benchmarks/RESULTS.md, "cost of a hit beyond its bytes"). Checked on real memory: the buffer's
own resident pages (``mincore``, Linux; the process's RSS also counted what an earlier test's
threads did meanwhile, and failed beside a busy neighbour), with a negative control: an untouched
buffer without the advice stays out of memory.
"""

from __future__ import annotations

import mmap
import sys
import threading
import time

import pytest
import torch
from kvplug.pool import HostMemoryPool, populate_pages

from tests.support.page_cache import PAGE, resident_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")

MiB = 1 << 20


def resident_mib(buf: torch.Tensor) -> float:
    """MiB of ``buf``'s pages in memory (``mincore``): the buffer's own, whatever else the
    process (an earlier test's threads) does meanwhile, which the process's RSS would count."""
    return resident_pages(buf.data_ptr(), buf.numel() * buf.element_size()) * PAGE / MiB


def test_untouched_buffer_is_not_resident():
    """Negative control: without the advice, a fresh buffer adds (almost) nothing to RSS. Fresh
    from the kernel (an anonymous map): the allocator behind ``torch.empty`` may hand back pages
    an earlier test in this process touched."""
    anon = mmap.mmap(-1, 256 * MiB)
    buf = torch.frombuffer(anon, dtype=torch.uint8)
    assert resident_mib(buf) < 64
    assert populate_pages(buf[:128 * MiB]) is True
    assert 127 <= resident_mib(buf) < 192  # what the advice backed, and the probe sees it
    del buf, anon


def _backed(pool: HostMemoryPool, at_least: int) -> None:
    deadline = time.monotonic() + 60  # only catches a hang
    while pool._frontier.backed < at_least and time.monotonic() < deadline:
        time.sleep(0.01)


def test_pool_is_backed_ahead_of_use_only(monkeypatch):
    """Startup backs only the margin ahead of the first allocation (the whole pool at once slowed
    the engine's first requests); the first requests' allocations back nothing more (the work
    would compete with their copies); allocating further moves the backed part along in
    half-margin steps, until the whole pool is resident and ``populated`` is set."""
    monkeypatch.setattr("kvplug.pool.PREFAULT_AHEAD", 64 * MiB)
    pool = HostMemoryPool(512 * MiB, pin_memory=False)
    _backed(pool, 64 * MiB)
    time.sleep(0.2)  # a thread that went on backing the rest would show here
    assert pool._frontier.backed == 64 * MiB
    assert 64 <= resident_mib(pool.buffer) < 72
    assert not pool.populated.is_set()
    objs = [pool.allocate((MiB,)) for _ in range(16)]  # within half the margin: no work
    time.sleep(0.2)
    assert pool._frontier.backed == 64 * MiB
    objs += [pool.allocate((MiB,)) for _ in range(184)]  # up to 200 MiB
    _backed(pool, 232 * MiB)  # at least half the margin beyond the highest allocation...
    assert 232 * MiB <= pool._frontier.backed <= 264 * MiB  # ...at most all of it
    assert 232 <= resident_mib(pool.buffer) <= 272
    objs.append(pool.allocate((300 * MiB,)))  # its end + the margin is past the pool's end
    assert pool.populated.wait(60)
    assert pool._frontier.backed == 512 * MiB
    assert resident_mib(pool.buffer) == 512
    for o in objs:
        o.ref_down()


def test_prefault_keeps_contents():
    pool = HostMemoryPool(16 * MiB, pin_memory=False)
    assert pool.populated.wait(60)  # smaller than the margin: all of it at once
    obj = pool.allocate((4, 1000, 257))
    assert obj is not None
    data = torch.randint(0, 256, obj.tensor.shape, dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(7))
    obj.tensor.copy_(data)
    assert populate_pages(pool.buffer) is True  # again, over written pages
    assert torch.equal(obj.tensor, data)
    obj.ref_down()


def _prefault_threads() -> int:
    return sum(t.name == "kvplug-pool-prefault" and t.is_alive() for t in threading.enumerate())


def test_a_closed_tier_leaves_no_prefault_thread(monkeypatch):
    """Closing ``local_cpu`` stops its pool's backing thread, also when the tier after it failed
    to start: a closed tier leaves no thread behind holding the pool's buffer."""
    from kvplug.errors import KVPlugError
    from kvplug.storage_manager import StorageManager

    monkeypatch.setattr("kvplug.pool.PREFAULT_AHEAD", 4 * MiB)  # the pool is never all backed
    l1 = {"backend": "local_cpu", "options": {"capacity": "64MiB"}}
    before = _prefault_threads()
    sm = StorageManager({"tiers": [l1]})
    assert _prefault_threads() == before + 1  # the control: the thread runs while the tier does
    sm.close()
    assert _prefault_threads() == before
    with pytest.raises(KVPlugError):
        StorageManager({"tiers": [l1, {"backend": "fsspec", "options": {"url": "nosuch://h/x"}}]})
    assert _prefault_threads() == before
