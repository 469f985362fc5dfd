"""Worker-side transfers: pages between vLLM's paged KV cache and the kvplug tiers.

Runs in each vLLM worker process (one per TP rank). It owns the StorageManager (so L1 lives next
to the KV cache), the lookup service the scheduler asks, and the pins lookup takes. Two modes:

* bulk: ``start_load_kv`` writes every loaded chunk before the forward pass; ``wait_for_save``
  copies every chunk to store after it;
* layer-wise (``layerwise: true``): loads are released layer by layer in ``wait_for_layer_load``
  (a chunk that lookup found in a tier implementing ``get_layers`` is read one layer at a time,
  just before that layer is needed) and stores copied layer by layer in ``save_kv_layer``
  (kvplug.gpu's generators).

Every chunk (every layer, when read by layer) is verified (present, shape, token count) *before*
its bytes reach a block; a chunk that fails makes it and everything after it in that request a
load error, reported through ``get_block_ids_with_load_errors`` so vLLM recomputes those blocks.
The load's steps are in :mod:`.load`, its outcome (load errors, results, stats) in
:mod:`.load_report`, the store of a step in :mod:`.store`; this module routes vLLM's calls to
them and keeps lookup's pins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Mapping

import torch
from kvplug.gpu import PagedKV, PageJob, layerwise_load, scatter_many
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime import THREADS, Runtime
from kvplug.storage_manager import StorageManager

from .config import ConnectorConfig
from .groups import GroupLayout, lookup_groups, plan_group_load
from .identity import Identity
from .load import BackgroundLoads, LayerReads, RequestLoad, plan_load, valid_pages
from .load_report import LoadReports
from .lookup import Lookup, LookupService, socket_path
from .metadata import KVPlugMetadata, KVPlugWorkerMeta
from .save import AsyncSaves, async_save_enabled
from .stats import KVPlugStats, StatsRecorder
from .store import WorkerStore

logger = logging.getLogger("kvplug.connector")


_Identity = Identity  # the key fields of this worker (built by .identity.build_identity)


class WorkerSide:
    """The worker half of :class:`~kvplug.connector.KVPlugConnector`."""

    def __init__(self, config: ConnectorConfig, ident: Identity,
                 layout: GroupLayout | None = None, runtime: Runtime = THREADS) -> None:
        self.cfg = config
        self.runtime = runtime  # threads, events and clock (kvplug.runtime; a simulation's)
        self.ident = ident
        self.layout = layout or GroupLayout()  # KV cache groups (see .groups)
        self.stats = StatsRecorder()
        self._reports = LoadReports(config, ident.rank, self.layout, self.stats)
        self.kv: PagedKV | None = None
        self.storage: StorageManager | None = None
        self.service: LookupService | None = None
        self.kv_dtype = ""
        self._pins: dict[str, tuple[list[CacheKey], list[str]]] = {}
        self._lock = threading.Lock()
        self._loads: list[RequestLoad] = []  # this step's loads, reported once they are done
        self._load_steps: Generator[int, None, None] | None = None  # layer-wise load steps
        self._load_next = 0
        self._load_objs: list[MemoryObj] = []  # what this step's load reads from
        self._stores: WorkerStore | None = None  # the stores, once there is a KV cache (.store)
        self._background: BackgroundLoads | None = None  # loads vLLM waits for asynchronously
        self._sent: set[str] = set()  # finished requests whose last save read their blocks
        self._saves: AsyncSaves | None = None  # asynchronous saves (.save)
        #: this step's failed loads (before its forward): their requests and blocks. KV computed
        #: over them is wrong, so nothing of those requests is stored this step
        self._failed_reqs: set[str] = set()
        self._failed_blocks: set[int] = set()

    # -- setup ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if not self.layout.servable:  # the scheduler side never loads nor stores then
            logger.warning("%s", self.layout.unsupported_message())
            return
        self.kv = PagedKV.from_kv_caches(kv_caches)
        self.kv_dtype = str(self.kv.kv_dtype).removeprefix("torch.")
        self.storage = StorageManager(self.cfg, runtime=self.runtime)
        self._background = BackgroundLoads(self.storage.batched_get, runtime=self.runtime)
        if async_save_enabled(self.cfg, self.kv.device.type):
            self._saves = AsyncSaves(self.kv, self.storage, self.stats, self.runtime)
        self._stores = WorkerStore(self.kv, self.storage, self.layout, self.key, self.stats,
                                   self._saves)
        path = socket_path(self.ident.engine_id, self.ident.rank, self.ident.pp_rank)
        if self.runtime.remote_lookups:  # else the caller calls _on_lookup (a simulation)
            self.service = LookupService(path, self._on_lookup, self.release)
        logger.info("kvplug worker rank %d: %d layers x %d blocks x %d B pages (%s, %s), "
                    "mode %s, lookup at %s", self.ident.rank, self.kv.num_layers,
                    self.kv.num_blocks, self.kv.page_bytes, self.kv_dtype, self.ident.layout,
                    "layer-wise" if self.cfg.layerwise else "bulk", path)

    def key(self, chunk_hash: bytes) -> CacheKey:
        return self.ident.key(self.kv_dtype, chunk_hash)

    def close(self) -> None:
        self._finish_load()
        if self._background is not None:
            self._background.close()
        if self._saves is not None:
            self._saves.close()  # before the tiers: its puts finish first
        if self.service is not None:
            self.service.close()
            self.service = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    # -- lookup (service thread) ---------------------------------------------------------------
    def _on_lookup(self, msg: Lookup) -> tuple[int, list[int]]:
        """The stored leading tokens and which of the hit's chunks only a tier that may block
        holds (the scheduler loads those asynchronously)."""
        assert self.storage is not None
        self.release([msg.req_id])  # a repeated lookup replaces the earlier pins
        if self.layout.multi:
            return self._lookup_groups(msg)
        keys = [self.key(h) for h in msg.hashes]
        if self._saves is not None:  # an asynchronous save of these chunks: let its put end
            self._saves.settle(keys + [self.key(h) for _, h in msg.tails],
                               self.cfg.lookup_timeout_s / 2)
        found = self.storage.lookup_prefix(keys, pin=msg.pin)
        pinned, tiers = keys[: found.num_chunks], list(found.tiers)
        tokens = found.num_chunks * self.cfg.chunk_size
        if found.num_chunks == len(keys):
            for end, h in msg.tails:
                k = self.key(h)
                tail = self.storage.lookup_prefix([k], pin=msg.pin)
                if tail.num_chunks:
                    pinned.append(k)
                    tiers.extend(tail.tiers)
                    tokens = end
                    break
        if msg.pin and pinned:
            with self._lock:
                self._pins[msg.req_id] = (pinned, tiers)
        return tokens, [i for i, t in enumerate(tiers) if self.storage.may_block(t)]

    def _lookup_groups(self, msg: Lookup) -> tuple[int, list[int]]:
        """:meth:`_on_lookup` for several KV cache groups (:func:`.groups.lookup_groups`)."""
        storage = self.storage
        assert storage is not None

        def contains(keys: list[CacheKey]) -> tuple[int, list[str]]:
            found = storage.lookup_prefix(keys, pin=msg.pin)
            return found.num_chunks, list(found.tiers)

        hit = lookup_groups(self.layout, self.key, contains, msg.hashes, msg.tails,
                            self.cfg.chunk_size, self.layout.block_size)
        if msg.pin and hit.pinned:
            with self._lock:
                self._pins[msg.req_id] = (hit.pinned, hit.tiers)
        slow = {c for c, t in zip(hit.chunk_of, hit.tiers, strict=False) if storage.may_block(t)}
        return hit.tokens, sorted(slow)

    def release(self, req_ids: list[str] | set[str]) -> None:
        """Drop the pins lookup took for these requests."""
        if self.storage is None:
            return
        for req_id in req_ids:
            with self._lock:
                held = self._pins.pop(req_id, None)
            if held:
                self.storage.unpin(*held)

    def _tier_of(self, req_id: str) -> Callable[[CacheKey], str | None]:
        """Where each key of ``req_id``'s load is: where lookup pinned it, else (a key this rank
        never pinned: with TP>1 the hit is the minimum over ranks) the tier holding it now."""
        with self._lock:
            keys, tiers = self._pins.get(req_id, ([], []))
        pinned = dict(zip(keys, tiers, strict=False))
        storage = self.storage
        assert storage is not None
        return lambda k: pinned[k] if k in pinned else storage.contains(k)

    def bind(self, md: KVPlugMetadata | None) -> None:
        """vLLM bound the coming step's metadata (before its forward, before any ``get_finished``
        of the step): the saves it names are expected (:meth:`.save.AsyncSaves.expect`)."""
        if self._saves is not None and md is not None:
            self._saves.expect(md)

    # -- load: plan, fetch and validate, scatter, report (see .load) ----------------------------
    def start_load_kv(self, md: KVPlugMetadata | None) -> None:
        self._finish_load()
        if md is None or self.kv is None:
            return
        jobs: list[PageJob] = []
        reads = LayerReads(self.storage, self.kv.num_layers) if self.cfg.layerwise else None
        for r in md.requests:
            if r.load is not None:
                t0 = time.perf_counter()
                ld = (plan_group_load(md, r, self.key, self._tier_of(r.req_id), self.layout)
                      if self.layout.multi else plan_load(md, r, self.key, self._tier_of(r.req_id)))
                if r.load.background:
                    self._background.submit(ld)  # type: ignore[union-attr]
                    continue
                self._fetch(ld, jobs, reads)
                ld.seconds += time.perf_counter() - t0
                self._loads.append(ld)
        if reads is not None and jobs:
            self._load_steps = layerwise_load(self.kv, jobs, reads.before)
            self._load_next = 0
            return
        try:
            if jobs:
                scatter_many(self.kv, jobs)
        finally:
            self._finish_load()

    def _fetch(self, ld: RequestLoad, jobs: list[PageJob], reads: LayerReads | None) -> None:
        """Step 2: fetch the chunks (whole, or staged for layer reads) and validate them; a
        valid chunk gets a transfer job, an invalid one fails with the rest of its request."""
        assert self.storage is not None and self.kv is not None
        for c in ld.chunks:
            c.by_layer = (reads is not None and bool(c.block_ids)
                          and self.storage.reads_layers(c.tier))
        whole = [c for c in ld.chunks if not c.by_layer]
        try:
            got = dict(zip(map(id, whole), self.storage.batched_get([c.key for c in whole]),
                           strict=True))
        except Exception:
            logger.exception("kvplug load of %s failed", ld.req.req_id)
            got = {}
        self._admit(ld, got, jobs, reads)

    def _admit(self, ld: RequestLoad, got: dict[int, MemoryObj | None], jobs: list[PageJob],
               reads: LayerReads | None) -> None:
        """Validate the fetched chunks (``got``: by ``id`` of the chunk; this takes their
        references); a valid chunk gets a transfer job, an invalid one fails with the rest."""
        assert self.storage is not None and self.kv is not None
        L, page = self.kv.num_layers, self.kv.page_bytes
        for c in ld.chunks:
            obj = got.get(id(c))
            if c.by_layer and ld.ok(c):
                obj = self.storage.allocate((L, c.num_pages, page), num_tokens=c.end - c.start)
            elif not ld.ok(c) or not valid_pages(obj, (L, c.num_pages, page), c.end - c.start):
                ld.fail(c.start)
                if obj is not None:
                    obj.ref_down()
                continue
            if obj is None:  # no memory to stage a layer-wise read in
                ld.fail(c.start)
                continue
            self._load_objs.append(obj)
            if c.by_layer:
                reads.add(ld, c, obj)  # type: ignore[union-attr]
            if c.block_ids:
                c.job = len(jobs)
                jobs.append(PageJob(c.block_ids, obj.tensor[:, c.pages]))

    def get_finished(self, finished: set[str]) -> set[str]:
        """Background loads that are over: written (or failed, reported as load errors) now, on
        vLLM's thread between forward passes, or cancelled because vLLM finished the request
        (never written: vLLM frees its blocks once it is reported). Drops finished requests'
        pins."""
        if self._background is None:
            return set()
        over = self._background.cancel(finished) if finished else set()
        if over:
            self.stats.add("load_cancelled", len(over))
        jobs: list[PageJob] = []
        for ld, objs in self._background.take_done():
            self._admit(ld, dict(zip(map(id, ld.chunks), objs, strict=True)), jobs, None)
            self._loads.append(ld)
            over.add(ld.req.req_id)
        try:
            if jobs:
                scatter_many(self.kv, jobs)  # type: ignore[arg-type]
        finally:
            self._finish_load()
            self.release(finished)
        return over

    def _report(self, ld: RequestLoad) -> None:
        """Step 4: the load is over: drop its pins, then report it (:mod:`.load_report`)."""
        assert self.kv is not None
        self.release([ld.req.req_id])  # loaded (or failed): the pins have done their job
        if ld.fail_at is not None and not ld.spec.background:  # this step's forward reads it
            self._failed_reqs.add(ld.req.req_id)
            self._failed_blocks.update(ld.error_blocks())
        self._reports.record(ld, self.kv, self.storage.tier_names if self.storage else [])

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load_steps is None or self.kv is None:
            return
        idx = self.kv.index_of(layer_name)
        while self._load_next <= idx:
            next(self._load_steps)
            self._load_next += 1

    def _finish_load(self) -> None:
        """Wait for this step's load (layer-wise: every layer), free its memory, report it."""
        try:
            if self._load_steps is not None:
                for _ in self._load_steps:  # exhausting waits for every copy
                    pass
        finally:
            self._load_steps = None
            for o in self._load_objs:
                o.ref_down()
            self._load_objs = []
            loads, self._loads = self._loads, []
            for ld in loads:
                self._report(ld)

    def take_report(self) -> KVPlugWorkerMeta | None:
        """Per-request load results since the last call (for the scheduler)."""
        return self._reports.take_report()

    def take_stats(self) -> KVPlugStats | None:
        """This step's counters, with what the tiers' own counters grew by since the last step."""
        if self.storage is not None:
            self.stats.sample_tiers(self.storage.stats())
        return self.stats.take()

    def take_sent(self, finished: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """Finished requests whose last save is over (vLLM's ``finished_sending``); with
        asynchronous saves, every finished request that had a save, once no copy reads its
        blocks (``finished``: the requests vLLM finished since the last step)."""
        if self._saves is not None:
            return self._saves.take_sent(finished)
        out, self._sent = self._sent, set()
        return out

    def handle_preemptions(self, md: KVPlugMetadata | None) -> None:
        """Before every step, which may rewrite blocks vLLM freed (preempted requests', and
        sliding-window blocks that left the window): order it after the asynchronous copies
        that read them."""
        if self._saves is None:
            return
        self._saves.wait_window()
        if md is not None and md.preempted:
            self._saves.wait_for(md.preempted)
            self._saves.forget(md.preempted)

    def take_failed(self) -> set[str]:
        """Requests whose load failed (several KV cache groups: vLLM's ``failed_recving``)."""
        return self._reports.take_failed()

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        return self._reports.take_load_errors()

    # -- store (see .store) ---------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, md: KVPlugMetadata | None) -> None:
        """Layer-wise mode: copy this layer of every chunk to store, right after it is computed."""
        if self.cfg.layerwise and md is not None and self._stores is not None:
            self._stores.save_layer(layer_name, md)

    def wait_for_save(self, md: KVPlugMetadata | None) -> None:
        if self._saves is None:
            # A finished request's blocks are read below (or never, on failure): then they go.
            self._sent.update(r.req_id for r in (md.requests if md else ()) if r.finished)
        self._finish_load()
        skip, self._failed_reqs = self._failed_reqs, set()
        bad, self._failed_blocks = self._failed_blocks, set()
        if md is not None and self._stores is not None:
            skip |= {r.req_id for r in md.requests  # a block another request shares, too
                     if bad.intersection(r.block_ids, *r.tables)}
            self._stores.finish(md, skip)
