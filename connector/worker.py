"""Worker-side transfers: pages between vLLM's paged KV cache and the kvplug tiers.

Runs in each vLLM worker process (one per TP rank). It owns the StorageManager (so L1 lives next
to the KV cache), the lookup service the scheduler asks, and the pins lookup takes. Two modes:

* bulk: ``start_load_kv`` writes every loaded chunk before the forward pass; ``wait_for_save``
  copies every chunk to store after it;
* layer-wise (``layerwise: true``): loads are released layer by layer in ``wait_for_layer_load``
  and stores copied layer by layer in ``save_kv_layer`` (kvplug.gpu's generators).

Every chunk is verified (present, shape, token count) *before* any of its bytes reach a block; a
chunk that fails makes it and everything after it in that request a load error, reported through
``get_block_ids_with_load_errors`` so vLLM recomputes those blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from kvplug.config import KVPlugConfig
from kvplug.gpu import PagedKV, layerwise_load, layerwise_store, scatter_many
from kvplug.gpu import gather_many as gpu_gather_many
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.storage_manager import StorageManager

from .lookup import Lookup, LookupService, socket_path
from .metadata import KVPlugMetadata, KVPlugWorkerMeta, ReqMeta
from .stats import TIER_PREFIX, StatsRecorder

logger = logging.getLogger("kvplug.connector")

#: Test-only: ``fn(src) -> src`` applied to every chunk's pages right before they are written to
#: blocks (used to prove the exactness tests can fail). Never set in production.
LoadHook = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Identity:
    """The key fields every chunk of this worker carries (except the hash)."""

    model: str
    layout: str  # e.g. "LBHNC-bs128"
    world_size: int
    rank: int
    engine_id: str


@dataclass
class _StoreBatch:
    keys: list[CacheKey] = field(default_factory=list)
    objs: list[MemoryObj] = field(default_factory=list)
    jobs: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    tokens: int = 0


class WorkerSide:
    """The worker half of :class:`~kvplug.connector.KVPlugConnector`."""

    def __init__(self, config: KVPlugConfig, ident: _Identity, load_hook: LoadHook | None = None
                 ) -> None:
        self.cfg = config
        self.ident = ident
        self.load_hook = load_hook
        self.stats = StatsRecorder()
        self.kv: PagedKV | None = None
        self.storage: StorageManager | None = None
        self.service: LookupService | None = None
        self.kv_dtype = ""
        self._pins: dict[str, tuple[list[CacheKey], list[str]]] = {}
        self._lock = threading.Lock()
        self._errors: set[int] = set()
        self._report = KVPlugWorkerMeta()
        self._load_steps = None  # layer-wise load generator of this step
        self._load_next = 0
        self._load_objs: list[MemoryObj] = []
        self._store: _StoreBatch | None = None  # layer-wise store of this step
        self._store_steps = None
        self._store_next = 0

    # -- setup ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.kv = PagedKV.from_kv_caches(kv_caches)
        self.kv_dtype = str(self.kv.kv_dtype).removeprefix("torch.")
        self.storage = StorageManager(self.cfg)
        path = socket_path(self.ident.engine_id, self.ident.rank)
        self.service = LookupService(path, self._on_lookup, self.release)
        logger.info("kvplug worker rank %d: %d layers x %d blocks x %d B pages (%s, %s), "
                    "mode %s, lookup at %s", self.ident.rank, self.kv.num_layers,
                    self.kv.num_blocks, self.kv.page_bytes, self.kv_dtype, self.ident.layout,
                    "layer-wise" if self.cfg.layerwise else "bulk", path)

    def key(self, chunk_hash: bytes) -> CacheKey:
        i = self.ident
        return CacheKey(i.model, self.kv_dtype, i.layout, i.world_size, i.rank, chunk_hash)

    def close(self) -> None:
        self._finish_load()
        if self.service is not None:
            self.service.close()
            self.service = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    # -- lookup (service thread) ---------------------------------------------------------------
    def _on_lookup(self, msg: Lookup) -> int:
        assert self.storage is not None
        self.release([msg.req_id])  # a repeated lookup replaces the earlier pins
        keys = [self.key(h) for h in msg.hashes]
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
        return tokens

    def release(self, req_ids: list[str] | set[str]) -> None:
        """Drop the pins lookup took for these requests."""
        if self.storage is None:
            return
        for req_id in req_ids:
            with self._lock:
                held = self._pins.pop(req_id, None)
            if held:
                self.storage.unpin(*held)

    def _tier_of(self, req_id: str) -> dict[CacheKey, str]:
        with self._lock:
            keys, tiers = self._pins.get(req_id, ([], []))
        return dict(zip(keys, tiers, strict=False))

    # -- load ----------------------------------------------------------------------------------
    def start_load_kv(self, md: KVPlugMetadata | None) -> None:
        self._finish_load()
        if md is None or self.kv is None:
            return
        jobs: list[tuple[torch.Tensor, list[int]]] = []
        objs: list[MemoryObj] = []
        for r in md.requests:
            if r.load is not None:
                self._load_request(md, r, jobs, objs)
        if not jobs:
            for o in objs:
                o.ref_down()
            return
        if self.cfg.layerwise:
            self._load_steps = layerwise_load(self.kv, jobs)
            self._load_next, self._load_objs = 0, objs
        else:
            try:
                scatter_many(self.kv, jobs)
            finally:
                for o in objs:
                    o.ref_down()

    def _load_request(self, md: KVPlugMetadata, r: ReqMeta, jobs: list, objs: list) -> None:
        assert self.storage is not None and self.kv is not None and r.load is not None
        spec, bs = r.load, md.block_size
        t0 = time.perf_counter()
        tier_of = self._tier_of(r.req_id)
        keys = [self.key(h) for h in spec.hashes]
        try:
            got = self.storage.batched_get(keys)
        except Exception:
            logger.exception("kvplug load of %s failed", r.req_id)
            got = [None] * len(keys)
        loaded, nbytes, fail_at = 0, 0, None
        per_tier: dict[str, int] = {}
        for i, (key, obj) in enumerate(zip(keys, got, strict=True)):
            s, e = md.chunk_range(spec, i)
            nb = -(-(e - s) // bs)
            first = s // bs
            skip = max(0, spec.start // bs - first)  # blocks vLLM already holds
            if fail_at is not None or not self._valid(obj, nb, e - s) \
                    or len(r.block_ids) < first + nb:
                fail_at = s if fail_at is None else fail_at
                if obj is not None:
                    obj.ref_down()
                continue
            objs.append(obj)
            if skip >= nb:
                continue
            src = obj.tensor[:, skip:nb]
            if self.load_hook is not None:
                src = self.load_hook(src)
            jobs.append((src, r.block_ids[first + skip: first + nb]))
            n = e - max(s, spec.start)
            loaded += n
            nbytes += src.numel()
            tier = tier_of.get(key, "unknown")
            per_tier[tier] = per_tier.get(tier, 0) + n
        self.release([r.req_id])  # loaded (or failed): the pins have done their job
        if fail_at is not None:
            bad = set(r.block_ids[max(fail_at, spec.start) // bs: -(-spec.end // bs)])
            self._errors |= bad
            self.stats.add("load_failures")
            self.stats.add("failed_blocks", len(bad))
            logger.warning("kvplug: request %s: chunk at token %d is missing or invalid; %d "
                           "blocks (tokens %d-%d) will be recomputed", r.req_id, fail_at,
                           len(bad), max(fail_at, spec.start), spec.end)
        dt = time.perf_counter() - t0
        if fail_at is not None:
            self._report.failed_blocks[r.req_id] = len(bad)
        self._report.loaded[r.req_id] = per_tier
        self._report.load_ms[r.req_id] = dt * 1e3
        self.stats.add("loads")
        self.stats.add("load_tokens", loaded)
        self.stats.add("load_bytes", nbytes)
        self.stats.add("load_seconds", dt)
        for tier, n in per_tier.items():
            self.stats.add(TIER_PREFIX + tier, n)
        if self.cfg.log_every_load and loaded and self.ident.rank == 0:
            logger.info("kvplug: request %s loaded %d tokens (%s) in %.1f ms (%.2f GB/s)",
                        r.req_id, loaded, ", ".join(f"{n} from {t}" for t, n in per_tier.items()),
                        dt * 1e3, nbytes / dt / 1e9 if dt > 0 else 0.0)

    def _valid(self, obj: MemoryObj | None, num_blocks: int, num_tokens: int) -> bool:
        """A chunk may reach blocks only if it is exactly what this engine would have stored."""
        if obj is None or self.kv is None:
            return False
        t = obj.tensor
        return (obj.meta.fmt == MemoryFormat.KV_PAGES and t.dtype == torch.uint8
                and tuple(t.shape) == (self.kv.num_layers, num_blocks, self.kv.page_bytes)
                and obj.num_tokens == num_tokens)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load_steps is None or self.kv is None:
            return
        idx = self.kv.index_of(layer_name)
        while self._load_next <= idx:
            next(self._load_steps)
            self._load_next += 1

    def _finish_load(self) -> None:
        if self._load_steps is not None:
            for _ in self._load_steps:  # exhausting waits for every copy
                pass
            self._load_steps = None
        for o in self._load_objs:
            o.ref_down()
        self._load_objs = []

    def take_report(self) -> KVPlugWorkerMeta | None:
        """Per-request load results since the last call (for the scheduler)."""
        if not self._report:
            return None
        out, self._report = self._report, KVPlugWorkerMeta()
        return out

    def take_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    # -- store ---------------------------------------------------------------------------------
    def _prepare_store(self, md: KVPlugMetadata) -> _StoreBatch:
        assert self.storage is not None and self.kv is not None
        batch = _StoreBatch()
        bs = md.block_size
        for r in md.requests:
            spec = r.save
            if spec is None:
                continue
            for i, h in enumerate(spec.hashes):
                s, e = md.chunk_range(spec, i)
                nb = -(-(e - s) // bs)
                ids = r.block_ids[s // bs: s // bs + nb]
                if len(ids) < nb:
                    break
                obj = self.storage.allocate((self.kv.num_layers, nb, self.kv.page_bytes),
                                            num_tokens=e - s)
                if obj is None:  # every tier with memory is full: store what we have
                    self.stats.add("store_failures")
                    break
                batch.keys.append(self.key(h))
                batch.objs.append(obj)
                batch.jobs.append((ids, obj.tensor))
                batch.tokens += e - s
        return batch

    def save_kv_layer(self, layer_name: str, md: KVPlugMetadata | None) -> None:
        """Layer-wise mode: copy this layer of every chunk to store, right after it is computed."""
        if not self.cfg.layerwise or md is None or self.kv is None:
            return
        if self._store is None:
            self._store = self._prepare_store(md)
            self._store_next = 0
            self._store_steps = (layerwise_store(self.kv, self._store.jobs)
                                 if self._store.jobs else None)
        if self._store_steps is None:
            return
        idx = self.kv.index_of(layer_name)
        while self._store_next <= idx:
            next(self._store_steps)
            self._store_next += 1

    def wait_for_save(self, md: KVPlugMetadata | None) -> None:
        self._finish_load()
        if md is None or self.kv is None:
            return
        t0 = time.perf_counter()
        batch, steps = self._store, self._store_steps
        self._store, self._store_steps = None, None
        try:
            if batch is None:  # bulk mode (or a step whose layers never ran)
                batch = self._prepare_store(md)
                if batch.jobs:
                    gpu_gather_many(self.kv, batch.jobs)
            elif steps is not None:
                for _ in steps:
                    pass
            if batch.keys:
                assert self.storage is not None
                self.storage.batched_put(batch.keys, batch.objs)
                self.stats.add("stores", 1)
                self.stats.add("store_tokens", batch.tokens)
                self.stats.add("store_bytes", sum(o.nbytes for o in batch.objs))
                self.stats.add("store_seconds", time.perf_counter() - t0)
        except Exception:
            self.stats.add("store_failures")
            logger.exception("kvplug store failed; the chunks are not cached")
        finally:
            for o in batch.objs if batch else ():
                o.ref_down()
