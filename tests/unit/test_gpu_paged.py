"""kvplug.gpu page views, bulk and layer-wise transfer, against an independent byte reference.

Every KV cache here is built like vLLM 0.32 builds it: one shared int8 buffer, one 4-D view per
layer in the KV dtype. The reference for "page (layer l, block b)" is computed from the buffer
and the layout's known byte offsets, never through kvplug's views, and the round trip is also
checked through the original 4-D tensors (logical values). Destinations are poisoned before
every copy, and a negative control shows the checks catch a skipped or misplaced page.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvplug.errors import KVPlugError
from kvplug.gpu import (
    KVLayoutError,
    PagedKV,
    alloc_host,
    blocks_for_tokens,
    copy_plan,
    gather,
    gather_many,
    layerwise_load,
    layerwise_store,
    pages_for_tokens,
    scatter,
    scatter_many,
)
from kvplug.gpu.copy_plan import plan_copies

from tests.support.gpu_kv_fixture import (
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

# ---------------------------------------------------------------- page views


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [*LAYOUTS, "BLHNC"])
def test_page_views_are_zero_copy_pages(layout: str, dtype: torch.dtype) -> None:
    fx = KVFixture(layout, dtype)
    kv = PagedKV.from_kv_caches(fx.caches)
    assert (kv.num_layers, kv.num_blocks, kv.page_bytes) == (fx.L, fx.B, fx.page)
    assert kv.kv_dtype == dtype and kv.device.type == "cpu"
    assert kv.layer_names == list(fx.caches)
    for layer, view in enumerate(kv.views):
        assert view.dtype == torch.uint8 and tuple(view.shape) == (fx.B, fx.page)
        assert view.untyped_storage().data_ptr() == fx.buf.untyped_storage().data_ptr()
        for b in range(fx.B):
            assert torch.equal(view[b], fx.ref_page(layer, b))
    # zero copy: a write through the view is visible in the engine's tensor
    kv.views[1][5].fill_(7)
    assert torch.equal(fx.ref_page(1, 5), torch.full((fx.page,), 7, dtype=torch.uint8))


def test_fixture_physical_order_is_what_the_layout_says() -> None:
    fx = KVFixture("LBNHC", torch.float16)
    t = fx.tensors[0]
    assert not t.is_contiguous() and not t[3].is_contiguous()
    assert torch.equal(t[3].permute(1, 0, 2).contiguous().view(torch.uint8).flatten(),
                       fx.ref_page(0, 3))


def test_stacked_view_only_for_evenly_spaced_layers() -> None:
    fx = KVFixture("LBNHC", torch.float16, L=4)
    kv = PagedKV.from_kv_caches(fx.caches)
    assert kv.stacked is not None and tuple(kv.stacked.shape) == (4, fx.B, fx.page)
    for layer in range(4):
        assert torch.equal(kv.stacked[layer], kv.views[layer])
    names = list(fx.caches)
    shuffled = {n: fx.caches[n] for n in (names[2], names[0], names[1], names[3])}
    assert PagedKV.from_kv_caches(shuffled).stacked is None
    separate = {n: t.clone() for n, t in fx.caches.items()}
    assert PagedKV.from_kv_caches(separate).stacked is None


def test_separate_buffers_round_trip() -> None:
    """Layers in separate allocations (no stacked view), in a shuffled order."""
    fx = KVFixture("LBHNC", torch.bfloat16, L=4)
    names = list(fx.caches)
    order = [names[i] for i in (3, 1, 0, 2)]
    caches = {n: fx.caches[n].clone() for n in order}
    kv = PagedKV.from_kv_caches(caches)
    assert kv.layer_names == order and kv.stacked is None
    ids = [7, 2, 3, 4, 9]
    out = poisoned((4, len(ids), fx.page))
    gather(kv, ids, out)
    for i, n in enumerate(order):
        want = torch.stack([caches[n][b].contiguous().view(torch.uint8).flatten() for b in ids])
        assert torch.equal(out[i], want)
    dst = [11, 12, 13, 0, 5]
    for t in caches.values():
        t[dst] = 0  # poison the destination blocks
    scatter(kv, out, dst)
    for i, n in enumerate(order):
        got = torch.stack([caches[n][b].contiguous().view(torch.uint8).flatten() for b in dst])
        assert torch.equal(got, out[i])


def test_aliases_are_deduplicated() -> None:
    fx = KVFixture("LBHNC", torch.bfloat16)
    names = list(fx.caches)
    caches = {names[0]: fx.tensors[0], "shared.kv": fx.tensors[0], names[1]: fx.tensors[1]}
    # a second tensor object over the same memory is an alias too
    caches["shared.again"] = fx.tensors[1].view(fx.tensors[1].shape)
    kv = PagedKV.from_kv_caches(caches)
    assert kv.layer_names == [names[0], names[1]]
    assert kv.num_layers == 2
    assert kv.index_of("shared.kv") == 0 and kv.index_of("shared.again") == 1
    assert kv.index_of(names[1]) == 1
    with pytest.raises(KeyError, match="nope"):
        kv.index_of("nope")


def test_strided_slice_is_rejected() -> None:
    fx = KVFixture("LBHNC", torch.bfloat16)
    bad = fx.tensors[0][:, :, ::2]  # every other token: a page has holes
    with pytest.raises(KVLayoutError, match=r"'layer.x'.*dense run") as info:
        PagedKV.from_kv_caches({"layer.x": bad})
    assert "strides" in str(info.value) and isinstance(info.value, (ValueError, KVPlugError))


def test_heads_outside_blocks_is_rejected() -> None:
    raw = torch.zeros(2 * 8 * 4 * 16, dtype=torch.int8).view(torch.float16)
    hbnc = raw.view(2, 8, 4, 8).permute(1, 0, 2, 3)  # [B,H,N,C] with H outermost in memory
    with pytest.raises(KVLayoutError, match="hbnc"):
        PagedKV.from_kv_caches({"hbnc": hbnc})


def test_mismatched_layers_and_empty_are_rejected() -> None:
    a = KVFixture("LBHNC", torch.float16)
    b = KVFixture("LBHNC", torch.float16, N=8)
    with pytest.raises(KVLayoutError, match="page bytes"):
        PagedKV.from_kv_caches({"a": a.tensors[0], "b": b.tensors[0]})
    with pytest.raises(KVLayoutError, match="no KV layers"):
        PagedKV.from_kv_caches({})
    with pytest.raises(KVLayoutError, match="overlap"):
        PagedKV.from_kv_caches({"o": torch.as_strided(a.tensors[0], (4, 2, 4, 8), (8, 32, 8, 1))})


def test_a_kv_first_layout_is_refused_against_the_engines_block_count() -> None:
    """vLLM's older per-layer layout ``[2, num_blocks, block_size, heads, head_dim]`` (K and V
    first) is dense per "page" of dimension 0, so without the engine's block count it registered
    silently as a cache of 2 blocks (before: no error). Given ``num_blocks`` (vLLM's
    ``KVCacheConfig``), it is refused with the layout named; the block-first layout of the same
    bytes is accepted (the negative control)."""
    blocks = 16
    kv_first = torch.zeros(2, blocks, 4, 2, 8, dtype=torch.float16)
    assert PagedKV.from_kv_caches({"l0": kv_first}).num_blocks == 2  # what slipped through
    with pytest.raises(KVLayoutError, match=r"'l0'.*dimension 0 has 2 entries.*16 KV blocks"
                                            r".*\[2, num_blocks, \.\.\.\]"):
        PagedKV.from_kv_caches({"l0": kv_first}, num_blocks=blocks)
    block_first = kv_first.permute(1, 0, 2, 3, 4).contiguous()
    assert PagedKV.from_kv_caches({"l0": block_first}, num_blocks=blocks).num_blocks == blocks


# ---------------------------------------------------------------- bulk


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("pattern", ["random", "runs", "reversed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [*LAYOUTS, "BLHNC"])
def test_bulk_round_trip(layout: str, dtype: torch.dtype, pattern: str, stacked: bool) -> None:
    fx = KVFixture(layout, dtype, seed=sum(map(ord, layout + pattern)))
    kv = PagedKV.from_kv_caches(fx.caches)
    assert kv.stacked is not None  # one buffer, evenly spaced layers: the all-layers path
    if not stacked:
        kv.stacked = None  # force the per-layer path (layers in separate buffers)
    src_ids, dst_ids = id_patterns(random.Random(pattern), fx.B)[pattern]
    snap = snapshot_of(fx)
    out = poisoned((fx.L, len(src_ids), fx.page))
    gather(kv, torch.tensor(src_ids), out)
    assert_obj_matches(out, snap.ref_obj(src_ids))
    assert_loaded(fx, snap, [], [])  # gather changed nothing
    fx.poison(dst_ids)
    scatter(kv, out, dst_ids)
    assert_loaded(fx, snap, src_ids, dst_ids)


def test_many_jobs_with_block_ids_shared_across_requests() -> None:
    fx = KVFixture("LBNHC", torch.bfloat16)
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    req_a, req_b = [1, 2, 3, 9], [1, 2, 3, 4, 5, 12]  # a shared prefix: the same blocks
    outs = [poisoned((fx.L, len(r), fx.page)) for r in (req_a, req_b)]
    gather_many(kv, [(req_a, outs[0]), (req_b, outs[1])])
    assert_obj_matches(outs[0], snap.ref_obj(req_a))
    assert_obj_matches(outs[1], snap.ref_obj(req_b))
    dst_a, dst_b = [15, 14, 7, 8], [0, 6, 10, 11, 13, 1]
    fx.poison(dst_a + dst_b)
    scatter_many(kv, [(dst_a, outs[0]), (dst_b, outs[1])])
    assert_loaded(fx, snap, req_a + req_b, dst_a + dst_b)


def test_scatter_many_applies_jobs_in_order() -> None:
    fx = KVFixture("LBHNC", torch.float16)
    kv = PagedKV.from_kv_caches(fx.caches)
    first = torch.full((fx.L, 1, fx.page), 1, dtype=torch.uint8)
    second = torch.full((fx.L, 1, fx.page), 2, dtype=torch.uint8)
    scatter_many(kv, [([4], first), ([4], second)])
    assert torch.equal(fx.ref_page(2, 4), second[2, 0])


def test_memory_object_slices_and_partial_chunks() -> None:
    """Skip leading tokens and a partial last chunk, at block granularity (block_size 4)."""
    fx = KVFixture("LBHNC", torch.bfloat16, N=4)
    kv = PagedKV.from_kv_caches(fx.caches)
    block_size, chunk = 4, 16
    table = [9, 2, 14, 3, 7, 11, 5, 1, 12, 6]  # 37 tokens occupy 10 blocks, the last holds 1
    snap = snapshot_of(fx)
    objs = []
    for start in range(0, 37, chunk):  # chunks [0,16) [16,32) [32,37)
        ids = blocks_for_tokens(table, start, min(start + chunk, 37), block_size)
        out = poisoned((fx.L, len(ids), fx.page))
        gather(kv, ids, out)
        objs.append(out)
    assert [o.shape[1] for o in objs] == [4, 4, 2]
    # a new request with the same 37 tokens; the engine already holds tokens [0, 24)
    new_table = [0, 4, 8, 10, 13, 15, 1, 3, 5, 6]
    skip = 24
    loaded_from, written = [], []
    for c, obj in enumerate(objs):
        chunk_start, chunk_end = c * chunk, min((c + 1) * chunk, 37)
        if chunk_end <= skip:
            continue
        start = max(chunk_start, skip)
        pages = pages_for_tokens(start, chunk_end, block_size, chunk_start=chunk_start)
        dst = blocks_for_tokens(new_table, start, chunk_end, block_size)
        fx.poison(dst)
        scatter(kv, obj[:, pages], dst)  # a non-contiguous slice of the memory object
        loaded_from += blocks_for_tokens(table, start, chunk_end, block_size)
        written += dst
    assert written == [1, 3, 5, 6] and loaded_from == [5, 1, 12, 6]
    # the last page (block 6 <- old block 6) holds token 36 plus 3 slots copied as-is
    assert_loaded(fx, snap, loaded_from, written)


def test_checks_catch_a_wrong_copy() -> None:
    """Negative control: the reference checks fail on a skipped, misplaced or stray copy."""
    fx = KVFixture("LBNHC", torch.bfloat16)
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    ids = [3, 8, 1]
    out = poisoned((fx.L, 3, fx.page))
    with pytest.raises(AssertionError):  # nothing copied: poison is detected
        assert_obj_matches(out, snap.ref_obj(ids))
    gather(kv, [3, 8, 2], out)  # one wrong block
    with pytest.raises(AssertionError, match=r"\[0, 2\]"):
        assert_obj_matches(out, snap.ref_obj(ids))
    gather(kv, ids, out)
    fx.poison([5, 6])
    scatter(kv, out[:, :1], [5])  # block 6 poisoned but never loaded
    with pytest.raises(AssertionError, match="block 6 was not named"):
        assert_loaded(fx, snap, [3], [5])
    with pytest.raises(AssertionError, match="block 6: bytes of block 8"):
        assert_loaded(fx, snap, [3, 8], [5, 6])


def test_bad_arguments_are_refused() -> None:
    fx = KVFixture("LBHNC", torch.float16)
    kv = PagedKV.from_kv_caches(fx.caches)
    with pytest.raises(ValueError, match=r"shape \[3, 2, "):
        gather(kv, [1, 2], torch.empty(3, 3, fx.page, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        gather(kv, [1, 2], torch.empty(3, 2, fx.page // 2, dtype=torch.float16))
    with pytest.raises(IndexError, match="block id 16"):
        gather(kv, [1, 16], torch.empty(3, 2, fx.page, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"block ids \[2\] repeat"):
        scatter(kv, torch.empty(3, 3, fx.page, dtype=torch.uint8), [2, 5, 2])
    with pytest.raises(ValueError, match="repeat"):
        layerwise_load(kv, [([2, 2], torch.empty(3, 2, fx.page, dtype=torch.uint8))])
    gather(kv, [], torch.empty(3, 0, fx.page, dtype=torch.uint8))  # nothing to do is fine


# ---------------------------------------------------------------- layer-wise


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_matches_bulk(layout: str, dtype: torch.dtype) -> None:
    fx = KVFixture(layout, dtype, L=4)
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    jobs_ids = [[5, 2, 3, 4, 11], [2, 3, 14]]
    bulk = [poisoned((fx.L, len(i), fx.page)) for i in jobs_ids]
    gather_many(kv, list(zip(jobs_ids, bulk, strict=True)))
    lw = [poisoned((fx.L, len(i), fx.page)) for i in jobs_ids]
    steps = layerwise_store(kv, list(zip(jobs_ids, lw, strict=True)))
    for layer in range(fx.L):
        assert next(steps) == layer
        for o, b in zip(lw, bulk, strict=True):
            assert torch.equal(o[: layer + 1], b[: layer + 1])
    with pytest.raises(StopIteration):
        next(steps)
    for o, b, ids in zip(lw, bulk, jobs_ids, strict=True):
        assert torch.equal(o, b)
        assert_obj_matches(o, snap.ref_obj(ids))

    dst = [[0, 1, 6, 7, 8], [9, 10, 12]]
    fx.poison(dst[0] + dst[1])
    seen = []
    for layer in layerwise_load(kv, [(dst[0], lw[0]), (dst[1], lw[1])]):
        seen.append(layer)
        for d, s in zip(dst[0] + dst[1], jobs_ids[0] + jobs_ids[1], strict=True):
            assert torch.equal(fx.ref_page(layer, d), snap.ref_page(layer, s))
    assert seen == list(range(fx.L))
    assert_loaded(fx, snap, jobs_ids[0] + jobs_ids[1], dst[0] + dst[1])


def test_layerwise_load_fills_sources_just_in_time_and_drops_failed_jobs() -> None:
    fx = KVFixture("LBHNC", torch.float16, L=4)
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    src_ids, dst = [[1, 2], [3, 4]], [[8, 9], [10, 11]]
    full = [snap.ref_obj(i) for i in src_ids]
    staged = [poisoned((fx.L, 2, fx.page)) for _ in src_ids]
    fx.poison(dst[0] + dst[1])

    def before(layer: int) -> list[int]:
        for s, f in zip(staged, full, strict=True):
            s[layer].copy_(f[layer])
        return [1] if layer == 2 else []  # job 1's source fails at layer 2

    assert list(layerwise_load(kv, [(dst[0], staged[0]), (dst[1], staged[1])], before)) == list(
        range(fx.L))
    for layer in range(fx.L):
        for d, s in zip(dst[0], src_ids[0], strict=True):
            assert torch.equal(fx.ref_page(layer, d), snap.ref_page(layer, s))
        for d, s in zip(dst[1], src_ids[1], strict=True):
            got = fx.ref_page(layer, d)
            if layer < 2:
                assert torch.equal(got, snap.ref_page(layer, s))
            else:
                assert bool((got == POISON).all()), "a dropped job still wrote its pages"


def test_layerwise_generators_validate_eagerly_and_close() -> None:
    fx = KVFixture("MLA", torch.bfloat16)
    kv = PagedKV.from_kv_caches(fx.caches)
    with pytest.raises(ValueError):  # refused at the call, not at the first next()
        layerwise_store(kv, [([1, 2], torch.empty(1, 2, fx.page, dtype=torch.uint8))])
    out = alloc_host(kv, 2)
    steps = layerwise_store(kv, [([1, 2], out)])
    next(steps)
    steps.close()
    with pytest.raises(StopIteration):
        next(steps)
    assert list(layerwise_load(kv, [])) == list(range(fx.L))


# ---------------------------------------------------------------- one copy plan for many jobs
#
# The connector's shape: one job per chunk, many chunks per step. A call resolves all its jobs
# into one plan that takes one route (rows: objects in L1's host pool; staged: objects apart;
# runs: long runs of blocks); every route is checked against the byte reference here.

#: route -> how its objects are allocated
ROUTES = {"rows": "pool", "staged": "apart", "runs": "pool"}


@pytest.fixture
def use_route(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """``use_route(route)``: a small KV cache whose plans take ``route`` (runs of blocks count as
    long for the runs route, never for the others, so small pages exercise every route)."""

    def use(route: str, layout: str = "LBHNC", seed: int = 0) -> KVFixture:
        monkeypatch.setitem(copy_plan.RUN_BYTES, "cpu", 0 if route == "runs" else 1 << 62)
        return KVFixture(layout, torch.bfloat16, L=4, B=64, H=2, N=4, C=8, seed=seed)

    return use


def chunk_jobs(rng: random.Random) -> tuple[list[list[int]], list[int], list[slice]]:
    """Source ids of six chunk jobs, each object's page count, and the pages each job uses:
    a run, ids shared with another job, scattered ids, a partial chunk (3 pages), a chunk whose
    first two pages are skipped (a slice of its object), runs mixed with singles."""
    scattered = rng.sample(range(20, 64), 14)
    ids = [
        [10, 11, 12, 13],
        [10, 11, *scattered[:2]],
        scattered[2:6],
        [4, 5, scattered[6]],
        scattered[7:11],
        [1, 2, *scattered[11:13], 60][:4],
    ]
    pages = [4, 4, 4, 3, 6, 4]
    used = [slice(0, 4), slice(0, 4), slice(0, 4), slice(0, 3), slice(2, 6), slice(0, 4)]
    return ids, pages, used


def route_of(kv: PagedKV, jobs: list, to_engine: bool, bulk: bool) -> list[str]:
    return [r.name for r in plan_copies(kv, jobs, to_engine, bulk).routes]


def expected_route(route: str, to_engine: bool, bulk: bool) -> str:
    """Long runs on CPU: a layer-wise gather goes job by job through an index (``index``)."""
    return "index" if route == "runs" and not (to_engine or bulk) else route


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "MLA", "BLHNC"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_one_plan_moves_many_chunk_jobs_byte_exact(route: str, layout: str, stacked: bool,
                                                   use_route) -> None:  # noqa: ANN001
    """Bulk and layer-wise, both ways, six chunk jobs in one plan: every page where the
    reference puts it, the pages a job does not name untouched (poisoned objects and blocks)."""
    fx = use_route(route, layout, seed=len(route + layout))
    kv = PagedKV.from_kv_caches(fx.caches)
    if not stacked:
        kv.stacked = None
    snap = snapshot_of(fx)
    src, pages, used = chunk_jobs(random.Random(route + layout))
    how = ROUTES[route]
    for gather_call in ("bulk", "layer-wise"):
        objs = chunk_objects(how, fx.L, pages, fx.page)
        jobs = [(ids, o[:, u]) for ids, o, u in zip(src, objs, used, strict=True)]
        bulk = gather_call == "bulk"
        assert route_of(kv, jobs, False, bulk) == [expected_route(route, False, bulk)]
        if gather_call == "bulk":
            gather_many(kv, jobs)
        else:
            assert list(layerwise_store(kv, jobs)) == list(range(fx.L))
        for (ids, got), o, u in zip(jobs, objs, used, strict=True):
            assert_obj_matches(got, snap.ref_obj(ids))
            assert bool((o[:, : u.start] == POISON).all()), "a page the job did not name changed"
        assert_loaded(fx, snap, [], [])  # a gather writes no block

    dst = random.Random(layout).sample(range(1, fx.B), sum(len(i) for i in src))
    it = iter(dst)
    loads = [([next(it) for _ in ids], got) for ids, got in jobs]
    all_src = [b for ids in src for b in ids]
    for scatter_call in ("bulk", "layer-wise"):
        assert route_of(kv, loads, True, scatter_call == "bulk") == [route]
        fx.poison(dst)
        if scatter_call == "bulk":
            scatter_many(kv, loads)
        else:
            assert list(layerwise_load(kv, loads)) == list(range(fx.L))
        assert_loaded(fx, snap, all_src, dst)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_layer_step_asks_torch_the_same_for_one_job_and_for_many(route: str, direction: str,
                                                                   use_route) -> None:  # noqa: ANN001
    """Host work per layer step does not grow with the jobs: every step of a layer-wise store or
    load of 12 chunk jobs makes exactly the torch calls a step of one job makes (per-job code
    made ~24 calls per job and layer). The one exception by design: a CPU gather of long runs
    (large pages, where the bytes dwarf the calls) makes one ``index_select`` per job."""
    fx = use_route(route)
    kv = PagedKV.from_kv_caches(fx.caches)
    rng = random.Random(direction)
    per_step = {}
    for count in (1, 12):
        objs = chunk_objects(ROUTES[route], fx.L, [4] * count, fx.page)
        ids = rng.sample(range(1, fx.B), 4 * count)
        jobs = [(ids[4 * j: 4 * j + 4], o) for j, o in enumerate(objs)]
        assert route_of(kv, jobs, direction == "load", False) == [
            expected_route(route, direction == "load", False)]
        steps = (layerwise_store if direction == "store" else layerwise_load)(kv, jobs)
        calls = []
        for _ in range(fx.L):
            with TorchCalls() as seen:
                next(steps)
            calls.append(seen.total)
        steps.close()
        per_step[count] = calls
    assert min(per_step[1]) > 0, "the counter saw no torch call"
    extra = 11 if expected_route(route, direction == "load", False) == "index" else 0
    assert per_step[12] == [c + extra for c in per_step[1]]


def dropped_load(fx: KVFixture, route: str,
                 drops: dict[int, list[int]]) -> tuple[KVFixture, list, list]:
    """A layer-wise load of five chunk jobs into ``fx`` whose sources are filled just in time,
    ``before`` dropping ``drops[layer]`` at that layer; returns the snapshot taken before, the
    source and destination ids."""
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    rng = random.Random(route)
    ids = rng.sample(range(1, fx.B), 40)
    src, dst = [ids[4 * j: 4 * j + 4] for j in range(5)], [ids[20 + 4 * j: 24 + 4 * j] for j in range(5)]
    full = [snap.ref_obj(s) for s in src]
    staged = chunk_objects(ROUTES[route], fx.L, [4] * 5, fx.page)
    fx.poison([b for d in dst for b in d])

    def before(layer: int) -> list[int]:
        for s, f in zip(staged, full, strict=True):
            s[layer].copy_(f[layer])
        return drops.get(layer, [])

    jobs = list(zip(dst, staged, strict=True))
    assert route_of(kv, jobs, True, False) == [route]
    assert list(layerwise_load(kv, jobs, before)) == list(range(fx.L))
    return snap, src, dst


def written_after_drop(fx: KVFixture, snap: KVFixture, src: list, dst: list,
                       dropped_at: dict[int, int]) -> list[tuple[int, int]]:
    """(layer, block) pages that break the drop contract: a job's page missing before its drop,
    or not poisoned from its drop on; every other job's pages must all be in place."""
    bad = []
    for j, (s_ids, d_ids) in enumerate(zip(src, dst, strict=True)):
        stop = dropped_at.get(j, fx.L)
        for layer in range(fx.L):
            for s, d in zip(s_ids, d_ids, strict=True):
                got = fx.ref_page(layer, d)
                ok = (torch.equal(got, snap.ref_page(layer, s)) if layer < stop
                      else bool((got == POISON).all()))
                if not ok:
                    bad.append((layer, d))
    return bad


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_dropped_job_is_never_written_again(route: str, use_route) -> None:  # noqa: ANN001
    """``before`` drops job 1 at layer 2 and job 4 before any layer: one plan for all jobs must
    leave exactly their pages from then on (and write every other page). Negative control: the
    same load without the drops writes those pages, and the check sees it."""
    dropped_at = {1: 2, 4: 0}
    fx = use_route(route, "LBNHC")
    snap, src, dst = dropped_load(fx, route, {2: [1], 0: [4], 3: [4, 1]})  # repeats are fine
    assert written_after_drop(fx, snap, src, dst, dropped_at) == []
    fx = use_route(route, "LBNHC")
    snap, src, dst = dropped_load(fx, route, {})
    bad = written_after_drop(fx, snap, src, dst, dropped_at)
    assert sorted(bad) == sorted([(layer, d) for layer in (2, 3) for d in dst[1]]
                                 + [(layer, d) for layer in range(4) for d in dst[4]])


@pytest.mark.parametrize("route", list(ROUTES))
def test_scatter_jobs_naming_one_block_apply_in_order_and_a_drop_reverts_to_the_earlier(
    route: str, use_route,  # noqa: ANN001
) -> None:
    """Jobs 0 and 2 both write block 30: bulk and layer-wise, the later job's page stays. Dropped
    at layer 1, job 2 has written layer 0 only, and from layer 1 on the block holds job 0's page
    (a plan rebuilt without job 2, never one that skips both)."""
    fx = use_route(route)
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    src = [[1, 2], [3, 4], [5, 6]]
    dst = [[30, 31], [32, 33], [34, 30]]
    objs = chunk_objects(ROUTES[route], fx.L, [2, 2, 2], fx.page)
    gather_many(kv, list(zip(src, objs, strict=True)))
    jobs = list(zip(dst, objs, strict=True))
    assert route_of(kv, jobs, True, False) == [route] * 3  # one route per job, in order
    fx.poison([30, 31, 32, 33, 34])
    scatter_many(kv, jobs)
    assert_loaded(fx, snap, [2, 3, 4, 5, 6], [31, 32, 33, 34, 30])
    fx.poison([30, 31, 32, 33, 34])
    for _ in layerwise_load(kv, jobs):
        pass
    assert_loaded(fx, snap, [2, 3, 4, 5, 6], [31, 32, 33, 34, 30])
    fx.poison([30])
    assert list(layerwise_load(kv, jobs, lambda layer: [2] if layer == 1 else [])) == [0, 1, 2, 3]
    assert torch.equal(fx.ref_page(0, 30), snap.ref_page(0, 6))
    for layer in (1, 2, 3):
        assert torch.equal(fx.ref_page(layer, 30), snap.ref_page(layer, 1)), layer


def test_gather_jobs_into_one_object_keep_job_order(use_route) -> None:  # noqa: ANN001
    """Gather jobs into slices of one object (their extents interleave, their pages do not)
    take the rows route; two jobs writing the same pages never do (one index call would write
    those rows in no defined order), and the later job's pages stay."""
    fx = use_route("rows")
    kv = PagedKV.from_kv_caches(fx.caches)
    obj = chunk_objects("pool", fx.L, [3], fx.page)[0]
    halves = [([5, 6], obj[:, :2]), ([11], obj[:, 2:])]
    assert route_of(kv, halves, False, False) == ["rows"]
    assert list(layerwise_store(kv, halves)) == list(range(fx.L))
    assert_obj_matches(obj, fx.ref_obj([5, 6, 11]))
    jobs = [([1, 2, 3], obj), ([7, 8, 9], obj)]
    assert route_of(kv, jobs, False, True) == ["staged"]
    gather_many(kv, jobs)
    assert_obj_matches(obj, fx.ref_obj([7, 8, 9]))
    obj.fill_(POISON)
    assert list(layerwise_store(kv, jobs)) == list(range(fx.L))
    assert_obj_matches(obj, fx.ref_obj([7, 8, 9]))


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_rows_route_at_any_alignment(offset: int, use_route) -> None:  # noqa: ANN001
    """Objects carved from one buffer at 8-, 1- and 4-byte alignment: the index calls move the
    widest words the addresses allow (8, 1, 4 bytes), the bytes are the same."""
    fx = use_route("rows", "LBNHC")
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    src = [[3, 9, 1, 22], [40, 41, 42], [17, 5, 63, 6]]
    objs = chunk_objects("arena", fx.L, [len(s) for s in src], fx.page, offset=offset)
    jobs = list(zip(src, objs, strict=True))
    plan = plan_copies(kv, jobs, False)
    assert [(r.name, r.word) for r in plan.routes] == [("rows", {0: 8, 1: 1, 4: 4}[offset])]
    gather_many(kv, jobs)
    for ids, o in jobs:
        assert_obj_matches(o, snap.ref_obj(ids))
    dst = [[10, 11, 12, 13], [50, 51, 52], [30, 29, 28, 27]]
    fx.poison([b for d in dst for b in d])
    for _ in layerwise_load(kv, list(zip(dst, objs, strict=True))):
        pass
    assert_loaded(fx, snap, [b for s in src for b in s], [b for d in dst for b in d])


def test_a_bad_job_among_many_is_refused_before_any_byte_moves(use_route) -> None:  # noqa: ANN001
    fx = use_route("rows")
    kv = PagedKV.from_kv_caches(fx.caches)
    objs = chunk_objects("pool", fx.L, [2, 2, 2], fx.page)
    with pytest.raises(IndexError, match="block id 64 out of range"):
        gather_many(kv, [([1, 2], objs[0]), ([3, 4], objs[1]), ([5, 64], objs[2])])
    with pytest.raises(ValueError, match=r"block ids \[7\] repeat"):
        layerwise_load(kv, [([1, 2], objs[0]), ([7, 7], objs[1])])
    assert all(bool((o == POISON).all()) for o in objs)


@pytest.mark.parametrize("route", list(ROUTES))
def test_transfers_in_and_out_of_inference_mode_share_one_cache(route: str, use_route) -> None:  # noqa: ANN001
    """vLLM's thread stores in inference mode; a test or another thread then loads outside it
    through the same ``PagedKV``. Views made in inference mode are inference tensors, which
    only inference mode may write: nothing made for one call may be reused by the other (a
    cache of word views did, and the load raised ``Inplace update to inference tensor``)."""
    fx = use_route(route)
    kv = PagedKV.from_kv_caches(fx.caches)
    snap = snapshot_of(fx)
    src, dst = [[3, 4, 9, 1], [20, 21]], [[40, 41, 42, 43], [50, 52]]
    objs = chunk_objects(ROUTES[route], fx.L, [4, 2], fx.page)
    with torch.inference_mode():
        gather_many(kv, list(zip(src, objs, strict=True)))
        assert list(layerwise_store(kv, list(zip(src, objs, strict=True)))) == list(range(fx.L))
    fx.poison([b for d in dst for b in d])
    for _ in layerwise_load(kv, list(zip(dst, objs, strict=True))):
        pass
    assert_loaded(fx, snap, [b for s in src for b in s], [b for d in dst for b in d])
    fx.poison([b for d in dst for b in d])
    scatter_many(kv, list(zip(dst, objs, strict=True)))
    assert_loaded(fx, snap, [b for s in src for b in s], [b for d in dst for b in d])
