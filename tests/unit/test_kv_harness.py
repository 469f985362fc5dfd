"""kvplug.gpu inside a simulated vLLM forward pass (tests/support/kv_harness.py): layer-wise store and
load overlapping the compute side, checked byte for byte, on CPU and (where there is one) CUDA.

The CPU variants run in CI; the CUDA ones skip with "needs a CUDA device" and run on a GPU
machine through scripts/gpu_check.sh. Nothing here asserts on timing.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.gpu_kv_fixture import CROSS_LAYER, CUDA
from tests.support.kv_harness import (
    BLOCK_SIZE,
    DROPS,
    HARNESS_LAYOUTS,
    KV_DTYPES,
    PATTERNS,
    Mismatch,
    PipelineHarness,
    scenarios,
)

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])]
#: per device: harness shape and blocks per set (CUDA: Llama-3-8B pages of 64 KiB, so contiguous
#: sets take kvplug's direct-copy path and scattered ones its staged path)
SHAPES = {
    "cpu": ({"layers": 4, "blocks": 48, "heads": 2, "head_size": 8}, 8),
    "cuda": ({"layers": 6, "blocks": 64, "heads": 8, "head_size": 128}, 16),
}


def harness(layout: str, dtype: str, device: str, seed: int = 0) -> tuple[PipelineHarness, int]:
    shape, n = SHAPES[device]
    return PipelineHarness(layout, KV_DTYPES[dtype], device, seed=seed, **shape), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(KV_DTYPES))
@pytest.mark.parametrize("layout", HARNESS_LAYOUTS)
def test_views_are_vllm_layouts(layout: str, dtype: str, device: str) -> None:
    """Standardized [B, H, N, C] views over one int8 buffer; each page is the block's values in
    the layout's physical order, at the layout's offset."""
    h, _ = harness(layout, dtype, device)
    fx = h.fx
    assert fx.buf.dtype == torch.int8 and fx.buf.device.type == device
    esize = torch.empty(0, dtype=KV_DTYPES[dtype]).element_size()
    assert fx.page == h.H * BLOCK_SIZE * h.C * esize == h.kv.page_bytes
    nh = layout.endswith("NHC")
    for layer, t in enumerate(fx.tensors):
        assert tuple(t.shape) == (h.B, h.H, BLOCK_SIZE, h.C) and t.dtype == KV_DTYPES[dtype]
        assert t.untyped_storage().data_ptr() == fx.buf.untyped_storage().data_ptr()
        block_stride = (h.L if layout in CROSS_LAYER else 1) * fx.page // esize
        assert t.stride(0) == block_stride
        for b in (1, h.B // 2, h.B - 1):
            physical = t[b].permute(1, 0, 2) if nh else t[b]
            got = physical.contiguous().view(torch.uint8).flatten().cpu()
            assert torch.equal(got, fx.ref_page(layer, b)), (layer, b)
    if layout == "LBNHC":  # as vLLM reports for FlashAttention: neither is contiguous
        assert not fx.tensors[0].is_contiguous() and not fx.tensors[0][1].is_contiguous()


def test_scenarios_are_disjoint_and_skip_the_null_block() -> None:
    for sc in scenarios(48, 8).values():
        sets = [set(sc.store_ids), set(sc.src_ids), set(sc.dst_ids)]
        assert all(len(s) == 8 for s in sets) and 0 not in set.union(*sets)
        assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    with pytest.raises(ValueError):
        scenarios(16, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", list(KV_DTYPES))
@pytest.mark.parametrize("layout", HARNESS_LAYOUTS)
def test_overlapped_store_and_load_are_byte_exact(
    layout: str, dtype: str, pattern: str, device: str
) -> None:
    h, n = harness(layout, dtype, device)
    sc = scenarios(h.B, n, seed=1)[pattern]
    assert h.run(sc) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_chunk_jobs_overlapped_are_byte_exact_bf16(layout: str, pattern: str, device: str) -> None:
    """The connector's shape: the store and the load each as chunk jobs of 2 (CPU) or 4 (CUDA)
    blocks in one copy plan, and a dropped wait still caught at its layer only."""
    h, n = harness(layout, "bf16", device)
    sc = scenarios(h.B, n, seed=3)[pattern]
    chunk = n // 4
    assert h.run(sc, chunk=chunk) == []
    k = h.L // 2
    bad = h.run(sc, drop="load", race_layer=k, chunk=chunk)
    assert set(bad) == {Mismatch("read", k, b) for b in sc.dst_ids}


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_runs_on_one_cache_stay_exact(device: str) -> None:
    """Streams, plans and events are reused across forward passes of one PagedKV."""
    h, n = harness("LBNHC", "bf16", device)
    for seed, pattern in enumerate(PATTERNS):
        h.seed = seed
        assert h.run(scenarios(h.B, n, seed=seed)[pattern]) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("drop", DROPS)
def test_negative_control_a_dropped_wait_is_caught(drop: str, layout: str, device: str) -> None:
    """Dropping one wait (store: the copy does not wait for the layer's write; load: the compute
    side does not wait for the layer's copy) fails the comparison, at that layer only."""
    h, n = harness(layout, "bf16", device)
    sc = scenarios(h.B, n, seed=2)["random"]
    k = h.L // 2
    bad = h.run(sc, drop=drop, race_layer=k)
    what = "stored" if drop == "store" else "read"
    blocks = sc.store_ids if drop == "store" else sc.dst_ids
    assert bad, "the harness did not notice a dropped wait"
    assert set(bad) == {Mismatch(what, k, b) for b in blocks}
    assert h.run(sc) == []  # the same cache and ids with every wait in place


def test_bad_harness_arguments_are_refused() -> None:
    h, n = harness("LBHNC", "fp8", "cpu")
    sc = scenarios(h.B, n)["runs"]
    with pytest.raises(ValueError):
        h.run(sc, drop="compute")
    with pytest.raises(ValueError):
        h.run(sc, drop="load", race_layer=0)
