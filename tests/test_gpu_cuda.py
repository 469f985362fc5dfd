"""kvplug.gpu on CUDA: round trips through pinned and device memory, and the stream contract
(skipped with a reason where there is no CUDA device)."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_kv_fixture import (
    CUDA,
    DTYPES,
    LAYOUTS,
    POISON,
    KVFixture,
    assert_loaded,
    assert_obj_matches,
    id_patterns,
    poisoned,
    snapshot_of,
)
from kvplug.gpu import (
    PagedKV,
    alloc_host,
    gather,
    gather_many_async,
    layerwise_load,
    layerwise_store,
    scatter,
)

# ---------------------------------------------------------------- CUDA


@CUDA
@pytest.mark.cuda
def test_cuda_async_store_is_ordered_by_events_without_host_sync() -> None:
    """Asynchronous saves: ``gather_many_async`` and ``layerwise_store(wait=False)`` queue the
    copies and hand back events, with no host synchronisation (sync debug mode raises on one);
    work the engine queues after waiting on the events (here: overwriting the blocks) does not
    change what was copied."""
    fx = KVFixture("LBNHC", torch.bfloat16, L=4, device="cuda")
    kv = PagedKV.from_kv_caches(fx.caches)
    ids = [1, 5, 6, 7, 2, 9]  # short runs: the staged (index) path
    snap = snapshot_of(fx)
    bulk = poisoned((fx.L, len(ids), fx.page), pin=True)
    lw = poisoned((fx.L, len(ids), fx.page), pin=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ev = gather_many_async(kv, [(ids, bulk)])
        steps = layerwise_store(kv, [(ids, lw)], wait=False)
        assert list(steps) == list(range(fx.L))
        stream = torch.cuda.current_stream()
        stream.wait_event(ev)
        stream.wait_event(steps.event)
        fx.poison(ids)  # the engine reusing the blocks, after the copies
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ev.synchronize()
    steps.event.synchronize()
    assert_obj_matches(bulk, snap.ref_obj(ids))
    assert_obj_matches(lw, snap.ref_obj(ids))


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("pattern", ["random", "runs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_bulk_and_layerwise_round_trip(
    layout: str, dtype: torch.dtype, pattern: str, stacked: bool
) -> None:
    fx = KVFixture(layout, dtype, L=4, device="cuda")
    kv = PagedKV.from_kv_caches(fx.caches)
    assert kv.device.type == "cuda"
    if not stacked:
        kv.stacked = None
    src_ids, dst_ids = id_patterns(random.Random(pattern), fx.B)[pattern]
    snap = snapshot_of(fx)
    bulk = poisoned((fx.L, len(src_ids), fx.page), pin=True)
    gather(kv, src_ids, bulk)
    assert_obj_matches(bulk, snap.ref_obj(src_ids))
    lw = poisoned((fx.L, len(src_ids), fx.page), pin=True)
    assert list(layerwise_store(kv, [(src_ids, lw)])) == list(range(fx.L))
    assert torch.equal(lw, bulk)
    on_gpu = poisoned((fx.L, len(src_ids), fx.page), device="cuda")
    gather(kv, src_ids, on_gpu)  # a device-side memory object
    assert torch.equal(on_gpu.cpu(), bulk)
    fx.poison(dst_ids)
    scatter(kv, bulk, dst_ids)
    assert_loaded(fx, snap, src_ids, dst_ids)
    fx.poison(dst_ids)
    for _ in layerwise_load(kv, [(dst_ids, lw)]):
        pass
    assert_loaded(fx, snap, src_ids, dst_ids)


@CUDA
@pytest.mark.cuda
def test_cuda_layerwise_load_orders_the_engine_stream() -> None:
    """Work queued on the current stream after the i-th next() sees layer i (no host sync)."""
    fx = KVFixture("LBNHC", torch.bfloat16, L=8, B=64, H=8, N=16, C=256, device="cuda")
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    src_ids = list(range(1, 33))
    dst_ids = list(range(63, 31, -1))
    obj = alloc_host(kv, len(src_ids))
    assert obj.is_pinned()
    gather(kv, src_ids, obj)
    fx.poison(dst_ids)
    engine = torch.cuda.Stream()
    seen = []
    with torch.cuda.stream(engine):
        steps = layerwise_load(kv, [(dst_ids, obj)])
        for layer in steps:
            torch.cuda._sleep(1_000_000)  # stand-in compute
            seen.append(fx.tensors[layer][dst_ids].clone())  # queued on `engine`
    torch.cuda.synchronize()
    for layer, got in enumerate(seen):
        want = snap.tensors[layer][src_ids].cpu()
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), layer


@CUDA
@pytest.mark.cuda
def test_cuda_layerwise_store_last_step_completes_copies() -> None:
    fx = KVFixture("LBHNC", torch.float16, L=6, B=64, H=8, N=16, C=256, device="cuda")
    kv = PagedKV.from_kv_caches(fx.caches)
    ids = list(range(3, 60, 2))
    out = alloc_host(kv, len(ids)).fill_(POISON)
    steps = layerwise_store(kv, [(ids, out)])
    for _ in range(fx.L):
        torch.cuda._sleep(500_000)  # the engine's next layer, on the current stream
        next(steps)
    assert_obj_matches(out, fx.ref_obj(ids))  # no synchronize by the caller
