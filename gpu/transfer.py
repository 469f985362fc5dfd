"""Bulk page transfer between a :class:`PagedKV` and chunk memory objects.

A memory object is a uint8 tensor ``[num_layers, len(block_ids), page_bytes]`` (layer major, so
one layer of one chunk is one contiguous slice). One job type serves both directions: a
:class:`PageJob` pairs the engine's ``block_ids`` with such ``pages``; ``gather`` copies the pages
of ``block_ids`` for every layer into ``pages``, ``scatter`` copies ``pages`` back into
``block_ids``.

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
from typing import NamedTuple

import torch

from .blocks import coalesce_runs
from .page_views import PagedKV

__all__ = ["PageJob", "alloc_host", "gather", "gather_many", "gather_many_async", "scatter",
           "scatter_many"]

BlockIds = Sequence[int] | torch.Tensor

#: CUDA: stage through a device buffer when a job's runs average fewer bytes than this.
CUDA_STAGE_BELOW_BYTES = 1 << 20


class PageJob(NamedTuple):
    """One transfer in either direction: page ``j`` of every layer of ``pages``
    ``[layers, len(block_ids), page_bytes]`` pairs with engine block ``block_ids[j]``."""

    block_ids: BlockIds
    pages: torch.Tensor


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
            idx = torch.tensor(self.ids, dtype=torch.int64)
            if device.type == "cuda":  # pinned + non_blocking: no host synchronisation
                idx = idx.pin_memory().to(device, non_blocking=True)
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


def make_plan(kv: PagedKV, job: PageJob, to_engine: bool) -> Plan:
    """Validate one job and choose how its pages move (``to_engine``: a scatter)."""
    ids = _ids(kv, job.block_ids, unique=to_engine)
    _check_obj(kv, job.pages, len(ids), "src" if to_engine else "out")
    runs = coalesce_runs(ids)
    if kv.device.type == "cuda":
        use_index = bool(ids) and len(ids) * kv.page_bytes < CUDA_STAGE_BELOW_BYTES * len(runs)
    else:
        use_index = not to_engine and 2 * len(runs) > len(ids)
    return Plan(ids, runs, use_index)


def plan_jobs(
    kv: PagedKV, jobs: Sequence[PageJob | tuple[BlockIds, torch.Tensor]], to_engine: bool
) -> list[tuple[Plan, torch.Tensor]]:
    """Validate every job (before any byte moves) and pair its plan with its pages."""
    out = []
    for job in jobs:
        job = PageJob(*job)
        out.append((make_plan(kv, job, to_engine), job.pages))
    return out


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` (uint8 pages) viewed as 8-byte words where its strides allow, else ``t``: the index
    kernels move one element per thread, and bytes made them ~20% slower than one memcpy of the
    same size on an H100 (benchmarks/bench_gpu_harness.py, RESULTS.md)."""
    if t.shape[-1] % 8 or t.stride(-1) != 1 or t.storage_offset() % 8 or t.data_ptr() % 8:
        return t
    if any(st % 8 for st, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1):
        return t
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return t


def _copy(engine: torch.Tensor, dim: int, plan: Plan, pages: torch.Tensor, to_engine: bool,
          nb: bool, copier: torch.cuda.Stream | None = None) -> None:
    """Move ``plan``'s pages between ``engine`` (blocks along ``dim``) and ``pages``.

    ``copier`` (CUDA, staged jobs with host ``pages``): the host copy runs on this second stream,
    so one layer's index kernel overlaps another layer's PCIe copy (layer-wise transfers)."""
    if plan.use_index:
        idx = plan.index(engine.device)
        wide_engine, wide_pages = _wide(engine), _wide(pages)
        if wide_engine.dtype == wide_pages.dtype:  # both or neither
            engine, pages = wide_engine, wide_pages
        if copier is not None and pages.device.type == "cpu":
            _staged_two_streams(engine, dim, idx, pages, to_engine, copier)
        elif to_engine:
            engine.index_copy_(dim, idx, pages.to(engine.device, non_blocking=nb))
        elif pages.device == engine.device and pages.is_contiguous():
            torch.index_select(engine, dim, idx, out=pages)
        else:
            pages.copy_(torch.index_select(engine, dim, idx), non_blocking=nb)
        return
    for pos, first, length in plan.runs:
        blocks, mine = engine.narrow(dim, first, length), pages.narrow(dim, pos, length)
        if to_engine:
            blocks.copy_(mine, non_blocking=nb)
        else:
            mine.copy_(blocks, non_blocking=nb)


def _staged_two_streams(engine: torch.Tensor, dim: int, idx: torch.Tensor, pages: torch.Tensor,
                        to_engine: bool, copier: torch.cuda.Stream) -> None:
    """A staged job whose host copy runs on ``copier``: the current stream runs the index kernel
    and is ordered after the copy (scatter) or before it (gather, then the caller orders its
    completion after ``copier``)."""
    current = torch.cuda.current_stream(engine.device)
    if to_engine:
        with torch.cuda.stream(copier):
            staged = torch.empty(pages.shape, dtype=pages.dtype, device=engine.device)
            staged.copy_(pages, non_blocking=True)
        current.wait_stream(copier)
        engine.index_copy_(dim, idx, staged)
        staged.record_stream(current)
    else:
        staged = torch.index_select(engine, dim, idx)
        copier.wait_stream(current)
        with torch.cuda.stream(copier):
            pages.copy_(staged, non_blocking=True)
        staged.record_stream(copier)


def copy_layer(kv: PagedKV, layer: int, plan: Plan, pages: torch.Tensor, to_engine: bool,
               copier: torch.cuda.Stream | None = None) -> None:
    """Move layer ``layer``'s pages of ``plan`` (on the current stream; the host copies of staged
    jobs on ``copier`` when given)."""
    view, mine = kv.views[layer], pages[layer]
    if plan.ids:
        nb = mine.device.type == "cpu" and view.device.type == "cuda"
        _copy(view, 0, plan, mine, to_engine, nb, copier)


def _copy_all(kv: PagedKV, plan: Plan, pages: torch.Tensor, to_engine: bool) -> None:
    """All layers of one job; through ``kv.stacked`` (all layers per call) where possible: runs
    on CPU, one index kernel and one large copy on CUDA."""
    st = kv.stacked
    if st is not None and plan.ids:
        if kv.device.type == "cpu":
            _copy(st, 1, Plan(plan.ids, plan.runs, False), pages, to_engine, False)
            return
        if plan.use_index:
            _copy(st, 1, plan, pages, to_engine, pages.device.type == "cpu")
            return
    for layer in range(kv.num_layers):
        copy_layer(kv, layer, plan, pages, to_engine)


def _run(kv: PagedKV, pairs: list[tuple[Plan, torch.Tensor]], to_engine: bool) -> None:
    if kv.device.type != "cuda":
        for plan, pages in pairs:
            _copy_all(kv, plan, pages, to_engine)
        return
    stream = kv.stream("load" if to_engine else "store")
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        for plan, pages in pairs:
            _copy_all(kv, plan, pages, to_engine)
    stream.synchronize()


def gather_many(kv: PagedKV, jobs: Sequence[PageJob | tuple[BlockIds, torch.Tensor]]) -> None:
    """``gather`` for several ``(block_ids, out)`` jobs in one call (one synchronisation)."""
    _run(kv, plan_jobs(kv, jobs, False), False)


def gather_many_async(
    kv: PagedKV, jobs: Sequence[PageJob | tuple[BlockIds, torch.Tensor]]
) -> torch.cuda.Event | None:
    """``gather_many`` without a host synchronisation (asynchronous saves).

    On CUDA the copies are queued on the store stream after the engine's current stream (so the
    KV its kernels wrote is what is copied) and the returned event completes with them: until it
    has, the caller must not read ``out`` nor let the blocks be overwritten (e.g. make the
    engine's stream wait on the event). On CPU the copy is done on return (``None``).
    """
    pairs = plan_jobs(kv, jobs, False)
    if kv.device.type != "cuda":
        _run(kv, pairs, False)
        return None
    stream = kv.stream("store")
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        for plan, pages in pairs:
            _copy_all(kv, plan, pages, False)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def scatter_many(kv: PagedKV, jobs: Sequence[PageJob | tuple[BlockIds, torch.Tensor]]) -> None:
    """``scatter`` for several ``(block_ids, src)`` jobs in one call, applied in order."""
    _run(kv, plan_jobs(kv, jobs, True), True)


def gather(kv: PagedKV, block_ids: BlockIds, out: torch.Tensor) -> None:
    """Copy the pages of ``block_ids`` of every layer into ``out`` ``[layers, blocks, page]``.

    Block ids may repeat and come in any order; ``out[l, j]`` is layer ``l``'s page of
    ``block_ids[j]``. Returns when ``out`` holds the bytes.
    """
    gather_many(kv, [PageJob(block_ids, out)])


def scatter(kv: PagedKV, src: torch.Tensor, block_ids: BlockIds) -> None:
    """Copy ``src`` ``[layers, blocks, page]`` into the pages of ``block_ids`` of every layer.

    Block ids must not repeat within one call (``ValueError``). Pages not named are untouched.
    Returns when the pages are in place.
    """
    scatter_many(kv, [PageJob(block_ids, src)])


def alloc_host(kv: PagedKV, num_blocks: int, pin: bool | None = None) -> torch.Tensor:
    """An empty host memory object for ``num_blocks`` pages; pinned by default on CUDA.

    Non-pinned host memory works too, but CUDA then copies synchronously and slower.
    """
    if pin is None:
        pin = kv.device.type == "cuda"
    return torch.empty(
        (kv.num_layers, num_blocks, kv.page_bytes), dtype=torch.uint8, pin_memory=pin
    )
