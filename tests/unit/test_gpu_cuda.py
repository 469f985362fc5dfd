"""kvplug.gpu on CUDA: round trips through pinned and device memory, and the stream contract
(skipped with a reason where there is no CUDA device)."""

from __future__ import annotations

import random

import pytest
import torch
from kvplug.gpu import (
    PagedKV,
    alloc_host,
    gather,
    gather_many_async,
    layerwise_load,
    layerwise_store,
    scatter,
)

from tests.support.gpu_kv_fixture import (
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
@pytest.mark.parametrize("order", ["wait-then-zero", "zero-then-wait"])
def test_a_block_zeroed_before_the_wait_races_the_store(order: str) -> None:
    """vLLM's V2 model runner zeroes a step's new blocks before ``handle_preemptions``: a block a
    preemption freed and the step reused is zeroed on the engine's stream *before* kvplug makes
    that stream wait on the store's event. Here the store stream is held back (a sleep kernel,
    standing for a busy copy engine) so the order decides: zeroing first stores the zeros (the
    race, which ``AsyncSaves.order_at_submit`` closes by waiting when the copy is submitted);
    waiting first stores the KV."""
    fx = KVFixture("LBNHC", torch.bfloat16, L=4, device="cuda")
    kv = PagedKV.from_kv_caches(fx.caches)
    ids = [3, 4, 9, 12]
    snap = snapshot_of(fx)
    out = poisoned((fx.L, len(ids), fx.page), pin=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(kv.stream("store")):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles ahead of the copy
    ev = gather_many_async(kv, [(ids, out)])
    engine = torch.cuda.current_stream()
    if order == "wait-then-zero":
        engine.wait_event(ev)
    for b in ids:  # the V2 runner's kv_block_zeroer on the reused blocks
        for layer in range(fx.L):
            o = fx.offset(layer, b)
            fx.buf[o: o + fx.page].zero_()
    if order == "zero-then-wait":
        engine.wait_event(ev)
    torch.cuda.synchronize()
    if order == "wait-then-zero":
        assert_obj_matches(out, snap.ref_obj(ids))
    else:
        assert not torch.equal(out, snap.ref_obj(ids)), "the zeroing did not overtake the copy"
        assert int(out.count_nonzero()) < out.numel() // 2  # the zeros were stored


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
    engine.wait_stream(torch.cuda.current_stream())  # the poison is the engine's earlier work
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
