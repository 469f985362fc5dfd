"""The worker's store of one engine step: which chunks to copy, the copy, the put.

Split out of :mod:`.worker` (which routes vLLM's calls) so the store path reads on its own:
:meth:`WorkerStore.prepare` turns the step's save specs into memory objects and page jobs (one
object per KV cache group part of a chunk, see :mod:`.groups`); layer-wise mode copies each layer
right after it is computed (:meth:`WorkerStore.save_layer`); :meth:`WorkerStore.finish` ends the
step: a synchronous save copies what is left and puts it here, an asynchronous one hands the
batch to :class:`.save.AsyncSaves`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from kvplug.gpu import PagedKV, PageJob, blocks_for_tokens, gather_many, layerwise_store, num_pages
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.storage_manager import StorageManager

from ..protocol.groups import GroupLayout, group_hash, store_targets
from ..protocol.metadata import KVPlugMetadata
from ..protocol.stats import StatsRecorder
from .save import AsyncSaves

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


class WorkerStore:
    """One worker's stores, step by step (built once the KV cache and the tiers exist)."""

    def __init__(self, kv: PagedKV, storage: StorageManager, layout: GroupLayout,
                 key: Callable[[bytes], CacheKey], stats: StatsRecorder,
                 saves: AsyncSaves | None) -> None:
        self.kv = kv
        self.storage = storage
        self.layout = layout
        self.key = key
        self.stats = stats
        self.saves = saves
        self._batch: StoreBatch | None = None  # layer-wise store of this step
        self._steps: Iterator[int] | None = None
        self._next = 0

    def prepare(self, md: KVPlugMetadata) -> StoreBatch:
        """Memory and page jobs for every chunk the step saves, until the block table ends or
        memory runs out (a store failure: what was prepared is still stored)."""
        batch = StoreBatch()
        bs = md.block_size
        for r in md.requests:
            spec = r.save
            if spec is None:
                continue
            for i, h in enumerate(spec.hashes):
                s, e = md.chunk_range(spec, i)
                if self.layout.multi:  # one part per group (sliding: only while in the window)
                    targets = store_targets(self.layout, r.tables, h, s, e, bs)
                else:
                    try:
                        targets = [(h, blocks_for_tokens(r.block_ids, s, e, bs))]
                    except ValueError:
                        targets = None
                if targets is None:  # the block table does not reach this chunk yet
                    break
                window = {group_hash(h, g) for g in self.layout.sliding}
                for th, ids in targets:
                    batch.window = batch.window or th in window
                    obj = self.storage.allocate((self.kv.num_layers, num_pages(e - s, bs),
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

    def save_layer(self, layer_name: str, md: KVPlugMetadata) -> None:
        """Layer-wise mode: copy this layer of every chunk, right after it is computed."""
        if self.saves is not None and not self.saves.on_cuda:  # CPU: copied off-step
            return
        if self._batch is None:
            self._batch = self.prepare(md)
            self._next = 0
            self._steps = (layerwise_store(self.kv, self._batch.jobs, wait=self.saves is None)
                           if self._batch.jobs else None)
        if self._steps is None:
            return
        idx = self.kv.index_of(layer_name)
        while self._next <= idx:
            next(self._steps)
            self._next += 1

    def finish(self, md: KVPlugMetadata, skip: Collection[str] = frozenset()) -> None:
        """End the step's store: asynchronous saves get the batch; a synchronous save copies
        what the layers did not (bulk mode: everything) and puts it into the tiers. ``skip``:
        requests whose KV this step computed over a failed load: nothing of theirs is stored
        (the scheduler saves the range again once vLLM recomputed it)."""
        t0 = time.perf_counter()
        batch, steps = self._batch, self._steps
        self._batch, self._steps = None, None
        if self.saves is not None:  # copied (and put) off the step, see .save
            batch, dropped = (batch or self.prepare(md)).without(skip)
            if steps is None:
                for o in dropped:
                    o.ref_down()
                dropped = []
            self.saves.submit(md, batch.keys, batch.objs, batch.jobs, batch.tokens, steps,
                              window=batch.window, unput=dropped)
            return
        dropped = []
        try:
            if batch is None:  # bulk mode (or a step whose layers never ran)
                batch, dropped = self.prepare(md).without(skip)
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
