"""A worker's stores: the KV of the step's saved chunks, from vLLM's blocks into the tiers.

:class:`Stores` is the store direction of the worker's transfers (:mod:`.transfers`; the load
direction is :mod:`.load`), in the same shape: ``expect`` (the bound step's saves), ``start`` (a
layer just computed, or the step's store), ``finished`` (vLLM's ``finished_sending``), and the
waits: ``wait_freed`` (copies ordered before vLLM reuses the blocks they read), ``wait_puts``
(puts a lookup waits for), ``wait_copies`` (every copy has read its blocks). A step's store:
:meth:`Stores.prepare` turns the step's save specs into memory objects and page jobs (one object
per KV cache group part of a chunk, see :mod:`..protocol.groups`); layer-wise mode copies each
layer right after it is computed; the step's end copies what is left and puts it (a synchronous
save), or hands the batch to :class:`AsyncSaves` (an asynchronous one).

Asynchronous saves: the copy of stored KV, and its put into the tiers, off the engine step.
A synchronous save (``async_save: false``) copies every chunk in ``wait_for_save`` and puts it
before the step returns. An asynchronous one (:class:`AsyncSaves`):

* CUDA: the copy is queued on the PagedKV's store stream after the forward pass (bulk:
  ``gather_many_async``; layer-wise: ``layerwise_store(wait=False)``) and ordered by a CUDA event;
  the step returns without a host synchronisation. A completion thread waits for the event, then
  puts the chunks.
* CPU (no stream): the completion thread does the copy itself, then the put, while the engine
  runs its next step. Whether that helps or competes for the cores is measured
  (``benchmarks/bench_async_save.py``); :data:`..protocol.config.CPU_DEFAULT` follows the figure.

vLLM's blocks must outlive every copy that reads them (vLLM 0.32's rules):

* A request that finishes (or is aborted) while a save may still read its blocks: the scheduler's
  ``request_finished`` returns True for every request that had a save (both sides decide from the
  same per-step metadata), and the workers report it in ``finished_sending`` (:meth:`AsyncSaves.take_sent`)
  once no copy of it is in flight; vLLM frees the blocks then.
* A preempted request's blocks are freed at once (no ``request_finished``) and may be rewritten by
  the next forward pass. ``handle_preemptions`` runs before it: :meth:`AsyncSaves.wait_for` orders it after
  the copies of those requests (CUDA: the engine's stream waits on their events, no host wait;
  CPU: a copy still queued is done right there on vLLM's thread, one being done is waited for;
  never a put).
* A running request's saved blocks are full (saves end on block boundaries) and never rewritten,
  except a sliding-window group's: vLLM frees them as the window moves on. A save that reads them
  is ordered before the next step (:meth:`AsyncSaves.wait_window`, from ``handle_preemptions``,
  which vLLM calls before every step's loads and forward).
* vLLM's V2 model runner zeroes newly allocated blocks and applies copy-on-write block copies
  *before* it calls ``handle_preemptions`` (``update_requests``, then ``pre_forward``). Where the
  engine does that (``needs_kv_cache_zeroing``: mixed-precision caches), a block a preemption freed
  can be rewritten before :meth:`AsyncSaves.wait_for` runs, so each step's copies are ordered before the next
  step right away (``order_at_enqueue``; CUDA: the engine's stream waits on the copy's event, no
  host wait; CPU: the copy is done on vLLM's thread). Found and checked on an H100 with
  ``tests/unit/test_gpu_cuda.py::test_a_block_zeroed_before_the_wait_races_the_store``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvplug.gpu import (
    PagedKV,
    PageJob,
    blocks_for_tokens,
    gather_many,
    gather_many_async,
    layerwise_store,
    num_pages,
)
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime import THREADS, Runtime
from kvplug.storage_manager import StorageManager

from ..protocol.groups import group_hash, store_targets
from ..protocol.metadata import KVPlugMetadata
from ..protocol.stats import StatsRecorder

if TYPE_CHECKING:
    from .transfers import TransferParts

logger = logging.getLogger("kvplug.connector")


@dataclass
class StoreBatch:
    """What one step stores: keys, their objects, the page jobs that fill them, their tokens."""

    keys: list[CacheKey] = field(default_factory=list)
    objs: list[MemoryObj] = field(default_factory=list)
    jobs: list[PageJob] = field(default_factory=list)
    tokens: int = 0
    window: bool = False  # it reads sliding-window blocks, which vLLM frees as the window moves
    reqs: list[str] = field(default_factory=list)  # the request of each key
    req_tokens: dict[str, int] = field(default_factory=dict)  # tokens stored, per request

    def without(self, skip: Collection[str]) -> tuple[StoreBatch, list[MemoryObj]]:
        """This batch less every chunk of the requests in ``skip``, and the objects left out
        (the caller releases them)."""
        if not skip or not skip & set(self.reqs):  # type: ignore[operator]
            return self, []
        kept = StoreBatch(window=self.window)
        dropped: list[MemoryObj] = []
        for k, o, j, r in zip(self.keys, self.objs, self.jobs, self.reqs, strict=True):
            if r in skip:
                dropped.append(o)
                continue
            kept.keys.append(k)
            kept.objs.append(o)
            kept.jobs.append(j)
            kept.reqs.append(r)
        kept.req_tokens = {r: n for r, n in self.req_tokens.items() if r not in skip}
        kept.tokens = sum(kept.req_tokens.values())
        return kept, dropped


class Stores:
    """One worker's stores, step by step (built once the KV cache and the tiers exist): the store
    direction of :class:`.transfers.Transfers`. ``saves``: the asynchronous saves, or None
    (synchronous: copied and put inside ``wait_for_save``)."""

    def __init__(self, parts: TransferParts, stats: StatsRecorder,
                 saves: AsyncSaves | None) -> None:
        self.kv, self.storage, self.layout, self.key = parts
        self.stats = stats
        self.saves = saves
        self._batch: StoreBatch | None = None  # layer-wise store of this step
        self._steps: Iterator[int] | None = None
        self._next = 0
        self._sent: set[str] = set()  # synchronous saves: finished requests whose save is over

    # -- the transfer shape (see .transfers) ------------------------------------------------------
    def expect(self, metadata: KVPlugMetadata) -> None:
        """vLLM bound the coming step's metadata: its saves are held until enqueued
        (:meth:`AsyncSaves.expect`)."""
        if self.saves is not None:
            self.saves.expect(metadata)

    def start(self, metadata: KVPlugMetadata | None, layer: str | None = None,
              skip: Collection[str] = frozenset()) -> None:
        """``layer``: layer-wise, copy that layer of every chunk the step saves, right after it
        is computed (``save_kv_layer``). Else the step's store (``wait_for_save``): see
        :meth:`_finish`; ``skip``: requests whose KV this step computed over a failed load."""
        if metadata is None:
            return
        if layer is not None:
            self._save_layer(layer, metadata)
            return
        if self.saves is None:
            # A finished request's blocks are read below (or never, on failure): then they go.
            self._sent.update(r.req_id for r in metadata.requests if r.finished)
        self._finish(metadata, skip)

    def finished(self, finished: Collection[str]) -> set[str]:
        """vLLM's ``finished_sending``: finished requests whose last save no longer reads their
        blocks (synchronous: it ran in ``wait_for_save``; asynchronous: once its copies are done,
        :meth:`AsyncSaves.take_sent`; ``finished``: the requests vLLM finished since the last
        step)."""
        if self.saves is not None:
            return self.saves.take_sent(finished)
        out, self._sent = self._sent, set()
        return out

    # Waits: asynchronous saves only (a synchronous one is over when ``wait_for_save`` returns).
    def wait_freed(self, freed: Collection[str]) -> None:
        """Before every step (``handle_preemptions``): vLLM freed these (preempted) requests'
        blocks, and sliding-window blocks that left their window; the coming forward pass, which
        may rewrite them, is ordered after every copy that reads them
        (:meth:`AsyncSaves.wait_window`, :meth:`AsyncSaves.wait_for`), and the preempted
        requests are no longer held at finish (:meth:`AsyncSaves.forget`)."""
        saves = self.saves
        if saves is None:
            return
        saves.wait_window()
        if freed:
            saves.wait_for(freed)
            saves.forget(freed)

    def wait_puts(self, keys: Collection[CacheKey], timeout: float) -> bool:
        """A lookup of ``keys`` waits (at most ``timeout`` seconds) until no put of them is in
        flight; False on timeout (:meth:`AsyncSaves.settle`)."""
        return self.saves.settle(keys, timeout) if self.saves is not None else True

    def wait_copies(self) -> None:
        """Every copy queued so far has read its blocks (sleep mode:
        :meth:`AsyncSaves.wait_all`); the puts may go on."""
        if self.saves is not None:
            self.saves.wait_all()

    def close(self) -> None:
        """Every save's copy and put is over (before the tiers close)."""
        if self.saves is not None:
            self.saves.close()

    # -- a step's store --------------------------------------------------------------------------
    def prepare(self, metadata: KVPlugMetadata) -> StoreBatch:
        """Memory and page jobs for every chunk the step saves, until the block table ends or
        memory runs out (a store failure: what was prepared is still stored)."""
        batch = StoreBatch()
        block_size = metadata.block_size
        for r in metadata.requests:
            spec = r.save
            if spec is None:
                continue
            for i, h in enumerate(spec.hashes):
                s, e = metadata.chunk_range(spec, i)
                if self.layout.multi:  # one part per group (sliding: only while in the window)
                    targets = store_targets(self.layout, r.tables, h, s, e, block_size)
                else:
                    try:
                        targets = [(h, blocks_for_tokens(r.block_ids, s, e, block_size))]
                    except ValueError:
                        targets = None
                if targets is None:  # the block table does not reach this chunk yet
                    break
                window = {group_hash(h, g) for g in self.layout.sliding}
                for th, ids in targets:
                    batch.window = batch.window or th in window
                    obj = self.storage.allocate((self.kv.num_layers, num_pages(e - s, block_size),
                                                 self.kv.page_bytes), num_tokens=e - s)
                    if obj is None:  # every tier with memory is full: store what we have
                        break
                    batch.keys.append(self.key(th, tenant=r.tenant) if r.tenant else self.key(th))
                    batch.objs.append(obj)
                    batch.jobs.append(PageJob(ids, obj.tensor))
                    batch.reqs.append(r.req_id)
                else:
                    batch.tokens += e - s
                    batch.req_tokens[r.req_id] = batch.req_tokens.get(r.req_id, 0) + e - s
                    continue
                self.stats.add("store_failures")
                break
        return batch

    def _save_layer(self, layer_name: str, metadata: KVPlugMetadata) -> None:
        """Layer-wise mode: copy this layer of every chunk, right after it is computed."""
        if self.saves is not None and not self.saves.on_cuda:  # CPU: copied off-step
            return
        if self._batch is None:
            self._batch = self.prepare(metadata)
            self._next = 0
            self._steps = (layerwise_store(self.kv, self._batch.jobs, wait=self.saves is None)
                           if self._batch.jobs else None)
        if self._steps is None:
            return
        idx = self.kv.index_of(layer_name)
        while self._next <= idx:
            next(self._steps)
            self._next += 1

    def _finish(self, metadata: KVPlugMetadata, skip: Collection[str]) -> None:
        """End the step's store: asynchronous saves get the batch; a synchronous save copies
        what the layers did not (bulk mode: everything) and puts it into the tiers. ``skip``:
        requests whose KV this step computed over a failed load: nothing of theirs is stored
        (the scheduler saves the range again once vLLM recomputed it)."""
        t0 = time.perf_counter()
        batch, steps = self._batch, self._steps
        self._batch, self._steps = None, None
        if self.saves is not None:  # copied (and put) off the step, see AsyncSaves
            batch, dropped = (batch or self.prepare(metadata)).without(skip)
            if steps is None:
                for o in dropped:
                    o.ref_down()
                dropped = []
            self.saves.enqueue(metadata, batch.keys, batch.objs, batch.jobs, batch.tokens, steps,
                               window=batch.window, unput=dropped)
            return
        dropped = []
        try:
            if batch is None:  # bulk mode (or a step whose layers never ran)
                batch, dropped = self.prepare(metadata).without(skip)
                if batch.jobs:
                    gather_many(self.kv, batch.jobs)
            else:
                if steps is not None:
                    for _ in steps:
                        pass
                batch, dropped = batch.without(skip)
            if batch.keys:
                self.storage.batched_put(batch.keys, batch.objs)
                self.stats.add("stores", 1)
                self.stats.add("store_tokens", batch.tokens)
                self.stats.add("store_bytes", sum(o.nbytes for o in batch.objs))
                self.stats.add("store_seconds", time.perf_counter() - t0)
        except Exception:
            self.stats.add("store_failures")
            logger.exception("kvplug store failed; the chunks are not cached")
        finally:
            for o in [*(batch.objs if batch else ()), *dropped]:
                o.ref_down()


# -- asynchronous saves --------------------------------------------------------------------------
@dataclass(eq=False)
class SaveJob:
    """One step's save: its chunks, the requests whose blocks it reads, where its copy is."""

    keys: list[CacheKey]
    objs: list[MemoryObj]
    jobs: list[PageJob]
    tokens: int
    req_ids: frozenset[str]
    event: torch.cuda.Event | None = None  # CUDA: completes with the copy
    state: str = "queued"  # CPU: queued -> copying -> copied (CUDA: queued -> copied)
    failed: bool = False
    window: bool = False  # reads sliding-window blocks: copied before the next step (wait_window)
    unput: list[MemoryObj] = field(default_factory=list)  # copied into, never put
    copied: threading.Event = field(default_factory=threading.Event)  # the runtime's event
    t0: float = field(default_factory=time.perf_counter)


class AsyncSaves:
    """Saves whose copy and put run off the engine step (see the module docstring).

    :meth:`enqueue` takes one step's chunks (owning one reference to each object; every object is
    released once its put is over or failed), :meth:`take_sent` reports finished requests whose
    blocks no copy reads any more, :meth:`wait_for` orders a preemption after the copies."""

    def __init__(self, kv: PagedKV, storage: StorageManager, stats: StatsRecorder,
                 runtime: Runtime = THREADS, order_at_enqueue: bool = False) -> None:
        self.kv = kv
        #: the engine may rewrite freed blocks before ``handle_preemptions``: order every step's
        #: copies before the next step when they are enqueued (see the module docstring)
        self.order_at_enqueue = order_at_enqueue
        self.storage = storage
        self.stats = stats
        self.on_cuda = kv.device.type == "cuda"
        self.runtime = runtime  # threads, events and clock (kvplug.runtime; a simulation's)
        self._pool = runtime.executor(1, "kvplug-save")
        self._lock = threading.Lock()
        self._settled = runtime.condition(self._lock)  # a job's put is over
        self._pending: dict[CacheKey, int] = {}  # chunks whose put is not over
        self._jobs: list[SaveJob] = []  # copy not complete, oldest first
        self._busy: dict[str, int] = {}  # request -> jobs in flight that read its blocks
        self._tracked: set[str] = set()  # requests that had a save: vLLM holds them at finish
        self._finished: set[str] = set()  # finished, waiting for their copies
        #: the bound step's requests with a save, until that step's ``enqueue`` (see expect)
        self._bound: tuple[KVPlugMetadata, frozenset[str]] | None = None
        self._closed = False

    # -- engine thread -------------------------------------------------------------------------
    def start_threads(self) -> None:
        """Start the save thread now (at start-up), and run its copy path once there (block 0
        of every layer into an L1 object that is not stored): the first save would set them up
        on the way (the thread; on CPU, torch's thread team for that thread's copies)."""
        self.runtime.start_threads(self._pool, 1)
        page = self.storage.allocate((self.kv.num_layers, 1, self.kv.page_bytes), num_tokens=1)
        if page is None:
            return
        try:
            self._pool.submit(gather_many, self.kv, [PageJob([0], page.tensor)]).result(
                timeout=30)
        finally:
            page.ref_down()

    def expect(self, metadata: KVPlugMetadata) -> None:
        """vLLM bound ``metadata`` for the coming step: its requests with a save count as held (vLLM
        keeps their blocks at finish) and as busy until this step's :meth:`enqueue`, whichever
        order vLLM calls ``get_finished`` and ``wait_for_save`` in (vLLM 0.33 with a speculator
        asks ``get_finished`` first)."""
        req_ids = frozenset(r.req_id for r in metadata.requests if r.save is not None)
        with self._lock:
            if self._bound is not None:  # never enqueued (no wait_for_save): nothing comes
                logger.debug("kvplug: a bound step's saves were never enqueued")
            self._bound = (metadata, req_ids) if req_ids else None
            self._tracked |= req_ids

    def enqueue(self, metadata: KVPlugMetadata, keys: list[CacheKey], objs: list[MemoryObj],
                jobs: list[PageJob], tokens: int, steps: Iterator[int] | None = None,
                window: bool = False, unput: Sequence[MemoryObj] = ()) -> None:
        """Start this step's save (called in ``wait_for_save``, after the forward pass). Every
        request of ``metadata`` with a save counts as one vLLM holds at finish, whether or not any of
        its chunks could be prepared. ``steps``: a layer-wise store stepped with ``wait=False``
        (CUDA); its remaining layers are queued here. ``window``: it reads sliding-window blocks
        (see :meth:`wait_window`). ``unput``: objects ``steps`` copies into that are not stored
        (a failed load's request); released, like the others, once the copy is over."""
        req_ids = frozenset(r.req_id for r in metadata.requests if r.save is not None)
        with self._lock:  # take_sent runs on this thread: no report slips in before the job
            self._tracked |= req_ids
            self._unbind(metadata)
        job = SaveJob(list(keys), list(objs), list(jobs), tokens, req_ids, window=window,
                      unput=list(unput), copied=self.runtime.event())
        if not keys and not unput:
            return
        if self.on_cuda:
            try:
                if steps is not None:
                    for _ in steps:  # layers that never ran; no host wait after the last
                        pass
                    job.event = getattr(steps, "event", None)
                else:
                    job.event = gather_many_async(self.kv, job.jobs)
            except Exception:  # noqa: BLE001 - validation fails before any copy is queued
                logger.exception("kvplug save failed; the chunks are not cached")
                self.stats.add("store_failures")
                self._release(job)
                return
        # counted when enqueued, so a request's stores show in the stats the step it ends (a
        # copy or put that fails later counts in store_failures)
        if keys:
            self.stats.add("stores", 1)
            self.stats.add("store_tokens", tokens)
            self.stats.add("store_bytes", sum(o.nbytes for o in job.objs))
        with self._lock:
            closed = self._closed
            if not closed:
                self._jobs.append(job)
                for r in req_ids:
                    self._busy[r] = self._busy.get(r, 0) + 1
                for k in job.keys:
                    self._pending[k] = self._pending.get(k, 0) + 1
        if closed:  # vLLM is shutting down: nothing is stored any more
            logger.warning("kvplug: a save after the worker closed is dropped")
            self.stats.add("store_failures")
            if job.event is not None:  # CUDA: a copy queued into the objects; let it end first
                job.event.synchronize()
            self._release(job)
            return
        self._pool.submit(self._run, job)
        if self.order_at_enqueue:
            self._copy_now([job])

    def _unbind(self, metadata: KVPlugMetadata) -> None:
        """``metadata``'s saves are enqueued (or dropped): its requests are no longer expected."""
        if self._bound is not None and self._bound[0] is metadata:
            self._bound = None

    def take_sent(self, finished: Collection[str]) -> set[str]:
        """vLLM's ``finished_sending``: requests finished (``finished``: this step's, earlier ones
        are remembered) that had a save and whose blocks no copy reads any more, nor will: a
        request of the bound step whose save is not enqueued yet waits for it."""
        with self._lock:
            self._finished |= self._tracked.intersection(finished)
            coming = self._bound[1] if self._bound is not None else frozenset()
            ready = {r for r in self._finished if not self._busy.get(r) and r not in coming}
            self._finished -= ready
            self._tracked -= ready
        return ready

    def wait_for(self, req_ids: Collection[str]) -> None:
        """``handle_preemptions``: vLLM freed these requests' blocks; order the work that may
        rewrite them (the coming forward pass) after every copy that reads them."""
        with self._lock:
            jobs = [j for j in self._jobs if j.req_ids.intersection(req_ids)]
        self._copy_now(jobs)

    def wait_window(self) -> None:
        """Before every step: vLLM frees a running request's sliding-window blocks as its window
        moves (``remove_skipped_blocks``, no preemption, no ``request_finished``) and may reuse
        them in this step; order it after every copy that reads such blocks, as :meth:`wait_for`
        does for a preemption."""
        with self._lock:
            jobs = [j for j in self._jobs if j.window]
        self._copy_now(jobs)

    def _copy_now(self, jobs: list[SaveJob]) -> None:
        """Order what comes next on vLLM's thread after the copies of ``jobs``."""
        for job in jobs:
            if self.on_cuda:
                if job.event is not None:  # the engine's stream waits; the host does not
                    torch.cuda.current_stream(self.kv.device).wait_event(job.event)
                continue
            with self._lock:
                mine = job.state == "queued"
                if mine:
                    job.state = "copying"
            if mine:  # still queued behind another save: copy it here, now (a memory copy)
                self.stats.add("store_copies_on_preemption")
                self._copy(job)
            job.copied.wait()  # a copy the save thread is doing: a memory copy, never a put

    def forget(self, req_ids: Collection[str]) -> None:
        """vLLM preempted these requests (after :meth:`wait_for`): the blocks their saves read are
        gone, so they are no longer held at finish until a new save names them (the scheduler
        decides the same from the same metadata: an aborted request is reported once)."""
        with self._lock:
            self._tracked.difference_update(req_ids)
            self._finished.difference_update(req_ids)

    def wait_all(self) -> None:
        """Every copy queued so far has read its blocks, on the host too (sleep mode: the KV
        memory goes next). The puts may go on: they read host memory only."""
        with self._lock:
            jobs = list(self._jobs)
        self._copy_now(jobs)
        for job in jobs:
            if job.event is not None:
                job.event.synchronize()

    def settle(self, keys: Collection[CacheKey], timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until no put of ``keys`` is in flight, so a lookup
        right after a request finds what it stored (as with synchronous saves). False on
        timeout: the lookup goes on and may miss them."""
        end = self.runtime.monotonic() + timeout
        with self._settled:
            while any(k in self._pending for k in keys):
                left = end - self.runtime.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(left)
        return True

    def in_flight(self) -> int:
        """Saves whose copy is not complete."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        """Finish every save (copies and puts) and stop the thread; idempotent."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    # -- save thread ---------------------------------------------------------------------------
    def _copy(self, job: SaveJob) -> None:
        """The copy (CPU: gather; CUDA: wait for the event), then mark the blocks free to go.
        In inference mode, as vLLM's thread: the memory objects it allocated are inference
        tensors, which only inference mode may write (inference mode is per thread)."""
        try:
            if job.event is not None:
                job.event.synchronize()
            elif not self.on_cuda:
                with torch.inference_mode():
                    gather_many(self.kv, job.jobs)
        except Exception:  # noqa: BLE001 - a failed copy stores nothing
            logger.exception("kvplug save copy failed; the chunks are not cached")
            job.failed = True
        with self._lock:
            job.state = "copied"
            self._jobs.remove(job)
            for r in job.req_ids:
                n = self._busy.pop(r) - 1
                if n:
                    self._busy[r] = n
        job.copied.set()

    def _run(self, job: SaveJob) -> None:
        try:
            with self._lock:
                mine = job.state == "queued"
                if mine:
                    job.state = "copying"
            if mine:
                self._copy(job)
            else:  # vLLM's thread copies it (a preemption)
                job.copied.wait()
            if job.failed:
                self.stats.add("store_failures")
                return
            if not job.keys:  # only objects a copy wrote and nothing stores
                return
            with torch.inference_mode():  # as the puts vLLM's thread makes (tiers may write)
                self.storage.batched_put(job.keys, job.objs)
            self.stats.add("store_seconds", time.perf_counter() - job.t0)  # enqueue to put
        except Exception:  # noqa: BLE001 - a failed put stores nothing; the engine goes on
            self.stats.add("store_failures")
            logger.exception("kvplug store failed; the chunks are not cached")
        finally:
            self._release(job)
            with self._settled:
                for k in job.keys:
                    n = self._pending.pop(k) - 1
                    if n:
                        self._pending[k] = n
                self._settled.notify_all()

    @staticmethod
    def _release(job: SaveJob) -> None:
        for o in [*job.objs, *job.unput]:
            o.ref_down()
        job.objs, job.unput = [], []
