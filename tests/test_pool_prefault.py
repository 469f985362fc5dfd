"""The host pool backs its pages ahead of use (``kvplug.pool.populate_pages``) without touching contents.

Why: an untouched pool made every first store pay a page fault per 4 KiB inside vLLM's step
(benchmarks/RESULTS.md, "cost of a hit beyond its bytes"). Checked on real memory through the
process's resident set (Linux), with a negative control: the same untouched buffer without the
advice stays out of the resident set.
"""

from __future__ import annotations

import sys

import pytest
import torch
from kvplug.pool import HostMemoryPool, populate_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")

MiB = 1 << 20


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS"))
    return int(line.split()[1]) // 1024


def test_untouched_buffer_is_not_resident():
    """Negative control: without the advice, a fresh buffer adds (almost) nothing to RSS."""
    before = rss_mib()
    buf = torch.empty(256 * MiB, dtype=torch.uint8)
    assert rss_mib() - before < 64
    del buf


def test_pool_is_resident_once_populated():
    before = rss_mib()
    pool = HostMemoryPool(256 * MiB, pin_memory=False)
    assert pool.populated.wait(60)  # only catches a hang
    assert rss_mib() - before >= 200


def test_prefault_keeps_contents():
    pool = HostMemoryPool(16 * MiB, pin_memory=False)
    pool.populated.wait(60)
    obj = pool.allocate((4, 1000, 257))
    assert obj is not None
    data = torch.randint(0, 256, obj.tensor.shape, dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(7))
    obj.tensor.copy_(data)
    assert populate_pages(pool.buffer) is True  # again, over written pages
    assert torch.equal(obj.tensor, data)
    obj.ref_down()
