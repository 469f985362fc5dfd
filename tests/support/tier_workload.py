"""Random chunks stored through a real StorageManager and read back bit-exact: what the remote
tiers' failure tests (resp, mooncake) do to a store before, during and after a fault."""

from __future__ import annotations

import time

import torch
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat
from kvplug.storage_manager import StorageManager

SHAPE = (4, 1, 64 << 10)  # 256 KiB per chunk, 4 layers
HANG = 20.0  # seconds: no single call may take this long (a hang, not a speed check)


def put_random(mgr: StorageManager, key: CacheKey, seed: int) -> torch.Tensor:
    """Store a chunk of random bytes (from ``seed``) under ``key``; its bytes (the reference)."""
    obj = mgr.allocate(SHAPE, dtype=torch.uint8, fmt=MemoryFormat.KV_PAGES, num_tokens=16)
    gen = torch.Generator().manual_seed(seed)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    ref = obj.byte_view.clone()
    mgr.batched_put([key], [obj])
    obj.ref_down()
    return ref


def get_exact(mgr: StorageManager, key: CacheKey, ref: torch.Tensor) -> bool:
    """Whether ``key`` hit (within :data:`HANG`); a hit must be bit-exact."""
    t0 = time.monotonic()
    got = mgr.get(key, promote=False)
    took = time.monotonic() - t0
    assert took < HANG, f"a load took {took:.1f}s: a call hung"
    if got is None:
        return False
    try:
        assert torch.equal(got.byte_view, ref), f"{key}: wrong bytes"
    finally:
        got.ref_down()
    return True
