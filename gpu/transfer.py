"""Bulk page transfer between a :class:`PagedKV` and chunk memory objects.

A memory object is a uint8 tensor ``[num_layers, len(block_ids), page_bytes]`` (layer major, so
one layer of one chunk is one contiguous slice). ``gather`` copies the pages of ``block_ids`` for
every layer into it; ``scatter`` copies it back into ``block_ids``.

How pages move (chosen per job from the block ids, measured on CPU, see
benchmarks/bench_gpu_transfer.py): runs of consecutive block ids are coalesced into slices. When
the layers are evenly spaced in one buffer (``PagedKV.stacked``, as vLLM allocates them), a run
of all layers moves with one strided ``copy_`` (CPU), so a random 32-block request costs 32 calls,
not 32 per layer. Otherwise each run moves with one ``copy_`` per layer; on CPU a gather made
mostly of single blocks then uses one ``index_select`` per layer. A CPU scatter never uses
``index_copy_`` (about 1 GB/s on CPU). On CUDA, jobs whose runs are short are staged:
``index_select`` into a device buffer and one large copy to the host (and the reverse for
scatter), so the PCIe transfer is one large memcpy; long runs are copied directly.

On CUDA the bulk calls run on the PagedKV's dedicated stream, which first waits for the engine's
current stream (so the KV written by earlier kernels is what is copied), and return only once
every copy is complete: ``out`` may be handed to storage and ``src`` reused right away, and work
the engine queues afterwards sees the scattered pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .blocks import coalesce_runs
from .page_views import PagedKV

__all__ = ["alloc_host", "gather", "gather_many", "scatter", "scatter_many"]

BlockIds = Sequence[int] | torch.Tensor

#: CUDA: stage through a device buffer when a job's runs average fewer bytes than this.
CUDA_STAGE_BELOW_BYTES = 1 << 20


@dataclass
class Plan:
    """One job's block ids, prepared once and reused for every layer."""

    ids: list[int]
    runs: list[tuple[int, int, int]]
    use_index: bool
    _index: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def index(self, device: torch.device) -> torch.Tensor:
        """The block ids as an int64 tensor on ``device`` (built once per device)."""
        idx = self._index.get(device)
        if idx is None:
            idx = torch.tensor(self.ids, dtype=torch.int64).to(device)
            self._index[device] = idx
        return idx


def _ids(kv: PagedKV, block_ids: BlockIds, unique: bool) -> list[int]:
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else [int(b) for b in block_ids]
    for b in ids:
        if not 0 <= b < kv.num_blocks:
            raise IndexError(f"block id {b} out of range [0, {kv.num_blocks})")
    if unique and len(set(ids)) != len(ids):
        dup = sorted(b for b, c in Counter(ids).items() if c > 1)
        raise ValueError(f"block ids {dup} repeat within one scatter job; each is written once")
    return ids


def _check_obj(kv: PagedKV, obj: torch.Tensor, n: int, what: str) -> None:
    want = (kv.num_layers, n, kv.page_bytes)
    if obj.dtype != torch.uint8 or tuple(obj.shape) != want:
        raise ValueError(
            f"{what} must be a uint8 tensor of shape {list(want)} [layers, blocks, page bytes], "
            f"got {obj.dtype} {list(obj.shape)}"
        )
    if n and obj.stride(2) != 1:
        raise ValueError(f"{what}'s page dimension must be contiguous, strides {obj.stride()}")
    if kv.device.type != "cuda" and obj.device != kv.device:
        raise ValueError(f"{what} is on {obj.device}, the KV cache on {kv.device}")
    if obj.device.type == "cuda" and obj.device != kv.device:
        raise ValueError(f"{what} is on {obj.device}, the KV cache on {kv.device}")


def make_plan(
    kv: PagedKV, block_ids: BlockIds, obj: torch.Tensor, gather_dir: bool
) -> Plan:
    """Validate one job and choose how its pages move."""
    ids = _ids(kv, block_ids, unique=not gather_dir)
    _check_obj(kv, obj, len(ids), "out" if gather_dir else "src")
    runs = coalesce_runs(ids)
    if kv.device.type == "cuda":
        use_index = bool(ids) and len(ids) * kv.page_bytes < CUDA_STAGE_BELOW_BYTES * len(runs)
    else:
        use_index = gather_dir and 2 * len(runs) > len(ids)
    return Plan(ids, runs, use_index)


def gather_layer(kv: PagedKV, layer: int, plan: Plan, out: torch.Tensor) -> None:
    """Copy layer ``layer``'s pages of ``plan`` into ``out[layer]`` (on the current stream)."""
    view, dst = kv.views[layer], out[layer]
    if not plan.ids:
        return
    nb = dst.device.type == "cpu" and view.device.type == "cuda"
    if plan.use_index:
        idx = plan.index(view.device)
        if dst.device == view.device and dst.is_contiguous():
            torch.index_select(view, 0, idx, out=dst)
        else:
            dst.copy_(torch.index_select(view, 0, idx), non_blocking=nb)
        return
    for pos, first, length in plan.runs:
        dst[pos : pos + length].copy_(view[first : first + length], non_blocking=nb)


def scatter_layer(kv: PagedKV, layer: int, plan: Plan, src: torch.Tensor) -> None:
    """Copy ``src[layer]`` into layer ``layer``'s pages of ``plan`` (on the current stream)."""
    view, s = kv.views[layer], src[layer]
    if not plan.ids:
        return
    nb = s.device.type == "cpu" and view.device.type == "cuda"
    if plan.use_index:
        staged = s.to(view.device, non_blocking=nb)
        view.index_copy_(0, plan.index(view.device), staged)
        return
    for pos, first, length in plan.runs:
        view[first : first + length].copy_(s[pos : pos + length], non_blocking=nb)


def _gather_all(kv: PagedKV, plan: Plan, out: torch.Tensor) -> None:
    """All layers of one job; through ``kv.stacked`` (all layers per call) where possible."""
    st = kv.stacked
    if st is not None and plan.ids:
        if kv.device.type == "cpu":
            for pos, first, length in plan.runs:
                out[:, pos : pos + length].copy_(st[:, first : first + length])
            return
        if plan.use_index:  # CUDA: one gather kernel, then one large copy
            idx = plan.index(kv.device)
            if out.device == kv.device and out.is_contiguous():
                torch.index_select(st, 1, idx, out=out)
            else:
                out.copy_(torch.index_select(st, 1, idx), non_blocking=out.device.type == "cpu")
            return
    for layer in range(kv.num_layers):
        gather_layer(kv, layer, plan, out)


def _scatter_all(kv: PagedKV, plan: Plan, src: torch.Tensor) -> None:
    """All layers of one job; through ``kv.stacked`` (all layers per call) where possible."""
    st = kv.stacked
    if st is not None and plan.ids:
        if kv.device.type == "cpu":
            for pos, first, length in plan.runs:
                st[:, first : first + length].copy_(src[:, pos : pos + length])
            return
        if plan.use_index:  # CUDA: one large copy, then one scatter kernel
            staged = src.to(kv.device, non_blocking=src.device.type == "cpu")
            st.index_copy_(1, plan.index(kv.device), staged)
            return
    for layer in range(kv.num_layers):
        scatter_layer(kv, layer, plan, src)


def _run(kv: PagedKV, role: str, fn, pairs: list[tuple[Plan, torch.Tensor]]) -> None:
    if kv.device.type != "cuda":
        for plan, obj in pairs:
            fn(kv, plan, obj)
        return
    stream = kv.stream(role)
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        for plan, obj in pairs:
            fn(kv, plan, obj)
    stream.synchronize()


def gather_many(kv: PagedKV, jobs: Sequence[tuple[BlockIds, torch.Tensor]]) -> None:
    """``gather`` for several ``(block_ids, out)`` jobs in one call (one synchronisation)."""
    pairs = [(make_plan(kv, ids, out, True), out) for ids, out in jobs]
    _run(kv, "store", _gather_all, pairs)


def scatter_many(kv: PagedKV, jobs: Sequence[tuple[torch.Tensor, BlockIds]]) -> None:
    """``scatter`` for several ``(src, block_ids)`` jobs in one call, applied in order."""
    pairs = [(make_plan(kv, ids, src, False), src) for src, ids in jobs]
    _run(kv, "load", _scatter_all, pairs)


def gather(kv: PagedKV, block_ids: BlockIds, out: torch.Tensor) -> None:
    """Copy the pages of ``block_ids`` of every layer into ``out`` ``[layers, blocks, page]``.

    Block ids may repeat and come in any order; ``out[l, j]`` is layer ``l``'s page of
    ``block_ids[j]``. Returns when ``out`` holds the bytes.
    """
    gather_many(kv, [(block_ids, out)])


def scatter(kv: PagedKV, src: torch.Tensor, block_ids: BlockIds) -> None:
    """Copy ``src`` ``[layers, blocks, page]`` into the pages of ``block_ids`` of every layer.

    Block ids must not repeat within one call (``ValueError``). Pages not named are untouched.
    Returns when the pages are in place.
    """
    scatter_many(kv, [(src, block_ids)])


def alloc_host(kv: PagedKV, num_blocks: int, pin: bool | None = None) -> torch.Tensor:
    """An empty host memory object for ``num_blocks`` pages; pinned by default on CUDA.

    Non-pinned host memory works too, but CUDA then copies synchronously and slower.
    """
    if pin is None:
        pin = kv.device.type == "cuda"
    return torch.empty(
        (kv.num_layers, num_blocks, kv.page_bytes), dtype=torch.uint8, pin_memory=pin
    )
