"""Asynchronous saves: the copy of stored KV, and its put into the tiers, off the engine step.

A synchronous save (``async_save: false``) copies every chunk in ``wait_for_save`` and puts it
before the step returns. An asynchronous one (:class:`AsyncSaves`):

* CUDA: the copy is queued on the PagedKV's store stream after the forward pass (bulk:
  ``gather_many_async``; layer-wise: ``layerwise_store(wait=False)``) and ordered by a CUDA event;
  the step returns without a host synchronisation. A completion thread waits for the event, then
  puts the chunks.
* CPU (no stream): the completion thread does the copy itself, then the put, while the engine
  runs its next step. Whether that helps or competes for the cores is measured
  (``benchmarks/bench_async_save.py``); :data:`CPU_DEFAULT` follows the figure.

vLLM's blocks must outlive every copy that reads them (vLLM 0.32's rules):

* A request that finishes (or is aborted) while a save may still read its blocks: the scheduler's
  ``request_finished`` returns True for every request that had a save (both sides decide from the
  same per-step metadata), and the workers report it in ``finished_sending`` (:meth:`take_sent`)
  once no copy of it is in flight; vLLM frees the blocks then.
* A preempted request's blocks are freed at once (no ``request_finished``) and may be rewritten by
  the next forward pass. ``handle_preemptions`` runs before it: :meth:`wait_for` orders it after
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
  can be rewritten before :meth:`wait_for` runs, so each step's copies are ordered before the next
  step right away (``order_at_submit``; CUDA: the engine's stream waits on the copy's event, no
  host wait; CPU: the copy is done on vLLM's thread). Found and checked on an H100 with
  ``tests/unit/test_gpu_cuda.py::test_a_block_zeroed_before_the_wait_races_the_store``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from kvplug.gpu import PagedKV, PageJob, gather_many, gather_many_async
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime import THREADS, Runtime
from kvplug.storage_manager import StorageManager

from .config import ConnectorConfig
from .metadata import KVPlugMetadata
from .stats import StatsRecorder

logger = logging.getLogger("kvplug.connector")

#: ``async_save`` unset on CPU (see ``benchmarks/bench_async_save.py`` and RESULTS.md).
CPU_DEFAULT = True


def async_save_enabled(cfg: ConnectorConfig, device_type: str) -> bool:
    """Whether saves run asynchronously: ``async_save`` if set, else on for CUDA and
    :data:`CPU_DEFAULT` elsewhere. The scheduler and the workers must agree (the scheduler then
    holds every finished request's blocks until the workers report its saves done)."""
    if cfg.async_save is not None:
        return cfg.async_save
    return device_type == "cuda" or CPU_DEFAULT


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

    ``submit`` takes one step's chunks (owning one reference to each object; every object is
    released once its put is over or failed), :meth:`take_sent` reports finished requests whose
    blocks no copy reads any more, :meth:`wait_for` orders a preemption after the copies."""

    def __init__(self, kv: PagedKV, storage: StorageManager, stats: StatsRecorder,
                 runtime: Runtime = THREADS, order_at_submit: bool = False) -> None:
        self.kv = kv
        #: the engine may rewrite freed blocks before ``handle_preemptions``: order every step's
        #: copies before the next step when they are submitted (see the module docstring)
        self.order_at_submit = order_at_submit
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
        #: the bound step's requests with a save, until that step's ``submit`` (see expect)
        self._bound: tuple[KVPlugMetadata, frozenset[str]] | None = None
        self._closed = False

    # -- engine thread -------------------------------------------------------------------------
    def expect(self, md: KVPlugMetadata) -> None:
        """vLLM bound ``md`` for the coming step: its requests with a save count as held (vLLM
        keeps their blocks at finish) and as busy until this step's :meth:`submit`, whichever
        order vLLM calls ``get_finished`` and ``wait_for_save`` in (vLLM 0.33 with a speculator
        asks ``get_finished`` first)."""
        req_ids = frozenset(r.req_id for r in md.requests if r.save is not None)
        with self._lock:
            if self._bound is not None:  # never submitted (no wait_for_save): nothing comes
                logger.debug("kvplug: a bound step's saves were never submitted")
            self._bound = (md, req_ids) if req_ids else None
            self._tracked |= req_ids

    def submit(self, md: KVPlugMetadata, keys: list[CacheKey], objs: list[MemoryObj],
               jobs: list[PageJob], tokens: int, steps: Iterator[int] | None = None,
               window: bool = False, unput: Sequence[MemoryObj] = ()) -> None:
        """Start this step's save (called in ``wait_for_save``, after the forward pass). Every
        request of ``md`` with a save counts as one vLLM holds at finish, whether or not any of
        its chunks could be prepared. ``steps``: a layer-wise store stepped with ``wait=False``
        (CUDA); its remaining layers are queued here. ``window``: it reads sliding-window blocks
        (see :meth:`wait_window`). ``unput``: objects ``steps`` copies into that are not stored
        (a failed load's request); released, like the others, once the copy is over."""
        req_ids = frozenset(r.req_id for r in md.requests if r.save is not None)
        with self._lock:  # take_sent runs on this thread: no report slips in before the job
            self._tracked |= req_ids
            self._unbind(md)
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
        # counted when submitted, so a request's stores show in the stats the step it ends (a
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
        if self.order_at_submit:
            self._copy_now([job])

    def _unbind(self, md: KVPlugMetadata) -> None:
        """``md``'s saves are submitted (or dropped): its requests are no longer expected."""
        if self._bound is not None and self._bound[0] is md:
            self._bound = None

    def take_sent(self, finished: Collection[str]) -> set[str]:
        """vLLM's ``finished_sending``: requests finished (``finished``: this step's, earlier ones
        are remembered) that had a save and whose blocks no copy reads any more, nor will: a
        request of the bound step whose save is not submitted yet waits for it."""
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
            self.stats.add("store_seconds", time.perf_counter() - job.t0)  # submit to put
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
