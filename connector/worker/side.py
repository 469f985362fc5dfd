"""Worker-side transfers: pages between vLLM's paged KV cache and the kvplug tiers.

Runs in each vLLM worker process (one per TP rank). It owns the StorageManager (so L1 lives next
to the KV cache), the lookup service the scheduler asks, and the pins lookup takes. Two modes:

* bulk: ``start_load_kv`` writes every loaded chunk before the forward pass; ``wait_for_save``
  copies every chunk to store after it;
* layer-wise (``layerwise: true``): loads are released layer by layer in ``wait_for_layer_load``
  (a chunk that lookup found in a tier implementing ``get_layers`` is read one layer at a time,
  just before that layer is needed) and stores copied layer by layer in ``save_kv_layer``
  (kvplug.gpu's generators).

Loads and stores are one kind of job moving in opposite directions, behind one object
(:class:`.transfers.Transfers`: ``submit``, ``finished``, the waits). A load runs along one path,
plan -> fetch -> validate -> scatter -> report, in :mod:`.load`, and ends in one outcome: a chunk
that fails makes it and everything after it in that request a load error; the recovery rule
(:mod:`.recovery`) decides what follows, reported through ``get_block_ids_with_load_errors`` so
vLLM recomputes those blocks. A step's store, and the
asynchronous saves, are in :mod:`.store`. This module routes vLLM's calls to the transfers and
keeps lookup's pins.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from kvplug.gpu import PagedKV
from kvplug.keys import CacheKey
from kvplug.read_memory import ChunkGeometry
from kvplug.runtime import THREADS, Runtime
from kvplug.storage_manager import StorageManager

from ..protocol.config import ConnectorConfig, async_save_enabled
from ..protocol.groups import GroupLayout, lookup_groups
from ..protocol.identity import Identity
from ..protocol.lookup import Lookup, LookupService, socket_path
from ..protocol.manage import ManageService, manage_path
from ..protocol.metadata import KVPlugMetadata, KVPlugWorkerMeta
from ..protocol.stats import TENANT_SAMPLE_S, KVPlugStats, StatsRecorder
from .load import BackgroundLoads, Loads
from .load_report import LoadReports
from .management import WorkerManagement
from .recovery import UnwrittenRead
from .store import AsyncSaves, Stores
from .transfers import Load, Store, TransferParts, Transfers

logger = logging.getLogger("kvplug.connector")


#: how long an idle step pauses while requests wait for a producer's chunks (as long as a step
#: without a forward waits for a background fetch: .load.IDLE_WAIT_S)
HANDOFF_PAUSE_S = 0.01


class WorkerSide:
    """The worker half of :class:`~kvplug.connector.KVPlugConnector`."""

    def __init__(self, config: ConnectorConfig, ident: Identity,
                 layout: GroupLayout | None = None, runtime: Runtime = THREADS) -> None:
        self.cfg = config
        self.runtime = runtime  # threads, events and clock (kvplug.runtime; a simulation's)
        self.ident = ident
        self.layout = layout or GroupLayout()  # KV cache groups (..protocol.groups)
        self.stats = StatsRecorder()
        self._reports = LoadReports(config, ident.rank, self.layout, self.stats)
        self.kv: PagedKV | None = None
        self.storage: StorageManager | None = None
        self.service: LookupService | None = None
        self.manage: ManageService | None = None
        self.kv_dtype = ""
        self._pins: dict[str, tuple[list[CacheKey], list[str]]] = {}
        self._lock = threading.Lock()
        #: the loads and stores, once there is a KV cache (.transfers)
        self.transfers: Transfers | None = None
        #: the weights epoch of the step under way (the scheduler's, from each step's metadata)
        self.epoch = ""
        self.on_epoch: Callable[[], None] | None = None  # told when the epoch changes
        self._asleep = False  # vLLM 0.33 sleep mode: the KV memory is gone until resume()
        #: samples the tiers' bytes per tenant on a thread of its own (asking a tier may wait on
        #: it: never on vLLM's step), woken by each step's ``take_stats``
        self._tenant_sampler: Any = None
        self._kv_caches: Mapping[str, torch.Tensor] = {}

    # -- setup ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if not self.layout.servable:  # the scheduler side never loads nor stores then
            logger.warning("%s", self.layout.unsupported_message())
            return
        self._kv_caches = dict(kv_caches)
        self.kv = PagedKV.from_kv_caches(kv_caches, self.layout.num_blocks or None)
        self.kv_dtype = str(self.kv.kv_dtype).removeprefix("torch.")
        block_size = self.layout.block_size or 1  # unknown: a chunk of single-token pages bounds it
        self.storage = StorageManager(self.cfg, runtime=self.runtime, geometry=ChunkGeometry(
            self.kv.num_layers, -(-self.cfg.chunk_size // block_size), self.kv.page_bytes,
            self.cfg.chunk_size))  # reads of any other shape are refused before allocating
        parts = TransferParts(self.kv, self.storage, self.layout, self.key)
        loads = Loads(parts, self.cfg.layerwise, self._reports,
                      BackgroundLoads(self.storage.batched_get_where, runtime=self.runtime),
                      self.pinned, self.release, self.cfg.in_step_load_deadline_s)
        saves = (AsyncSaves(self.kv, self.storage, self.stats, self.runtime,
                            order_at_enqueue=self.layout.zeroes_new_blocks)
                 if async_save_enabled(self.cfg, self.kv.device.type) else None)
        self.transfers = Transfers(loads, Stores(parts, self.stats, saves))
        self.transfers.warm_up()
        self._tenant_sampler = self.runtime.ticker(self._sample_tenants, TENANT_SAMPLE_S,
                                                   "kvplug-tenant-stats")
        path = socket_path(self.ident.engine_id, self.ident.rank, self.ident.pp_rank)
        if self.runtime.remote_lookups:  # else the caller calls _on_lookup (a simulation)
            self.service = LookupService(path, self._on_lookup, self.release)
            # the API server's lookup/clear/status calls, on a thread of their own (.management)
            self.manage = ManageService(manage_path(self.ident.engine_id, self.ident.rank,
                                                    self.ident.pp_rank), WorkerManagement(self))
        logger.info("kvplug worker rank %d: %d layers x %d blocks x %d B pages (%s, %s), "
                    "mode %s, lookup at %s", self.ident.rank, self.kv.num_layers,
                    self.kv.num_blocks, self.kv.page_bytes, self.kv_dtype, self.ident.layout,
                    "layer-wise" if self.cfg.layerwise else "bulk", path)

    def suspend(self) -> None:
        """vLLM 0.33 sleep (``unregister_kv_caches``): the KV memory goes next. This step's load
        ends and every asynchronous save's copy is done reading its blocks first; background
        fetches touch no block until ``get_finished``. Idempotent."""
        if self.kv is None or self._asleep:
            return
        if self.transfers is not None:
            self.transfers.wait_idle()
        self._asleep = True
        logger.info("kvplug worker rank %d: KV cache unregistered (sleep)", self.ident.rank)

    def resume(self) -> None:
        """vLLM 0.33 wake-up (``restore_kv_caches``): check that the KV tensors are where and
        what they were (same layers, blocks, page size, addresses); refuse to move bytes into
        memory that moved. Idempotent."""
        if self.kv is None or not self._asleep:
            return
        now = PagedKV.from_kv_caches(self._kv_caches)
        old = self.kv
        was = [(v.data_ptr(), tuple(v.shape)) for v in old.views]
        got = [(v.data_ptr(), tuple(v.shape)) for v in now.views]
        if was != got or now.kv_dtype != old.kv_dtype:
            raise RuntimeError(
                f"kvplug: the KV cache changed across sleep ({len(was)} layers of "
                f"{old.num_blocks} x {old.page_bytes} B {old.kv_dtype} at {hex(was[0][0])} before, "
                f"{len(got)} of {now.num_blocks} x {now.page_bytes} B {now.kv_dtype} at "
                f"{hex(got[0][0])} after); kvplug needs it at the same addresses: restart the "
                "engine, or report this with the vLLM version")
        self._asleep = False
        logger.info("kvplug worker rank %d: KV cache restored after sleep (%d layers checked)",
                    self.ident.rank, len(got))

    def key(self, chunk_hash: bytes, epoch: str | None = None, tenant: str = "") -> CacheKey:
        """A chunk's key under ``epoch`` (default: the current step's), for ``tenant`` (the id
        the scheduler sent with the request)."""
        return self.ident.key(self.kv_dtype, chunk_hash, self.epoch if epoch is None else epoch,
                              tenant)

    def of_current_epoch(self, key: CacheKey) -> bool:
        """Whether ``key`` is keyed under the current weights epoch (as :meth:`key` makes
        them)."""
        return key.model_digest == self.key(key.chunk_hash).model_digest

    def sync_epoch(self, metadata: KVPlugMetadata | None) -> None:
        """Switch to the step's weights epoch before anything else of the step: the scheduler
        drew a new one (the weights changed). L1 (this engine's own memory) is emptied; shared
        and persistent tiers keep the old entries for engines still on the old weights."""
        if metadata is None or metadata.epoch == self.epoch:
            return
        old, self.epoch = self.epoch, metadata.epoch  # (counted once, by the scheduler side)
        if self.transfers is not None:  # a background load planned before fails (recomputed)
            self.transfers.loads.epoch = self.epoch
        freed = 0
        if self.storage is not None:
            mine = [t for t in self.storage.tier_names if self.storage.never_blocks(t)]
            if mine:
                freed = self.storage.evict(nbytes=1 << 62, tiers=mine)
        if self.on_epoch is not None:
            self.on_epoch()
        logger.info("kvplug worker rank %d: weights epoch %s -> %s; L1 emptied (%d bytes)",
                    self.ident.rank, old or "(weights on disk)", self.epoch, freed)

    @property
    def _background(self) -> BackgroundLoads | None:
        """The loads vLLM waits for asynchronously (tests, the simulation and benchmarks
        inspect them)."""
        return self.transfers.loads.background if self.transfers is not None else None

    @property
    def _saves(self) -> AsyncSaves | None:
        """The asynchronous saves (tests and the simulation inspect them)."""
        return self.transfers.stores.saves if self.transfers is not None else None

    def close(self) -> None:
        if self._tenant_sampler is not None:
            self._tenant_sampler.close(timeout=5)
            self._tenant_sampler = None
        if self.transfers is not None:
            self.transfers.close()  # before the tiers: the saves' puts finish first
        if self.service is not None:
            self.service.close()
            self.service = None
        if self.manage is not None:
            self.manage.close()
            self.manage = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    # -- lookup (service thread) ---------------------------------------------------------------
    def _on_lookup(self, msg: Lookup) -> tuple[int, list[int], list[int]]:
        """The stored leading tokens, which of the hit's chunks only a tier that may block holds
        (the scheduler loads those asynchronously), and which of those only a local medium
        holds (loaded in the step while they fit its ``in_step_load_bytes``)."""
        assert self.storage is not None
        self.release([msg.req_id])  # a repeated lookup replaces the earlier pins
        key = partial(self.key, epoch=msg.epoch,  # the scheduler's epoch, even mid-step
                      tenant=msg.tenant)
        if self.layout.multi:
            return self._lookup_groups(msg, key)
        keys = [key(h) for h in msg.hashes]
        if self.transfers is not None:  # an asynchronous save of these chunks: let its put end
            self.transfers.wait_puts(keys + [key(h) for _, h in msg.tails],
                                     timeout=self.cfg.lookup_timeout_s / 2)
        found = self.storage.lookup_prefix(keys, pin=msg.pin, fresh=msg.fresh)
        pinned, tiers = keys[: found.num_chunks], list(found.tiers)
        tokens = found.num_chunks * self.cfg.chunk_size
        if found.num_chunks == len(keys):
            for end, h in msg.tails:
                k = key(h)
                tail = self.storage.lookup_prefix([k], pin=msg.pin, fresh=msg.fresh)
                if tail.num_chunks:
                    pinned.append(k)
                    tiers.extend(tail.tiers)
                    tokens = end
                    break
        if msg.pin and pinned:
            with self._lock:
                self._pins[msg.req_id] = (pinned, tiers)
        return (tokens, *self._slow_and_local(list(enumerate(tiers))))

    def _slow_and_local(self, chunk_tiers: list[tuple[int, str]]) -> tuple[list[int], list[int]]:
        """Of ``(chunk index, tier that holds it)``: the chunks on a tier that may block and is no
        local medium, and those on a local medium (both sorted, without repeats)."""
        storage = self.storage
        assert storage is not None
        slow, local = set(), set()
        for chunk, tier in chunk_tiers:
            if not storage.never_blocks(tier):
                (local if storage.local_medium(tier) else slow).add(chunk)
        return sorted(slow), sorted(local - slow)

    def _lookup_groups(self, msg: Lookup, key: Callable[[bytes], CacheKey]
                       ) -> tuple[int, list[int], list[int]]:
        """:meth:`_on_lookup` for several KV cache groups (:func:`..protocol.groups.lookup_groups`)."""
        storage = self.storage
        assert storage is not None

        def contains(keys: list[CacheKey]) -> tuple[int, list[str]]:
            found = storage.lookup_prefix(keys, pin=msg.pin, fresh=msg.fresh)
            return found.num_chunks, list(found.tiers)

        hit = lookup_groups(self.layout, key, contains, msg.hashes, msg.tails,
                            self.cfg.chunk_size, self.layout.block_size)
        if msg.pin and hit.pinned:
            with self._lock:
                self._pins[msg.req_id] = (hit.pinned, hit.tiers)
        return (hit.tokens, *self._slow_and_local(list(zip(hit.chunk_of, hit.tiers, strict=False))))

    def release(self, req_ids: list[str] | set[str]) -> None:
        """Drop the pins lookup took for these requests."""
        if self.storage is None:
            return
        for req_id in req_ids:
            with self._lock:
                held = self._pins.pop(req_id, None)
            if held:
                self.storage.unpin(*held)

    def pinned(self, req_id: str) -> dict[CacheKey, str]:
        """The tier each key of ``req_id``'s last lookup on this rank was found (and pinned) in.
        With TP > 1 the hit is the minimum over ranks, so a load may name a key (a shorter
        partial chunk) this rank never pinned: not in the answer."""
        with self._lock:
            keys, tiers = self._pins.get(req_id, ([], []))
        return dict(zip(keys, tiers, strict=False))

    def bind(self, metadata: KVPlugMetadata | None) -> None:
        """vLLM bound the coming step's metadata (before its forward, before any ``get_finished``
        of the step): the saves it names are expected, and the unwritten blocks it reads are this
        step's load errors and taint it like a failed load (:meth:`.transfers.Transfers.expect`)."""
        if metadata is None:
            return
        if self.transfers is not None:
            self.transfers.expect(metadata)
        elif metadata.unwritten:  # no KV cache: no request to store again, nothing stored
            self._reports.record(UnwrittenRead(tuple(metadata.unwritten)))

    # -- transfers: loads and stores, see .transfers ----------------------------------------------
    def start_load_kv(self, metadata: KVPlugMetadata | None) -> None:
        self.sync_epoch(metadata)
        if self.transfers is not None:
            self.transfers.submit(Load(metadata))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.transfers is not None:
            self.transfers.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, metadata: KVPlugMetadata | None) -> None:
        """Layer-wise mode: copy this layer of every chunk to store, right after it is computed."""
        if self.cfg.layerwise and metadata is not None and self.transfers is not None:
            self.sync_epoch(metadata)
            self.transfers.submit(Store(metadata, layer=layer_name))

    def wait_for_save(self, metadata: KVPlugMetadata | None) -> None:
        self.sync_epoch(metadata)
        if self.transfers is not None:
            self.transfers.submit(Store(metadata))

    def get_finished(self, finished: set[str] | frozenset[str] = frozenset(),
                     idle: bool = False, pause: bool = False) -> tuple[set[str], set[str]]:
        """vLLM's ``get_finished``: (``finished_sending``, ``finished_recving``). Sending: finished
        requests whose last save is over (asynchronous saves: every finished request that had a
        save, once no copy reads its blocks; ``finished``: the requests vLLM finished since the
        last step). Receiving: background loads that are over. Drops finished requests' pins.
        ``idle``: the step ran no forward (a short wait for a fetch, see
        :meth:`.load.BackgroundLoads.wait_idle`). ``pause``: requests wait for chunks a
        producer named (:mod:`..scheduler.handoff`): an idle step that reports nothing waits
        :data:`HANDOFF_PAUSE_S`, so vLLM does not run empty steps back to back meanwhile (they
        hold a core, and in-process the GIL the tiers' threads need)."""
        if self.transfers is None:
            return set(), set()
        try:
            done = self.transfers.finished(finished, idle)
            if pause and not done.sending and not done.recving:
                self.runtime.event().wait(HANDOFF_PAUSE_S)
            return tuple(done)  # type: ignore[return-value]
        finally:
            self.release(finished)

    def handle_preemptions(self, metadata: KVPlugMetadata | None) -> None:
        """Before every step, which may rewrite blocks vLLM freed (preempted requests', and
        sliding-window blocks that left the window): order it after the asynchronous copies
        that read them."""
        if self.transfers is not None:
            self.transfers.wait_freed(metadata.preempted if metadata is not None else ())

    def take_report(self) -> KVPlugWorkerMeta | None:
        """Per-request load results since the last call (for the scheduler)."""
        return self._reports.take_report()

    def take_stats(self) -> KVPlugStats | None:
        """This step's counters, with what the tiers' own counters grew by since the last step
        (the bytes per tenant are sampled off the step: :meth:`_sample_tenants`)."""
        if self.storage is not None:
            self.stats.sample_tiers(self.storage.stats())
        if self._tenant_sampler is not None:
            self._tenant_sampler.wake()
        return self.stats.take()

    def _sample_tenants(self) -> None:
        """The tiers' bytes per tenant into the stats (at most every ``TENANT_SAMPLE_S``), on the
        sampler's thread: a tier that may block answers through its pool, within its timeout."""
        storage = self.storage
        if storage is None:
            return
        try:
            self.stats.sample_tenants(storage)
        except Exception:  # noqa: BLE001 - a gauge; the next sample tries again
            logger.exception("kvplug worker rank %d: sampling the tiers' bytes per tenant failed",
                             self.ident.rank)

    def take_failed(self) -> set[str]:
        """Requests whose load failed (several KV cache groups: vLLM's ``failed_recving``)."""
        return self._reports.take_failed()

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        return self._reports.take_load_errors()
