"""One copy plan per transfer call: every job resolved once, then a fixed number of torch calls per
layer (or per bulk call), whatever the number of jobs.

The connector hands a step's transfers over as many jobs, one :class:`PageJob` per chunk (16
blocks for a 256-token chunk). Moved job by job, each job costs host time per layer, and with 32
chunk jobs a layer-wise step was 1,024 Python-level copies that the engine's own kernel launches
waited behind. A :class:`CopyPlan` validates every job and resolves, once, the engine blocks of
all jobs and where each page of each memory object lies; a layer of every job (or a bulk call)
then moves along one *route*, chosen for the plan:

* **rows**: the memory objects are on the engine's device, in one storage, at whole pages from one
  another (as L1's host pool allocates them). That storage is seen as rows of one page; a layer
  of every job is one ``index_select`` and one ``index_copy_`` between the layer's pages and those
  rows, and a bulk call is the same two calls over all layers when the layers are rows of one
  buffer too (as vLLM allocates them).
* **staged**: the objects are elsewhere (pinned host memory for a CUDA cache) or in several
  storages: one index call between the layer's pages and a buffer on the engine's device, and
  one copy per object (its slab of the layer), all in one ``torch._foreach_copy_``. A layer-wise
  transfer on CUDA makes those copies on a second stream, so one layer's index kernel overlaps
  another layer's PCIe copies.
* **runs**: runs of consecutive block ids are long (whole chunks of adjacent blocks of large
  pages): one copy per run, straight between the pages and the object (no second pass over the
  bytes), all in one ``_foreach_copy_``.

Index calls move pages as the widest integer words the addresses allow (:func:`word_size`). Scatter
jobs that name the same block are applied in order (the later job's page stays): such a plan takes
one route per job, in job order. A gather whose memory objects overlap never takes the rows route.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

import torch

from .blocks import coalesce_runs
from .page_views import PagedKV, word_size, words

__all__ = ["CopyPlan", "PageJob", "plan_copies"]

BlockIds = Sequence[int] | torch.Tensor

#: Runs of consecutive block ids this many bytes long on average (per device type) move run by
#: run; shorter ones through an index. CUDA: an index kernel and one large copy beat many small
#: copies below ~1 MiB (H100/H200, benchmarks/RESULTS.md); CPU: runs skip the index route's second
#: pass over the bytes, which costs more than a copy call from ~64 KiB on (bench_host_cost).
RUN_BYTES = {"cuda": 1 << 20, "cpu": 64 << 10}


class PageJob(NamedTuple):
    """One transfer in either direction: page ``j`` of every layer of ``pages``
    ``[layers, len(block_ids), page_bytes]`` pairs with engine block ``block_ids[j]``."""

    block_ids: BlockIds
    pages: torch.Tensor


class Job(NamedTuple):
    """A validated job: its block ids as ints, and its pages."""

    ids: list[int]
    pages: torch.Tensor


def _ids(kv: PagedKV, block_ids: BlockIds, unique: bool) -> list[int]:
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else [int(b) for b in block_ids]
    if ids and not (min(ids) >= 0 and max(ids) < kv.num_blocks):
        bad = next(b for b in ids if not 0 <= b < kv.num_blocks)
        raise IndexError(f"block id {bad} out of range [0, {kv.num_blocks})")
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


def check_job(kv: PagedKV, job: PageJob | tuple[BlockIds, torch.Tensor], to_engine: bool) -> Job:
    """One job, validated (``to_engine``: a scatter, whose block ids must not repeat)."""
    block_ids, pages = job
    ids = _ids(kv, block_ids, unique=to_engine)
    _check_obj(kv, pages, len(ids), "src" if to_engine else "out")
    return Job(ids, pages)


class _Route(Protocol):
    def layer(self, layer: int, copier: torch.cuda.Stream | None) -> None:
        """Move layer ``layer`` of every job (CUDA: on the current stream; a staged route's host
        copies on ``copier`` when given)."""

    def bulk(self) -> None:
        """Move every layer of every job (CUDA: on the current stream)."""


class CopyPlan:
    """The jobs of one transfer call, resolved once into routes (see the module docstring).

    ``copy_layer`` moves one layer of every job, ``copy_all`` every layer; each is a fixed number
    of torch calls per route, and a plan has one route (one per job only when scatter jobs name
    the same block). ``jobs`` are validated (:func:`plan_copies` validates them).
    """

    def __init__(self, kv: PagedKV, jobs: list[Job], to_engine: bool) -> None:
        self.kv = kv
        self.jobs = jobs
        self.to_engine = to_engine
        self.routes = _routes(kv, jobs, to_engine)

    def without(self, dropped: Collection[int]) -> CopyPlan:
        """A plan for every job but those at the indices ``dropped``: their blocks and pages are
        neither read nor written by it."""
        return CopyPlan(self.kv, [j for i, j in enumerate(self.jobs) if i not in dropped],
                        self.to_engine)

    def copy_layer(self, layer: int, copier: torch.cuda.Stream | None = None) -> None:
        for route in self.routes:
            route.layer(layer, copier)

    def copy_all(self) -> None:
        for route in self.routes:
            route.bulk()


def plan_copies(
    kv: PagedKV, jobs: Sequence[PageJob | tuple[BlockIds, torch.Tensor]], to_engine: bool
) -> CopyPlan:
    """Validate every job (before any byte moves) and resolve them into one plan."""
    return CopyPlan(kv, [check_job(kv, job, to_engine) for job in jobs], to_engine)


def _routes(kv: PagedKV, jobs: list[Job], to_engine: bool) -> list[_Route]:
    live = [j for j in jobs if j.ids]
    if not live:
        return []
    if to_engine and len(live) > 1:
        if len(set().union(*(j.ids for j in live))) < sum(len(j.ids) for j in live):
            return [_route(kv, [j], to_engine) for j in live]  # one block, several jobs: in order
    return [_route(kv, live, to_engine)]


def _route(kv: PagedKV, jobs: list[Job], to_engine: bool) -> _Route:
    blocks = torch.tensor([b for j in jobs for b in j.ids], dtype=torch.int64)
    runs = _count_runs(blocks, [len(j.ids) for j in jobs])
    if blocks.numel() * kv.page_bytes >= RUN_BYTES.get(kv.device.type, RUN_BYTES["cuda"]) * runs:
        return _RunsRoute(kv, jobs, to_engine)
    start = _common_rows(kv, jobs, to_engine)
    if start is not None:
        return _RowsRoute(kv, jobs, blocks, to_engine, start)
    return _StagedRoute(kv, jobs, blocks, to_engine)


def _count_runs(blocks: torch.Tensor, sizes: list[int]) -> int:
    """Runs of consecutive block ids in ``blocks`` (jobs of ``sizes``), none across two jobs."""
    breaks = blocks[1:] != blocks[:-1] + 1
    breaks[torch.tensor(sizes[:-1], dtype=torch.int64).cumsum(0) - 1] = True
    return int(breaks.sum()) + 1


def _common_rows(kv: PagedKV, jobs: list[Job], to_engine: bool) -> int | None:
    """The byte from which every job's pages are whole rows of one page in one storage on the
    engine's device, or None. Each job's pages must be rows apart within a layer and its layers
    not interleaved; a gather's objects must not overlap (every row is written once)."""
    P, L = kv.page_bytes, kv.num_layers
    first = jobs[0].pages
    storage = first.untyped_storage().data_ptr()
    start = first.storage_offset() % P
    spans = []
    for job in jobs:
        p = job.pages
        n, offset, layer_stride = p.size(1), p.storage_offset(), p.stride(0)
        if (p.device != kv.device or p.untyped_storage().data_ptr() != storage
                or offset % P != start or (n > 1 and p.stride(1) != P)
                or (L > 1 and (layer_stride % P or layer_stride < n * P))):
            return None
        spans.append((offset, offset + (L - 1) * layer_stride + n * P))
    if not to_engine:
        spans.sort()
        if any(nxt[0] < prev[1] for prev, nxt in zip(spans, spans[1:])):
            return None
    return start


def _rows(t: torch.Tensor, start: int, page_bytes: int) -> torch.Tensor:
    """The storage under ``t`` from byte ``start`` on, as uint8 rows of ``page_bytes``."""
    storage = t.untyped_storage()
    rows = torch.empty(0, dtype=torch.uint8, device=t.device)
    shape = ((storage.nbytes() - start) // page_bytes, page_bytes)
    return rows.set_(storage, start, shape, (page_bytes, 1))


class _EngineRows(NamedTuple):
    """Every layer's pages as rows over the KV buffer: page (layer, block) is row
    ``first + layer * layer_step + block * block_step`` of ``rows``."""

    rows: torch.Tensor
    first: int
    layer_step: int
    block_step: int

    def index(self, layers: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return self.first + layers * self.layer_step + blocks * self.block_step


def _engine_rows(kv: PagedKV, word: int) -> _EngineRows | None:
    """The KV cache as rows of ``word``-byte words, when its layers are evenly spaced in one
    buffer (``kv.stacked``) at whole pages (vLLM's layouts, cross-layer ones too); else None."""
    st, P = kv.stacked, kv.page_bytes
    if st is None or st.stride(0) % P or st.stride(1) % P:
        return None
    start = st.storage_offset() % P
    rows = _rows(st, start, P)
    if rows.data_ptr() % word:
        return None
    return _EngineRows(words(rows, word), (st.storage_offset() - start) // P,
                       st.stride(0) // P, st.stride(1) // P)


def _on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """A host index on ``device``; on CUDA through pinned memory, without a host synchronisation,
    on the current stream (the one whose work uses it, so the allocator keeps it for that work)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class _RowsRoute:
    """Objects in one storage on the engine's device: one ``index_select`` and one ``index_copy_``
    per layer (per bulk call, with the KV cache as rows) between the pages and the storage's
    rows."""

    def __init__(self, kv: PagedKV, jobs: list[Job], blocks: torch.Tensor, to_engine: bool,
                 start: int) -> None:
        P, L, N = kv.page_bytes, kv.num_layers, blocks.numel()
        rows = _rows(jobs[0].pages, start, P)
        self.word = word_size(kv.word, rows.data_ptr())
        self.rows = words(rows, self.word)
        self.engine = kv.word_views(self.word)
        self.kv, self.to_engine, self.blocks = kv, to_engine, blocks
        # page k of job j in layer l is row first_j + l * step_j + k, the job's pages starting at
        # position before_j of the plan's blocks
        sizes = torch.tensor([len(j.ids) for j in jobs])
        first = torch.tensor([(j.pages.storage_offset() - start) // P for j in jobs])
        step = torch.tensor([j.pages.stride(0) // P for j in jobs])
        before = sizes.cumsum(0) - sizes
        rows0 = torch.arange(N) + torch.repeat_interleave(first - before, sizes)
        self.index = rows0 + torch.arange(L)[:, None] * torch.repeat_interleave(step, sizes)
        self._device: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None
        self._bulk: tuple[_EngineRows, torch.Tensor] | None = None

    def _indices(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if self._device is None:
            dev = self.kv.device
            self._device = (_on(dev, self.blocks), _on(dev, self.index).unbind(0))
        return self._device

    def layer(self, layer: int, copier: torch.cuda.Stream | None) -> None:
        blocks, rows_of = self._indices()
        self._move(self.engine[layer], blocks, rows_of[layer])

    def _move(self, engine: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        if self.to_engine:
            engine.index_copy_(0, blocks, self.rows.index_select(0, rows))
        else:
            self.rows.index_copy_(0, rows, engine.index_select(0, blocks))

    def bulk(self) -> None:
        if self._bulk is None:
            eng = _engine_rows(self.kv, self.word)
            if eng is None:
                for layer in range(self.kv.num_layers):
                    self.layer(layer, None)
                return
            layers = torch.arange(self.kv.num_layers)[:, None]
            dev = self.kv.device
            self._bulk = (eng, (_on(dev, eng.index(layers, self.blocks).flatten()),
                                _on(dev, self.index.flatten())))
        eng, (engine_rows, rows) = self._bulk
        self._move(eng.rows, engine_rows, rows)


class _StagedRoute:
    """Objects elsewhere (host memory for a CUDA cache, several storages): one index call between
    the pages and a buffer on the engine's device, and one copy per object slab, all in one
    ``_foreach_copy_``."""

    def __init__(self, kv: PagedKV, jobs: list[Job], blocks: torch.Tensor,
                 to_engine: bool) -> None:
        self.kv, self.to_engine, self.blocks = kv, to_engine, blocks
        self.word = kv.word
        self.engine = kv.word_views(self.word)
        self.sizes = [len(j.ids) for j in jobs]
        self.pages = [j.pages for j in jobs]
        self.slabs = list(zip(*(p.unbind(0) for p in self.pages), strict=True))  # [layer][job]
        self.non_blocking = kv.device.type == "cuda"
        self._device: torch.Tensor | None = None
        self._bulk: tuple[_EngineRows, torch.Tensor] | None = None

    def _blocks(self) -> torch.Tensor:
        if self._device is None:
            self._device = _on(self.kv.device, self.blocks)
        return self._device

    def layer(self, layer: int, copier: torch.cuda.Stream | None) -> None:
        engine, blocks, slabs = self.engine[layer], self._blocks(), self.slabs[layer]
        if copier is None:
            if self.to_engine:
                staged = self._staged(blocks.numel(), slabs, self.sizes)
                engine.index_copy_(0, blocks, words(staged, self.word))
            else:
                self._unstage(torch.index_select(engine, 0, blocks), slabs, self.sizes)
            return
        current = torch.cuda.current_stream(engine.device)
        if self.to_engine:
            with torch.cuda.stream(copier):
                staged = self._staged(blocks.numel(), slabs, self.sizes)
            current.wait_stream(copier)
            engine.index_copy_(0, blocks, words(staged, self.word))
            staged.record_stream(current)
        else:
            staged = torch.index_select(engine, 0, blocks)
            copier.wait_stream(current)
            with torch.cuda.stream(copier):
                self._unstage(staged, slabs, self.sizes)
            staged.record_stream(copier)

    def _staged(self, rows: int, objs: Sequence[torch.Tensor], sizes: list[int],
                shapes: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """A buffer on the engine's device filled with ``objs`` one after the other (uint8)."""
        staged = torch.empty((rows, self.kv.page_bytes), dtype=torch.uint8, device=self.kv.device)
        parts = staged.split(sizes)
        if shapes is not None:
            parts = [p.view(s) for p, s in zip(parts, shapes, strict=True)]
        torch._foreach_copy_(parts, objs, non_blocking=self.non_blocking)
        return staged

    def _unstage(self, staged: torch.Tensor, objs: Sequence[torch.Tensor], sizes: list[int],
                 shapes: list[tuple[int, ...]] | None = None) -> None:
        """``staged``'s rows (words) into ``objs``, one after the other."""
        parts = staged.view(torch.uint8).split(sizes)
        if shapes is not None:
            parts = [p.view(s) for p, s in zip(parts, shapes, strict=True)]
        torch._foreach_copy_(objs, parts, non_blocking=self.non_blocking)

    def bulk(self) -> None:
        if self._bulk is None:
            eng = _engine_rows(self.kv, self.word)
            if eng is None:
                for layer in range(self.kv.num_layers):
                    self.layer(layer, None)
                return
            self._bulk = (eng, _on(self.kv.device, self._object_order(eng)))
        eng, index = self._bulk
        L = self.kv.num_layers
        sizes = [L * n for n in self.sizes]
        shapes = [(L, n, self.kv.page_bytes) for n in self.sizes]
        if self.to_engine:
            staged = self._staged(index.numel(), self.pages, sizes, shapes)
            eng.rows.index_copy_(0, index, words(staged, self.word))
        else:
            self._unstage(torch.index_select(eng.rows, 0, index), self.pages, sizes, shapes)

    def _object_order(self, eng: _EngineRows) -> torch.Tensor:
        """The KV rows of every job's pages ``[layers, n]`` in the job's own order, job after job:
        each object's bytes are then one slice of the staging buffer."""
        L = self.kv.num_layers
        sizes = torch.tensor(self.sizes)
        per_job = sizes * L
        before = sizes.cumsum(0) - sizes  # the job's first position in the plan's blocks
        job = torch.repeat_interleave(torch.arange(len(self.sizes)), per_job)
        at = torch.arange(int(per_job.sum())) - torch.repeat_interleave(before * L, per_job)
        n = sizes[job]
        return eng.index(at // n, self.blocks[before[job] + at % n])


class _RunsRoute:
    """Long runs of consecutive block ids: one copy per run between the pages and the object, all
    in one ``_foreach_copy_`` per layer (per bulk call, through ``kv.stacked``)."""

    def __init__(self, kv: PagedKV, jobs: list[Job], to_engine: bool) -> None:
        self.kv, self.to_engine = kv, to_engine
        self.non_blocking = kv.device.type == "cuda"
        objs, spans = [], []
        for job in jobs:
            for pos, first, n in coalesce_runs(job.ids):
                objs.append(job.pages.narrow(1, pos, n))
                spans.append((first, n))
        st = kv.stacked
        #: all layers of each run ([layers, n, page]), when the layers are evenly spaced
        self.all_layers = None if st is None else (
            objs, [st.narrow(1, first, n) for first, n in spans])
        self.obj_layers = list(zip(*(o.unbind(0) for o in objs), strict=True))
        if st is not None:
            self.engine_layers = list(zip(*(e.unbind(0) for e in self.all_layers[1]),
                                          strict=True))
        else:
            self.engine_layers = [tuple(v.narrow(0, f, n) for f, n in spans) for v in kv.views]

    def _move(self, objs: Sequence[torch.Tensor], engine: Sequence[torch.Tensor]) -> None:
        dst, src = (engine, objs) if self.to_engine else (objs, engine)
        torch._foreach_copy_(dst, src, non_blocking=self.non_blocking)

    def layer(self, layer: int, copier: torch.cuda.Stream | None) -> None:
        self._move(self.obj_layers[layer], self.engine_layers[layer])

    def bulk(self) -> None:
        if self.all_layers is None:
            for layer in range(self.kv.num_layers):
                self.layer(layer, None)
        else:
            self._move(*self.all_layers)
