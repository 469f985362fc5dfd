"""kvplug.gpu on CUDA: round trips through pinned and device memory, and the stream contract
(skipped with a reason where there is no CUDA device; the chunk-job tests also run on CPU)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

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
    scatter_many,
)
from kvplug.gpu.copy_plan import plan_copies

from tests.support.gpu_kv_fixture import (
    CUDA,
    DTYPES,
    LAYOUTS,
    POISON,
    KVFixture,
    TorchCalls,
    assert_loaded,
    assert_obj_matches,
    chunk_objects,
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
    race, which ``AsyncSaves.order_at_enqueue`` closes by waiting when the copy is submitted);
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


# ---------------------------------------------------------------- many chunk jobs in one plan
#
# The connector's shape on CUDA (one job per chunk of 16 blocks). Each test also runs on CPU,
# where the same objects may take another route, so its bookkeeping is checked on every machine.

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])]
#: route on CUDA -> (KV heads, K+V width), how the objects are allocated, whether the chunks are
#: runs of adjacent blocks. staged: 4 KiB pages, pinned pool objects, scattered blocks (short
#: runs: an index kernel, one copy per object); runs: 64 KiB pages, so a chunk of 16 adjacent
#: blocks is a 1 MiB run; rows: objects in one device buffer (one index kernel per layer)
CHUNK_ROUTES = {
    "staged": ((2, 64), "pool", False),
    "runs": ((8, 256), "pool", True),
    "rows": ((2, 64), "arena", False),
}
CHUNK = 16


def chunk_case(route: str, device: str, jobs: int) -> tuple[KVFixture, PagedKV, list, list, str]:
    """A 4-layer LBNHC cache with room for ``jobs`` chunks to store and ``jobs`` to load, the
    source and destination ids, and how the route's objects are allocated (on CPU, which
    checks the tests' own bookkeeping, with 512-byte pages: cheap)."""
    (heads, width), how, adjacent = CHUNK_ROUTES[route]
    if device != "cuda":
        heads, width = 2, 8
    fx = KVFixture("LBNHC", torch.bfloat16, L=4, B=2 * jobs * CHUNK + 1, H=heads, N=16, C=width,
                   device=device)
    kv = PagedKV.from_kv_caches(fx.caches)
    blocks = list(range(1, fx.B))
    if not adjacent:
        random.Random(route).shuffle(blocks)
    chunks = [blocks[j * CHUNK: (j + 1) * CHUNK] for j in range(2 * jobs)]
    return fx, kv, chunks[:jobs], chunks[jobs:], how


def route_names(kv: PagedKV, jobs: list, to_engine: bool, bulk: bool) -> list[str]:
    return [r.name for r in plan_copies(kv, jobs, to_engine, bulk).routes]


@contextlib.contextmanager
def no_host_sync(device: str) -> Iterator[None]:
    """On CUDA, any host synchronisation inside raises (sync debug mode); on CPU nothing."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", list(CHUNK_ROUTES))
def test_chunk_jobs_in_one_plan_without_host_sync(route: str, device: str) -> None:
    """Eight chunk jobs each way in one plan, on the route CUDA takes for them: the asynchronous
    store calls and every layer-wise load step without a host synchronisation, a job dropped at
    layer 2 of the load never written from then on, and every byte against the reference."""
    fx, kv, src, dst, how = chunk_case(route, device, 8)
    cuda = device == "cuda"
    snap = snapshot_of(fx)
    sizes = [CHUNK] * len(src)
    bulk, lw, staging = (chunk_objects(how, fx.L, sizes, fx.page, device=device, pin=cuda)
                         for _ in range(3))
    if cuda:
        for to_engine, objs in ((False, bulk), (True, staging)):
            for whole in (True, False):
                ids = dst if to_engine else src
                want = "staged" if whole and route == "runs" else route  # a bulk call: staged
                assert route_names(kv, list(zip(ids, objs, strict=True)), to_engine, whole) == [want]
    with no_host_sync(device):
        event = gather_many_async(kv, list(zip(src, bulk, strict=True)))
        steps = layerwise_store(kv, list(zip(src, lw, strict=True)), wait=False)
        assert list(steps) == list(range(fx.L))
    if cuda:
        event.synchronize()
        steps.event.synchronize()
    for ids, a, b in zip(src, bulk, lw, strict=True):
        assert_obj_matches(a, snap.ref_obj(ids))
        assert_obj_matches(b, snap.ref_obj(ids))

    every_dst = [b for d in dst for b in d]
    fx.poison(every_dst)

    def before(layer: int) -> list[int]:  # fill each source layer just in time; job 2 fails at 2
        for s, f in zip(staging, bulk, strict=True):
            s[layer].copy_(f[layer])
        return [2] if layer == 2 else []

    with no_host_sync(device):
        load = layerwise_load(kv, list(zip(dst, staging, strict=True)), before)
        for _ in range(fx.L):
            next(load)
    load.close()
    if cuda:
        torch.cuda.synchronize()
    for j, (s_ids, d_ids) in enumerate(zip(src, dst, strict=True)):
        for layer in range(fx.L):
            for s, d in zip(s_ids, d_ids, strict=True):
                got = fx.ref_page(layer, d)
                if j == 2 and layer >= 2:
                    assert bool((got == POISON).all()), f"dropped job wrote layer {layer} block {d}"
                else:
                    assert torch.equal(got, snap.ref_page(layer, s)), (j, layer, d)
    fx.poison(every_dst)
    scatter_many(kv, list(zip(dst, bulk, strict=True)))
    assert_loaded(fx, snap, [b for s in src for b in s], every_dst)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("route", list(CHUNK_ROUTES))
def test_cuda_chunk_job_steps_ask_torch_the_same_for_one_job_and_for_eight(route: str) -> None:
    """Host work per layer step independent of the jobs on CUDA (tests/unit/test_gpu_paged.py
    checks CPU's routes): every layer-wise store and load step of eight chunk jobs makes the
    torch calls one job's makes."""
    per_step: dict[tuple[str, int], list[int]] = {}
    for count in (1, 8):
        fx, kv, src, dst, how = chunk_case(route, "cuda", count)
        objs = chunk_objects(how, fx.L, [CHUNK] * count, fx.page, device="cuda", pin=True)
        for direction, ids in (("store", src), ("load", dst)):
            jobs = list(zip(ids, objs, strict=True))
            steps = (layerwise_store(kv, jobs) if direction == "store"
                     else layerwise_load(kv, jobs))
            calls = []
            for _ in range(fx.L):
                with TorchCalls() as seen:
                    next(steps)
                calls.append(seen.total)
            steps.close()
            per_step[direction, count] = calls
    for direction in ("store", "load"):
        assert max(per_step[direction, 1]) > 0  # (a load's last steps issue nothing: ahead)
        assert per_step[direction, 8] == per_step[direction, 1], direction
