"""One copy plan per transfer call: every job resolved once, then a fixed number of torch calls per
layer (or per bulk call), whatever the number of jobs.

The connector hands a step's transfers over as many jobs, one :class:`PageJob` per chunk (16
blocks for a 256-token chunk). Moved job by job, each job costs host time per layer, and with 32
chunk jobs a layer-wise step was 1,024 Python-level copies that the engine's own kernel launches
waited behind. A :class:`CopyPlan` validates every job and resolves, once, the engine blocks of
all jobs and where each page of each memory object lies; a layer of every job (or a bulk call)
then moves along one *route*, chosen for the plan (one of four):

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
* **runs**: runs of consecutive block ids are long (whole chunks of adjacent blocks, or large
  pages): one copy per run, straight between the pages and the object (no second pass over the
  bytes), all in one ``_foreach_copy_``.
* **index**: a CPU layer-wise gather of such long runs: per job, one ``index_select`` straight
  into its slab (one call per job, which the bytes of pages this large dwarf).

Index calls move pages as the widest integer words the addresses allow (:func:`word_size`). Scatter
jobs that name the same block are applied in order (the later job's page stays): such a plan takes
one route per job, in job order. A gather whose memory objects overlap never takes the rows route.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from itertools import chain
from typing import NamedTuple, Protocol

import torch

from .blocks import coalesce_runs
from .page_views import PagedKV, word_size, words

__all__ = ["CopyPlan", "PageJob", "plan_copies"]

BlockIds = Sequence[int] | torch.Tensor

#: Runs of consecutive block ids this many bytes long on average (per device type) move run by
#: run; shorter ones through an index. CUDA: the per-job code's threshold (an index kernel and one
#: large copy below it; its H100/H200 figures in benchmarks/RESULTS.md). CPU: a run copied
#: straight skips the index route's second pass over its bytes, which costs more than the copy
#: call from ~16 KiB on (benchmarks/bench_host_cost.py).
RUN_BYTES = {"cuda": 1 << 20, "cpu": 16 << 10}


class PageJob(NamedTuple):
    """One transfer in either direction: page ``j`` of every layer of ``pages``
    ``[layers, len(block_ids), page_bytes]`` pairs with engine block ``block_ids[j]``."""

    block_ids: BlockIds
    pages: torch.Tensor


class Job(NamedTuple):
    """A validated job: its block ids as ints, its pages, and where they lie (bytes: the first
    page's offset in its storage, the strides between layers and between pages)."""

    ids: list[int]
    pages: torch.Tensor
    offset: int
    layer_stride: int
    page_stride: int


def _int64(values: Iterable[int]) -> torch.Tensor:
    """A host int64 tensor of ``values`` (through an array: a quarter of ``torch.tensor``'s time)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _ids(block_ids: BlockIds, unique: bool) -> list[int]:
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(map(int, block_ids))
    if unique and len(set(ids)) != len(ids):
        dup = sorted(b for b, c in Counter(ids).items() if c > 1)
        raise ValueError(f"block ids {dup} repeat within one scatter job; each is written once")
    return ids


def _check_obj(kv: PagedKV, obj: torch.Tensor, n: int, what: str) -> None:
    want = (kv.num_layers, n, kv.page_bytes)
    if obj.dtype != torch.uint8 or obj.shape != want:
        raise ValueError(
            f"{what} must be a uint8 tensor of shape {list(want)} [layers, blocks, page bytes], "
            f"got {obj.dtype} {list(obj.shape)}"
        )
    if n and obj.stride(2) != 1:
        raise ValueError(f"{what}'s page dimension must be contiguous, strides {obj.stride()}")
    device = obj.device
    if device != kv.device and (kv.device.type != "cuda" or device.type == "cuda"):
        raise ValueError(f"{what} is on {device}, the KV cache on {kv.device}")


def _check_job(kv: PagedKV, job: PageJob | tuple[BlockIds, torch.Tensor], to_engine: bool) -> Job:
    """One job, validated but for the range of its block ids (``to_engine``: a scatter, whose
    block ids must not repeat)."""
    block_ids, pages = job
    ids = _ids(block_ids, unique=to_engine)
    _check_obj(kv, pages, len(ids), "src" if to_engine else "out")
    layer_stride, page_stride, _ = pages.stride()
    return Job(ids, pages, pages.storage_offset(), layer_stride, page_stride)


class _Route(Protocol):
    name: str  # "rows", "staged", "runs" or "index"

    def layer(self, layer: int, copier: torch.cuda.Stream | None) -> None:
        """Move layer ``layer`` of every job (CUDA: on the current stream; a staged route's host
        copies on ``copier`` when given)."""

    def bulk(self) -> None:
        """Move every layer of every job (CUDA: on the current stream)."""


class CopyPlan:
    """The jobs of one transfer call, resolved once into routes (see the module docstring).

    ``copy_layer`` moves one layer of every job, ``copy_all`` every layer; each is a fixed number
    of torch calls per route, and a plan has one route (one per job only when scatter jobs name
    the same block). ``jobs`` are validated (:func:`plan_copies` validates them); ``bulk``: the
    plan moves all layers at once (``copy_all``), which makes runs of blocks longer per copy.
    """

    def __init__(self, kv: PagedKV, jobs: list[Job], to_engine: bool, bulk: bool) -> None:
        self.kv = kv
        self.jobs = jobs
        self.to_engine = to_engine
        self.bulk = bulk
        self.routes = _routes(kv, jobs, to_engine, bulk)

    def without(self, dropped: Collection[int]) -> CopyPlan:
        """A plan for every job but those at the indices ``dropped``: their blocks and pages are
        neither read nor written by it."""
        return CopyPlan(self.kv, [j for i, j in enumerate(self.jobs) if i not in dropped],
                        self.to_engine, self.bulk)

    def copy_layer(self, layer: int, copier: torch.cuda.Stream | None = None) -> None:
        for route in self.routes:
            route.layer(layer, copier)

    def copy_all(self) -> None:
        for route in self.routes:
            route.bulk()


def plan_copies(kv: PagedKV, jobs: Sequence[PageJob | tuple[BlockIds, torch.Tensor]],
                to_engine: bool, bulk: bool = False) -> CopyPlan:
    """Validate every job (before any byte moves) and resolve them into one plan."""
    checked = [_check_job(kv, job, to_engine) for job in jobs]
    ids = list(chain.from_iterable(j.ids for j in checked))
    if ids and not (min(ids) >= 0 and max(ids) < kv.num_blocks):
        bad = next(b for b in ids if not 0 <= b < kv.num_blocks)
        raise IndexError(f"block id {bad} out of range [0, {kv.num_blocks})")
    return CopyPlan(kv, checked, to_engine, bulk)


def _routes(kv: PagedKV, jobs: list[Job], to_engine: bool, bulk: bool) -> list[_Route]:
    live = [j for j in jobs if j.ids]
    if not live:
        return []
    if to_engine and len(live) > 1:
        if len(set().union(*(j.ids for j in live))) < sum(len(j.ids) for j in live):
            return [_route(kv, [j], to_engine, bulk) for j in live]  # one block, two jobs: in order
    return [_route(kv, live, to_engine, bulk)]


def _route(kv: PagedKV, jobs: list[Job], to_engine: bool, bulk: bool) -> _Route:
    ids = list(chain.from_iterable(j.ids for j in jobs))
    per_run = kv.page_bytes * (kv.num_layers if bulk and _all_layers(kv) else 1)
    long_run = RUN_BYTES.get(kv.device.type, RUN_BYTES["cuda"])
    # A bulk call on CUDA moves every layer: staged, one copy per object (a chunk's whole
    # [layers, blocks, page] slab) beats a copy per run and layer (measured on an H200: 16 chunk
    # jobs of 64 KiB pages, 0.69-0.82x a pinned memcpy with a copy per run and layer)
    per_layer_runs = bulk and kv.device.type == "cuda"
    if not per_layer_runs and len(ids) * per_run >= long_run * len(jobs):  # (runs stay in a job)
        runs = [coalesce_runs(j.ids) for j in jobs]
        if len(ids) * per_run >= long_run * sum(map(len, runs)):
            if not (to_engine or bulk or kv.device.type == "cuda"):
                return _JobIndexRoute(kv, jobs)
            return _RunsRoute(kv, jobs, runs, to_engine, bulk)
    blocks = _int64(ids)
    start = _common_rows(kv, jobs)
    if start is not None:
        rows = _RowsRoute(kv, jobs, blocks, to_engine, start)
        if to_engine or rows.each_row_once():
            return rows
    return _StagedRoute(kv, jobs, blocks, to_engine)


def _all_layers(kv: PagedKV) -> bool:
    """Whether one copy may move a run of blocks of every layer: on CPU, through ``kv.stacked``.
    (On CUDA such a strided copy to host memory would be staged by torch and could synchronise.)"""
    return kv.stacked is not None and kv.device.type != "cuda"


def _common_rows(kv: PagedKV, jobs: list[Job]) -> int | None:
    """The byte from which every job's pages are whole rows of one page in one storage on the
    engine's device, or None. Each job's pages must be rows apart within a layer and its layers
    not interleaved."""
    P, L = kv.page_bytes, kv.num_layers
    first = jobs[0].pages
    if first.device != kv.device:
        return None
    storage = first.untyped_storage().data_ptr()
    start = jobs[0].offset % P
    for job in jobs:
        n, layer_stride = len(job.ids), job.layer_stride
        if (job.offset % P != start or (n > 1 and job.page_stride != P)
                or (L > 1 and (layer_stride % P or layer_stride < n * P))
                or job.pages.untyped_storage().data_ptr() != storage):
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
    if rows.data_ptr() % word or start % word:
        return None
    return _EngineRows(words(rows, word), (st.storage_offset() - start) // P,
                       st.stride(0) // P, st.stride(1) // P)


def _engine_rows_or_each_layer(route: _Route, kv: PagedKV, word: int) -> _EngineRows | None:
    """The engine's rows for one bulk copy of ``route`` (:func:`_engine_rows`), or ``None`` once
    ``route`` has copied layer by layer where no word view covers the KV."""
    eng = _engine_rows(kv, word)
    if eng is None:
        for layer in range(kv.num_layers):
            route.layer(layer, None)
    return eng


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

    name = "rows"

    def __init__(self, kv: PagedKV, jobs: list[Job], blocks: torch.Tensor, to_engine: bool,
                 start: int) -> None:
        P, L = kv.page_bytes, kv.num_layers
        rows = _rows(jobs[0].pages, start, P)
        self.word = word_size(kv.word, rows.data_ptr(), start)
        self.rows = words(rows, self.word)
        self.engine = kv.word_views(self.word)
        self.kv, self.to_engine, self.blocks = kv, to_engine, blocks
        # page k of job j in layer l is row first_j + k + l * step_j (the job's pages start at
        # row first_j, its layers step_j rows apart)
        first = [(j.offset - start) // P for j in jobs]
        step = [j.layer_stride // P if L > 1 else 0 for j in jobs]
        rows0 = _int64(chain.from_iterable(
            range(f, f + len(j.ids)) for f, j in zip(first, jobs, strict=True)))
        layers = torch.arange(L)[:, None]
        if len(set(step)) == 1:
            self.index = rows0 + layers * step[0]
        else:
            steps = chain.from_iterable([s] * len(j.ids) for s, j in zip(step, jobs, strict=True))
            self.index = rows0 + layers * _int64(steps)
        self._spans = [(j.offset, j.offset + (L - 1) * j.layer_stride + len(j.ids) * P)
                       for j in jobs]
        self._device: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None
        self._bulk: tuple[_EngineRows, tuple[torch.Tensor, torch.Tensor]] | None = None

    def each_row_once(self) -> bool:
        """Whether no two pages of the plan are one row, so one ``index_copy_`` writes each
        once (a gather's objects): their extents apart, else (slices of one object) every row
        distinct."""
        spans = sorted(self._spans)
        if all(nxt[0] >= prev[1] for prev, nxt in zip(spans, spans[1:])):
            return True
        return self.index.unique().numel() == self.index.numel()

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
            eng = _engine_rows_or_each_layer(self, self.kv, self.word)
            if eng is None:
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

    name = "staged"

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
                staged = self._buffer(blocks.numel())
                self._copy(staged.split(self.sizes), slabs)
                engine.index_copy_(0, blocks, words(staged, self.word))
            else:
                staged = torch.index_select(engine, 0, blocks).view(torch.uint8)
                self._copy(slabs, staged.split(self.sizes))
            return
        current = torch.cuda.current_stream(engine.device)
        if self.to_engine:
            with torch.cuda.stream(copier):
                staged = self._buffer(blocks.numel())
                self._copy(staged.split(self.sizes), slabs)
            current.wait_stream(copier)
            engine.index_copy_(0, blocks, words(staged, self.word))
            staged.record_stream(current)
        else:
            staged = torch.index_select(engine, 0, blocks).view(torch.uint8)
            copier.wait_stream(current)
            with torch.cuda.stream(copier):
                self._copy(slabs, staged.split(self.sizes))
            staged.record_stream(copier)

    def _buffer(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self.kv.page_bytes), dtype=torch.uint8, device=self.kv.device)

    def _copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(dst, src, non_blocking=self.non_blocking)

    def bulk(self) -> None:
        if self._bulk is None:
            eng = _engine_rows_or_each_layer(self, self.kv, self.word)
            if eng is None:
                return
            self._bulk = (eng, _on(self.kv.device, self._object_order(eng)))
        eng, index = self._bulk
        if self.to_engine:
            staged = self._buffer(index.numel())
            self._copy(*self._whole(staged)[::-1])
            eng.rows.index_copy_(0, index, words(staged, self.word))
        else:
            staged = torch.index_select(eng.rows, 0, index).view(torch.uint8)
            self._copy(*self._whole(staged))

    def _whole(self, staged: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each object and its part of ``staged`` (all its pages, job after job); an object that
        is not one dense block goes layer by layer (a host copy of it would be staged by torch,
        and on CUDA synchronously)."""
        objs: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        L = self.kv.num_layers
        for pages, part in zip(self.pages, staged.split([L * n for n in self.sizes]), strict=True):
            part = part.view(pages.shape)
            if pages.is_contiguous():
                objs.append(pages)
                parts.append(part)
            else:
                objs += pages.unbind(0)
                parts += part.unbind(0)
        return objs, parts

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
    in one ``_foreach_copy_`` per layer (per bulk call on CPU, through ``kv.stacked``)."""

    name = "runs"

    def __init__(self, kv: PagedKV, jobs: list[Job], runs: list[list[tuple[int, int, int]]],
                 to_engine: bool, bulk: bool) -> None:
        self.kv, self.to_engine = kv, to_engine
        self.non_blocking = kv.device.type == "cuda"
        self.objs: list[torch.Tensor] = []  # every run's pages, all layers: [layers, n, page]
        self.spans: list[tuple[int, int]] = []  # its first block and length
        for job, job_runs in zip(jobs, runs, strict=True):
            for pos, first, n in job_runs:
                self.objs.append(job.pages.narrow(1, pos, n))
                self.spans.append((first, n))
        #: the same runs of the KV cache, all layers ([layers, n, page]), where one copy may
        #: move them (:func:`_all_layers`)
        self.engine = ([kv.stacked.narrow(1, f, n) for f, n in self.spans]  # type: ignore[union-attr]
                       if _all_layers(kv) else None)
        self._layers: tuple[list, list] | None = None
        if not (bulk and self.engine is not None):
            self._by_layer()  # a layer-wise plan: every step only copies

    def _by_layer(self) -> tuple[list, list]:
        """Each run's slice of each layer, objects and KV cache: ``[layer][run]``."""
        if self._layers is None:
            objs = list(zip(*(o.unbind(0) for o in self.objs), strict=True))
            st = self.kv.stacked
            if st is not None:
                engine = list(zip(*(st.narrow(1, f, n).unbind(0) for f, n in self.spans),
                                  strict=True))
            else:
                engine = [tuple(v.narrow(0, f, n) for f, n in self.spans) for v in self.kv.views]
            self._layers = (objs, engine)
        return self._layers

    def _move(self, objs: Sequence[torch.Tensor], engine: Sequence[torch.Tensor]) -> None:
        dst, src = (engine, objs) if self.to_engine else (objs, engine)
        torch._foreach_copy_(dst, src, non_blocking=self.non_blocking)

    def layer(self, layer: int, copier: torch.cuda.Stream | None) -> None:
        objs, engine = self._by_layer()
        self._move(objs[layer], engine[layer])

    def bulk(self) -> None:
        if self.engine is None:
            for layer in range(self.kv.num_layers):
                self.layer(layer, None)
        else:
            self._move(self.objs, self.engine)


class _JobIndexRoute:
    """A CPU layer-wise gather of long runs (large pages): per job, one ``index_select`` straight
    into its slab of the layer, page by page at memcpy speed in one pass over the bytes. The
    bytes dwarf one call per job here; a copy per run ran ~2x slower for single-block runs of
    64 KiB pages, and its views (one per run and layer) cost more to build."""

    name = "index"

    def __init__(self, kv: PagedKV, jobs: list[Job]) -> None:
        self.kv = kv
        self.word = word_size(kv.word, *(x for j in jobs
                                          for x in (j.pages.data_ptr(), j.layer_stride,
                                                    j.page_stride)))
        self.engine = kv.word_views(self.word)
        self.blocks = _int64(chain.from_iterable(j.ids for j in jobs)).split(
            [len(j.ids) for j in jobs])
        #: each job's slab of each layer, as words: ``[layer][job]``
        self.slabs = list(zip(*(words(j.pages, self.word).unbind(0) for j in jobs), strict=True))

    def layer(self, layer: int, copier: torch.cuda.Stream | None) -> None:
        engine = self.engine[layer]
        for blocks, slab in zip(self.blocks, self.slabs[layer], strict=True):
            torch.index_select(engine, 0, blocks, out=slab)

    def bulk(self) -> None:
        for layer in range(self.kv.num_layers):
            self.layer(layer, None)
