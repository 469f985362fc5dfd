"""A worker's loads, each along one straight path in this module:
**plan -> fetch -> validate -> scatter -> report**.

* **plan** (:func:`plan_load`): which pages of which stored chunk go to which blocks (one part per
  KV cache group, :func:`..protocol.groups.load_parts`), and the tier each chunk is in;
* **fetch**: the chunks from the tiers. Inside the step (an in-step load), each chunk only from the
  tier its lookup pinned it in, which never blocks (L1) or is a local medium, all of the step's
  reads sharing one wait allowance (``in_step_load_deadline_s``;
  :meth:`StorageManager.read_pinned`): a miss there, a chunk no lookup of this rank pinned (with
  TP > 1 the hit is the minimum over ranks) and not in L1, or a read past the allowance is a load
  error, never a call to another tier on the engine thread. A background load reads from
  whichever tier holds the chunk (:meth:`StorageManager.batched_get_where`: L1, else a slower
  tier, promoted into L1), off the step. Layer-wise, a chunk in a tier that reads layer ranges is
  staged and read one layer at a time just before that layer is scattered (:class:`LayerReads`);
* **validate** (:func:`valid_pages`): every chunk (every layer) is checked before any of its bytes
  reach a block; a chunk that fails makes it and everything after it in its request a load error;
* **scatter**: into the blocks (:mod:`kvplug.gpu`), in bulk or layer by layer;
* **report**: the pins are dropped and the load ends in one :class:`.recovery.LoadOutcome`
  (:meth:`RequestLoad.outcome`), recorded once in :class:`.load_report.LoadReports`, where the
  recovery rule (:func:`.recovery.recover`) turns a failure into the blocks vLLM recomputes,
  the per-request result and what the step's store leaves out. A step that reads a block a
  failed load left unwritten is recorded the same way (:meth:`Loads.read_unwritten`).

:class:`Loads` is the load direction of the worker's transfers (:mod:`.transfers`; the store
direction is :mod:`.store`), in the same shape: ``expect``, ``start``, ``finished``, and the
waits (``wait_layer``, ``wait_all``). It runs the path for both kinds of job: an in-step load
(``start_load_kv``: all five steps in the step, :meth:`Loads.start`; layer-wise, the scatter is
released layer by layer, :meth:`Loads.wait_layer`), and a background load (a chunk is in a
tier that may block: vLLM's asynchronous protocol), whose fetch alone runs off the step on
:class:`BackgroundLoads`' pool; its validate, scatter and report run on vLLM's thread in
``get_finished`` (:meth:`Loads.finished`), so no block is written once vLLM may free it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvplug.gpu import (
    PageJob,
    blocks_for_tokens,
    layerwise_load,
    num_pages,
    pages_for_tokens,
    scatter_many,
)
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.runtime import THREADS, Runtime
from kvplug.storage_manager import StorageManager
from kvplug.tier_calls import WaitBudget

from ..protocol import groups
from ..protocol.metadata import KVPlugMetadata, LoadSpec, ReqMeta
from . import recovery
from .load_report import LoadReports
from .recovery import LoadOutcome, UnwrittenRead

if TYPE_CHECKING:
    from .transfers import TransferParts

logger = logging.getLogger("kvplug.connector")

#: How long a step without a forward pass waits for a background fetch (``wait_idle``).
IDLE_WAIT_S = 0.01


@dataclass(eq=False)
class ChunkLoad:
    """One chunk of a request's load: its tokens ``[start, end)`` and where its pages go."""

    key: CacheKey
    start: int
    end: int
    num_pages: int  # pages of the stored chunk
    pages: slice  # of those, the pages to write (vLLM's own prefix hit is skipped)
    block_ids: list[int]  # where they go
    tier: str  # where lookup found it
    by_layer: bool = False  # read layer by layer (layer-wise mode, a tier that reads ranges)
    job: int | None = None  # index of its transfer job, once it has one
    counts: bool = True  # its tokens count as loaded (one part per chunk: see .groups)


@dataclass(eq=False)
class RequestLoad:
    """One request's load on its way along the path; it ends in one frozen
    :class:`.recovery.LoadOutcome` (:meth:`outcome`), the only thing recorded of it."""

    req: ReqMeta
    spec: LoadSpec
    block_size: int
    chunks: list[ChunkLoad] = field(default_factory=list)
    fail_at: int | None = None  # first token of the first chunk that failed, so far
    reason: str = ""  # why that chunk failed (a constant of .recovery)
    seconds: float = 0.0
    epoch: str = ""  # the weights epoch it was planned in (a background load may outlive it)

    def fail(self, token: int, reason: str) -> list[int]:
        """Mark the chunk at ``token`` and every later one failed (``reason``: why, kept if it
        is the first failed chunk); their jobs to leave out."""
        if self.fail_at is None or token < self.fail_at:
            self.fail_at, self.reason = token, reason
        return [c.job for c in self.chunks if c.start >= self.fail_at and c.job is not None]

    def ok(self, chunk: ChunkLoad) -> bool:
        return self.fail_at is None or chunk.start < self.fail_at

    def loaded(self) -> list[ChunkLoad]:
        """The chunks whose pages reached blocks."""
        return [c for c in self.chunks if c.block_ids and self.ok(c)]

    def outcome(self, block_bytes: int) -> LoadOutcome:
        """How the load ended, once it is over (``block_bytes``: one block of every layer): the
        first failed token and why, the tokens and bytes it loaded per tier, its time."""
        tokens: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        for c in self.loaded():
            n = (min(c.end, self.spec.write_end) - max(c.start, self.spec.start)) if c.counts else 0
            tokens[c.tier] = tokens.get(c.tier, 0) + n
            nbytes[c.tier] = nbytes.get(c.tier, 0) + len(c.block_ids) * block_bytes
        return LoadOutcome(self.req.req_id, self.fail_at, self.reason, self.spec.start,
                           self.spec.write_end, tuple(self.req.block_ids), self.block_size,
                           not self.spec.background, tokens, nbytes, self.seconds)


TierOf = Callable[[CacheKey], "str | None"]  # where to read a key from (None: nowhere)
#: A background load's chunk that no lookup of this rank pinned: read from whichever tier holds
#: it (off the step; the tier that served it is noted when the fetch is over).
ANY_TIER = ""


# -- 1. plan ---------------------------------------------------------------------------------------
def plan_load(metadata: KVPlugMetadata, r: ReqMeta, key: Callable[[bytes], CacheKey], tier_of: TierOf,
              layout: groups.GroupLayout | None = None) -> RequestLoad:
    """The chunks of ``r``'s load and their blocks: one :class:`ChunkLoad` per chunk, or per KV
    cache group part of a chunk with several groups (a sliding group writes only its live
    blocks). A chunk a block table cannot hold, or that ``tier_of`` finds nowhere to read from
    (see :meth:`Loads.start`), fails with everything after it."""
    assert r.load is not None
    spec, block_size = r.load, metadata.block_size
    load = RequestLoad(r, spec, block_size)
    for i, h in enumerate(spec.hashes):
        s, e = metadata.chunk_range(spec, i)
        first = max(s, spec.start)  # blocks before it vLLM already holds
        stop = min(e, spec.write_end)  # blocks from it on vLLM recomputes (spec.upto)
        if first >= stop:
            break
        try:
            if layout is not None and layout.multi:
                parts = groups.load_parts(layout, r.tables, h, s, e, spec.start, block_size, stop)
            else:
                parts = [groups.GroupChunk(h, s, e, num_pages(e - s, block_size),
                                           pages_for_tokens(first, stop, block_size, chunk_start=s),
                                           blocks_for_tokens(r.block_ids, first, stop, block_size), True)]
        except (ValueError, IndexError):
            load.fail(s, recovery.NO_BLOCKS)
            break
        keys = [key(p.hash, tenant=r.tenant) if r.tenant else key(p.hash) for p in parts]
        tiers = [tier_of(k) for k in keys]
        if None in tiers:
            load.fail(s, recovery.UNREACHABLE)
            break
        load.chunks += [ChunkLoad(k, s, e, p.num_pages, p.pages, p.block_ids, t,
                                  counts=p.counts)
                        for k, p, t in zip(keys, parts, tiers, strict=True)]  # type: ignore[misc]
    return load


class Loads:
    """One worker's loads, step by step, each along plan -> fetch -> validate -> scatter -> report
    (see the module docstring). Built once the KV cache and the tiers exist; ``pinned`` and
    ``release`` are lookup's pins (the tier it pinned each of a request's keys in; drop them);
    ``deadline_s``: the step's allowance of waiting on in-step reads. A load's outcome is kept
    nowhere here: it goes to ``reports`` (:class:`.load_report.LoadReports`) when it is over."""

    def __init__(self, parts: TransferParts, layerwise: bool, reports: LoadReports,
                 background: BackgroundLoads, pinned: Callable[[str], dict[CacheKey, str]],
                 release: Callable[[list[str]], None], deadline_s: float) -> None:
        self.kv, self.storage, self.layout, self.key = parts
        self.layerwise = layerwise
        self.reports = reports
        self.background = background
        self.pinned = pinned
        self.release = release
        self.deadline_s = deadline_s
        self._done: list[RequestLoad] = []  # loads scattered (or failed), reported by _finish()
        self._objs: list[MemoryObj] = []  # what their scatter reads from
        self._steps: Generator[int, None, None] | None = None  # layer-wise scatter
        self._next = 0
        self.epoch = ""  # the weights epoch of the step (WorkerSide.sync_epoch sets it)

    # -- the transfer shape (see .transfers) ------------------------------------------------------
    def expect(self, metadata: KVPlugMetadata) -> None:
        """vLLM bound the coming step's metadata: the unwritten blocks it reads are this step's
        load errors (:meth:`read_unwritten`)."""
        if metadata.unwritten:
            self.read_unwritten(metadata)

    def start(self, metadata: KVPlugMetadata | None) -> None:
        """``start_load_kv``: every load of the step (None: the step has none; the last one's
        ends). Plan; a background one is fetched off the step; the others are fetched,
        validated and scattered now (layer-wise: layer by layer, see :meth:`wait_layer`), then
        reported."""
        self._finish()
        if metadata is None:
            return
        jobs: list[PageJob] = []
        budget = self.storage.wait_budget(self.deadline_s)  # the step's, for every in-step read
        reads = LayerReads(self.storage, self.kv.num_layers, budget) if self.layerwise else None
        for r in metadata.requests:
            if r.load is None:
                continue
            t0 = time.perf_counter()
            where = self._where(self.pinned(r.req_id), r.load.background)
            load = plan_load(metadata, r, self.key, where, self.layout)  # 1. plan
            if r.load.background:
                load.epoch = self.epoch
                self.background.start_fetch(load)  # 2. fetch, off the step (see finished)
                continue
            got = self._fetch(load, reads, budget)  # 2. fetch
            self._validate(load, got, jobs, reads)  # 3. validate
            load.seconds += time.perf_counter() - t0
            self._done.append(load)
        self._scatter(jobs, reads)  # 4. scatter, then 5. report (_finish)

    def _where(self, pinned: dict[CacheKey, str], background: bool) -> TierOf:
        """Where a load reads each key from: the tier its lookup pinned it in. A key no lookup
        of this rank pinned: a background load reads it from whichever tier holds it
        (:data:`ANY_TIER`), an in-step load only from a tier that never blocks (RAM), else from
        nowhere (a load error: never a lookup over the other tiers on the engine thread)."""
        if background:
            return lambda k: pinned.get(k, ANY_TIER)
        return lambda k: pinned.get(k) or self.storage.find_never_blocking(k)

    def _fetch(self, load: RequestLoad, reads: LayerReads | None,
               budget: WaitBudget) -> dict[int, MemoryObj | None]:
        """Step 2, in the step: the whole chunks, by ``id`` of the chunk, each from its planned
        tier within the step's ``budget`` (a chunk read by layer is fetched in the scatter,
        :class:`LayerReads`); a fetch that raises leaves them all missing."""
        for c in load.chunks:
            c.by_layer = (reads is not None and bool(c.block_ids)
                          and self.storage.reads_layers(c.tier))
        whole = [c for c in load.chunks if not c.by_layer]
        try:
            got = self.storage.read_pinned([c.key for c in whole], [c.tier for c in whole],
                                           budget)
            return dict(zip(map(id, whole), got, strict=True))
        except Exception:
            logger.exception("kvplug load of %s failed", load.req.req_id)
            return {}

    def _validate(self, load: RequestLoad, got: dict[int, MemoryObj | None],
                  jobs: list[PageJob], reads: LayerReads | None) -> None:
        """Step 3: a valid chunk gets a scatter job (``got``: by ``id`` of the chunk; this takes
        their references), an invalid one fails with the rest of its request."""
        L, page = self.kv.num_layers, self.kv.page_bytes
        for c in load.chunks:
            obj = got.get(id(c))
            if c.by_layer and load.ok(c):
                obj = self.storage.allocate((L, c.num_pages, page), num_tokens=c.end - c.start)
            elif not load.ok(c) or not valid_pages(obj, (L, c.num_pages, page), c.end - c.start):
                load.fail(c.start, recovery.MISSING if obj is None else recovery.INVALID)
                if obj is not None:
                    obj.ref_down()
                continue
            if obj is None:  # no memory to stage a layer-wise read in
                load.fail(c.start, recovery.NO_STAGING)
                continue
            self._objs.append(obj)
            if c.by_layer:
                reads.add(load, c, obj)  # type: ignore[union-attr]
            if c.block_ids:
                c.job = len(jobs)
                jobs.append(PageJob(c.block_ids, obj.tensor[:, c.pages]))

    def _scatter(self, jobs: list[PageJob], reads: LayerReads | None) -> None:
        """Step 4: write the blocks, then report (bulk); layer-wise, the scatter is released
        layer by layer (:meth:`wait_layer`) and reported once every layer is written."""
        if reads is not None and jobs:
            self._steps = layerwise_load(self.kv, jobs, reads.before)
            self._next = 0
            return
        try:
            if jobs:
                scatter_many(self.kv, jobs)
        finally:
            self._finish()

    def wait_layer(self, layer: str) -> None:
        """Layer-wise: every layer up to ``layer`` is written (``wait_for_layer_load``: vLLM
        computes it next)."""
        if self._steps is None:
            return
        idx = self.kv.index_of(layer)
        while self._next <= idx:
            next(self._steps)
            self._next += 1

    def wait_all(self) -> None:
        """The step's in-step loads are over and their outcomes recorded (before its store, or
        sleep)."""
        self._finish()

    def _finish(self) -> None:
        """Step 5: wait for the step's scatter (layer-wise: every layer), free what it read,
        report every load that is over."""
        try:
            if self._steps is not None:
                for _ in self._steps:  # exhausting waits for every copy
                    pass
        finally:
            self._steps = None
            for o in self._objs:
                o.ref_down()
            self._objs = []
            loads, self._done = self._done, []
            for load in loads:
                self._report(load)

    def _report(self, load: RequestLoad) -> None:
        """Step 5 for one load: its pins are dropped, its outcome recorded."""
        self.release([load.req.req_id])  # loaded (or failed): the pins have done their job
        self.reports.record(load.outcome(self.kv.num_layers * self.kv.page_bytes),
                            self.storage.tier_names)

    def read_unwritten(self, metadata: KVPlugMetadata) -> None:
        """This step's forward reads blocks a failed load left unwritten (``metadata.unwritten``,
        :mod:`..scheduler.unwritten`): recorded as an :class:`.recovery.UnwrittenRead` with each
        reading request's first such token; the recovery rule fails them like a load into
        them."""
        bad = set(metadata.unwritten)
        first = {}
        for r in metadata.requests:
            at = next((i for i, b in enumerate(r.block_ids) if b in bad), None)
            if at is not None:
                first[r.req_id] = at * metadata.block_size
        self.reports.record(UnwrittenRead(tuple(metadata.unwritten), first))

    # -- a background load: fetched off the step, the rest in get_finished ----------------------
    def finished(self, finished: Collection[str], idle: bool = False) -> set[str]:
        """vLLM's ``finished_recving``: background loads that are over: validated, scattered and
        reported now, on vLLM's thread between forward passes; or cancelled because vLLM
        finished the request (never written: vLLM frees its blocks once it is reported).
        Returns their requests. ``idle``: the step ran no forward, so it waits a little for a
        fetch (:meth:`BackgroundLoads.wait_idle`)."""
        over = self.background.cancel(set(finished)) if finished else set()
        if idle:
            self.background.wait_idle(IDLE_WAIT_S)
        if over:
            self.reports.stats.add("load_cancelled", len(over))
        jobs: list[PageJob] = []
        for load, objs in self.background.take_done():  # 2. fetch is over
            if load.epoch != self.epoch:  # planned before a weights reset: never reaches a block
                for o in objs:
                    if o is not None:
                        o.ref_down()
                objs = [None] * len(objs)
                if load.chunks:
                    load.fail(load.chunks[0].start, recovery.STALE)
            self._validate(load, dict(zip(map(id, load.chunks), objs, strict=True)), jobs, None)
            self._done.append(load)
            over.add(load.req.req_id)
        self._scatter(jobs, None)  # 4. scatter, 5. report
        return over

    def close(self) -> None:
        self._finish()
        self.background.close()


# -- what the path uses ----------------------------------------------------------------------------
def valid_pages(obj: MemoryObj | None, shape: tuple[int, int, int], num_tokens: int) -> bool:
    """Pages may reach blocks only if they are exactly what this engine would have stored."""
    if obj is None:
        return False
    t = obj.tensor
    return (obj.meta.fmt == MemoryFormat.KV_PAGES and t.dtype == torch.uint8
            and tuple(t.shape) == shape and obj.num_tokens == num_tokens)


class LayerReads:
    """Chunks of a layer-wise load that are read one layer at a time, just before that layer is
    copied to the blocks (``layerwise_load``'s ``before``), from the tier lookup found them in.

    Each is staged in memory from ``allocate``; once whole, a chunk from a lower tier is promoted
    into L1 (as a whole-chunk ``get`` does). Every read waits at most what is left of the step's
    ``budget`` (shared with its whole-chunk reads).
    """

    def __init__(self, storage: StorageManager, num_layers: int, budget: WaitBudget) -> None:
        self.storage = storage
        self.num_layers = num_layers
        self.budget = budget
        self.items: list[tuple[RequestLoad, ChunkLoad, MemoryObj]] = []

    def add(self, load: RequestLoad, chunk: ChunkLoad, staging: MemoryObj) -> None:
        self.items.append((load, chunk, staging))

    def before(self, layer: int) -> list[int]:
        """Read layer ``layer`` of every chunk still good; returns the jobs to leave out."""
        drop: list[int] = []
        for load, c, staging in self.items:
            if not load.ok(c):
                continue
            t0 = time.perf_counter()
            part = self.storage.get_layers(c.key, layer, 1, tier=c.tier, budget=self.budget)
            good = valid_pages(part, (1, c.num_pages, staging.tensor.shape[2]), c.end - c.start)
            if good:
                staging.tensor[layer].copy_(part.tensor[0])  # type: ignore[union-attr]
            if part is not None:
                part.ref_down()
            if not good:
                drop += load.fail(c.start, recovery.MISSING if part is None else recovery.INVALID)
            elif layer == self.num_layers - 1 and c.tier != self.storage.tier_names[0]:
                self.storage.promote(c.key, staging)
            load.seconds += time.perf_counter() - t0
        return drop


#: A background load's fetch: the objects, and the tier each came from (None: missed).
Fetch = Callable[[Sequence[CacheKey]], "tuple[list[MemoryObj | None], list[str | None]]"]


def _drop(fut: Future) -> None:
    """Release what a fetch nobody will use brought (a cancelled load's, when it arrives)."""
    if fut.cancelled() or fut.exception() is not None:
        return
    for obj in fut.result()[0]:
        if obj is not None:
            obj.ref_down()


class BackgroundLoads:
    """Loads vLLM waits for in ``WAITING_FOR_REMOTE_KVS``: each request's chunks are fetched on a
    worker-owned pool (``fetch``: :meth:`StorageManager.batched_get_where`, which bounds every
    tier call by the tier's ``timeout_s`` and promotes into L1). The caller takes finished fetches on its own
    thread (:meth:`take_done`) and writes the blocks there; a cancelled load's objects are dropped
    when its fetch ends, never written."""

    def __init__(self, fetch: Fetch, threads: int = 4, runtime: Runtime = THREADS) -> None:
        self._fetch = fetch
        self._threads = threads
        self._pool = runtime.executor(threads, "kvplug-load")
        self._runtime = runtime
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[RequestLoad, Future]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._inflight)

    def start_threads(self) -> None:
        """Start the fetch threads now (at start-up), not on the first background loads."""
        self._runtime.start_threads(self._pool, self._threads)

    def start_fetch(self, load: RequestLoad) -> None:
        """Start fetching every chunk of ``load`` (in chunk order)."""
        def run() -> tuple[list[MemoryObj | None], list[str | None]]:
            t0 = time.perf_counter()
            try:
                return self._fetch([c.key for c in load.chunks])
            finally:
                load.seconds += time.perf_counter() - t0

        with self._lock:
            self._inflight[load.req.req_id] = (load, self._pool.submit(run))

    def cancel(self, req_ids: set[str]) -> set[str]:
        """vLLM finished these requests (aborted while loading): their loads are over now; what
        their fetches still bring is dropped on arrival. Returns the ids that had a load."""
        with self._lock:
            gone = [self._inflight.pop(r) for r in req_ids if r in self._inflight]
        for _, fut in gone:
            fut.add_done_callback(_drop)  # runs at once if the fetch is over
        return {load.req.req_id for load, _ in gone}

    def wait_idle(self, timeout: float) -> None:
        """vLLM runs no forward this step: wait (at most ``timeout``) until a fetch is over.

        With only requests waiting for their loads, vLLM's engine loop runs empty steps back to
        back (measured 600-1,300 per 3k-token disk hit), each one a Python round trip that holds
        the GIL against the fetch's reader threads; waiting here ends the step as soon as a fetch
        is over (``get_finished`` reports it at once) and lets the readers run meanwhile. A request
        arriving meanwhile waits at most ``timeout`` to be scheduled."""
        with self._lock:
            futs = [f for _, f in self._inflight.values()]
        if futs and not any(f.done() for f in futs):
            self._runtime.wait_first(futs, timeout)

    def take_done(self) -> list[tuple[RequestLoad, list[MemoryObj | None]]]:
        """The loads whose fetch is over, with the objects (``None``: missing or failed); the
        caller owns one reference to each object."""
        with self._lock:
            done = [(r, v) for r, v in self._inflight.items() if v[1].done()]
            for r, _ in done:
                del self._inflight[r]
        out = []
        for _, (load, fut) in done:
            try:
                objs, tiers = fut.result()
            except Exception:  # noqa: BLE001 - a fetch that raised is a load error
                objs, tiers = [], []
            for c, tier in zip(load.chunks, tiers, strict=False):
                if c.tier == ANY_TIER and tier is not None:
                    c.tier = tier  # where a chunk no lookup pinned was found
            out.append((load, list(objs) + [None] * (len(load.chunks) - len(objs))))
        return out

    def close(self) -> None:
        """Drop every load (their objects on arrival) and stop the pool without waiting."""
        self.cancel(set(self._inflight))
        self._pool.shutdown(wait=False, cancel_futures=True)
