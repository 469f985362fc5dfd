"""Bulk page transfer between a :class:`PagedKV` and chunk memory objects.

A memory object is a uint8 tensor ``[num_layers, len(block_ids), page_bytes]`` (layer major, so
one layer of one chunk is one contiguous slice). One job type serves both directions: a
:class:`PageJob` pairs the engine's ``block_ids`` with such ``pages``; ``gather`` copies the pages
of ``block_ids`` for every layer into ``pages``, ``scatter`` copies ``pages`` back into
``block_ids``.

How pages move: every call resolves its jobs into one :class:`~.copy_plan.CopyPlan` (validated
before any byte moves), which moves all layers of every job with a fixed number of torch calls
whatever the number of jobs: an index call across every job's pages, through a buffer on the
engine's device where the objects are elsewhere, or one copy per run of consecutive block ids
where the runs are long (see :mod:`.copy_plan`).

On CUDA the bulk calls run on the PagedKV's dedicated stream, which first waits for the engine's
current stream (so the KV written by earlier kernels is what is copied), and return only once
every copy is complete: ``out`` may be handed to storage and ``src`` reused right away, and work
the engine queues afterwards sees the scattered pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .copy_plan import BlockIds, PageJob, plan_copies
from .page_views import PagedKV

__all__ = ["PageJob", "alloc_host", "gather", "gather_many", "gather_many_async", "scatter",
           "scatter_many"]

Jobs = Sequence[PageJob | tuple[BlockIds, torch.Tensor]]


def _run(kv: PagedKV, jobs: Jobs, to_engine: bool) -> None:
    plan = plan_copies(kv, jobs, to_engine, bulk=True)
    if kv.device.type != "cuda":
        plan.copy_all()
        return
    stream = kv.stream("load" if to_engine else "store")
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        plan.copy_all()
    stream.synchronize()


def gather_many(kv: PagedKV, jobs: Jobs) -> None:
    """``gather`` for several ``(block_ids, out)`` jobs in one call (one synchronisation)."""
    _run(kv, jobs, False)


def gather_many_async(kv: PagedKV, jobs: Jobs) -> torch.cuda.Event | None:
    """``gather_many`` without a host synchronisation (asynchronous saves).

    On CUDA the copies are queued on the store stream after the engine's current stream (so the
    KV its kernels wrote is what is copied) and the returned event completes with them: until it
    has, the caller must not read ``out`` nor let the blocks be overwritten (e.g. make the
    engine's stream wait on the event). On CPU the copy is done on return (``None``).
    """
    plan = plan_copies(kv, jobs, False, bulk=True)
    if kv.device.type != "cuda":
        plan.copy_all()
        return None
    stream = kv.stream("store")
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        plan.copy_all()
        event = torch.cuda.Event()
        event.record(stream)
    return event


def scatter_many(kv: PagedKV, jobs: Jobs) -> None:
    """``scatter`` for several ``(block_ids, src)`` jobs in one call, applied in order (a block
    two jobs name holds the later job's page)."""
    _run(kv, jobs, True)


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
