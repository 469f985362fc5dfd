"""The ``local_cpu`` tier (L1): chunks kept in a host memory pool, evicted by byte capacity in the
order of its eviction policy (``eviction: {policy: lru}`` by default, or ``s3fifo``...:
:mod:`kvplug.policyspecs`).

It owns the pool every other tier reads into, so a disk or remote hit promoted here costs no copy.
It never evicts an entry that is pinned (a lookup promised it to a request) or that a reader still
holds (the object's reference count is above the cache's own one). When nothing can be evicted a
store is skipped and counted; it never blocks and never raises into the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Sequence

import torch
from kvplug.config import BaseOptions
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.logs import LogOnce
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.pins import PinCounts
from kvplug.policies.eviction import LRUEviction
from kvplug.policyspecs import PolicyContext
from kvplug.pool import HostMemoryPool
from pydantic import ByteSize, ConfigDict, Field

logger = logging.getLogger("kvplug.backends.local_cpu")


class LocalCPUBackend:
    """L1: memory objects over one preallocated host buffer, evicted by its eviction policy."""

    #: Every hook is a few dict operations under a lock: called on the caller's thread, never
    #: through a pool.
    never_blocks = True
    #: Victims are chosen by ``ctx.eviction`` (the tier's ``eviction`` setting).
    eviction_policy = True
    #: ``kvplug bench`` has no raw row for it (:mod:`kvplug.bench_raw`)
    bench_no_raw = "local_cpu is memory itself: there is no medium under it"

    class Options(BaseOptions):
        model_config = ConfigDict(extra="forbid")
        capacity: ByteSize = Field(default=ByteSize(2 << 30), description="pool size, e.g. 2GiB")
        pin_memory: bool | None = Field(
            default=None, description="page-lock the pool (default: when CUDA is present)"
        )
        prefault: bool = Field(
            default=True, description="back the pool's pages ahead of use, in the background, so "
            "stores never page-fault inside vLLM's step (the pool becomes resident as it fills)"
        )

    def __init__(self, ctx: TierContext) -> None:
        opts: LocalCPUBackend.Options = ctx.options
        self.name = ctx.name
        self.pool = HostMemoryPool(int(opts.capacity), pin_memory=opts.pin_memory,
                                   prefault=opts.prefault, runtime=ctx.runtime)
        self.capacity = self.pool.capacity
        self._entries: dict[CacheKey, MemoryObj] = {}
        #: orders the entries (called under ``_lock``); LRU when built without a config
        self._policy = ctx.eviction if ctx.eviction is not None \
            else LRUEviction(PolicyContext(ctx.name, {}))
        self._pins: PinCounts[CacheKey] = PinCounts()
        #: an operator's pins (``kvplug cache pin``): key -> its bytes (each also one count in
        #: ``_pins``, so nothing else needs to know them)
        self._operator_pins: dict[CacheKey, int] = {}
        self._max_pinned = ctx.max_pinned_fraction
        self._bytes = 0
        self._lock = threading.RLock()
        #: per-tenant byte quotas (the tier's ``quotas``), and each tenant's bytes here
        self._quotas = ctx.quotas
        self._tenant_bytes: dict[str, int] = {}
        self._quota_skipped = 0
        self._quota_evictions = 0
        self._skipped_puts = 0
        self._alloc_failures = 0
        self._evictions = 0
        self._log_once = LogOnce(logger)

    # -- eviction -------------------------------------------------------------------------------
    def _evictable(self, key: Hashable) -> bool:
        obj = self._entries.get(key)  # type: ignore[call-overload]
        return obj is not None and key not in self._pins and obj.ref_count == 1

    def _drop(self, key: CacheKey) -> int:
        obj = self._entries.pop(key)
        self._policy.remove(key=key)
        self._pins.discard(key)
        self._bytes -= obj.nbytes
        left = self._tenant_bytes.get(key.tenant, 0) - obj.nbytes
        if left > 0:
            self._tenant_bytes[key.tenant] = left
        else:
            self._tenant_bytes.pop(key.tenant, None)
        self._evictions += 1
        obj.ref_down()
        return obj.nbytes

    def _evict(self, nbytes: int) -> int:
        """Drop the policy's victims for ``nbytes`` (at least one entry); the bytes freed, 0 if
        nothing may be evicted."""
        freed = 0
        for key in self._policy.victims(nbytes=max(1, nbytes), evictable=self._evictable):
            if self._evictable(key):  # a policy that returns a kept entry is not obeyed
                freed += self._drop(key)  # type: ignore[arg-type]
            elif key in self._entries:
                self._policy.insert(key=key, nbytes=self._entries[key].nbytes)  # type: ignore[index]
        return freed

    def _within_quota(self, key: CacheKey, size: int) -> bool:
        """Room for ``size`` more bytes of ``key``'s tenant under its quota, after evicting that
        tenant's own entries (in the policy's order) if it needs to; False if it cannot."""
        limit = self._quotas.limit(key.tenant)
        if limit is None:
            return True
        over = self._tenant_bytes.get(key.tenant, 0) + size - limit
        if over <= 0:
            return True
        if size > limit:
            return False
        tenant = key.tenant

        def own(k: Hashable) -> bool:
            return getattr(k, "tenant", None) == tenant and self._evictable(k)

        freed = 0
        for victim in self._policy.victims(nbytes=over, evictable=own):
            if own(victim):
                freed += self._drop(victim)  # type: ignore[arg-type]
                self._quota_evictions += 1
            elif victim in self._entries:
                self._policy.insert(key=victim, nbytes=self._entries[victim].nbytes)  # type: ignore[index]
        return freed >= over

    @hookimpl
    def tenant_usage(self) -> dict[str, int]:
        """Bytes held per tenant id (``""``: chunks without a tenant)."""
        with self._lock:
            return dict(self._tenant_bytes)

    @hookimpl
    def evict_tenant(self, tenant: str) -> list[int]:
        with self._lock:
            mine = [k for k in self._entries if k.tenant == tenant]
            gone = [k for k in mine if self._evictable(k)]
            for key in gone:
                self._drop(key)
            return [len(gone), len(mine) - len(gone)]

    def _evict_one(self) -> int:
        """Drop the policy's next victim; 0 if nothing may be evicted."""
        return self._evict(1)

    def _warn_full(self, what: str) -> None:
        self._log_once("full", "tier %r is full of pinned or in-use chunks (%d bytes); %s "
                       "skipped — further skips are counted in stats", self.name, self._bytes, what)

    # -- hooks ----------------------------------------------------------------------------------
    @hookimpl
    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat, num_tokens: int
    ) -> MemoryObj | None:
        with self._lock:
            while True:
                obj = self.pool.allocate(shape, dtype, fmt, num_tokens)
                if obj is not None:
                    return obj
                if not self._evict_one():
                    self._alloc_failures += 1
                    self._warn_full("an allocation was")
                    return None

    @hookimpl
    def memory_regions(self) -> list[tuple[int, int]]:
        buf = self.pool.buffer
        return [(buf.data_ptr(), self.pool.capacity)]

    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        with self._lock:
            for key, obj in zip(keys, objs):
                if key in self._entries:
                    self._policy.access(key=key)
                    continue
                size = obj.nbytes
                if self._quotas is not None and not self._within_quota(key, size):
                    self._quota_skipped += 1
                    self._log_once("quota", "a tenant's chunks fill its quota on tier %r with "
                                   "pinned or in-use entries; its store was skipped — further "
                                   "skips are counted in stats (quota_skipped_puts)", self.name)
                    continue
                while self._bytes + size > self.capacity and size <= self.capacity \
                        and self._evict(self._bytes + size - self.capacity):
                    pass
                if self._bytes + size > self.capacity:
                    self._skipped_puts += 1
                    self._warn_full("a store was")
                    continue
                self._entries[key] = obj.ref_up()
                self._policy.insert(key=key, nbytes=size)
                self._bytes += size
                self._tenant_bytes[key.tenant] = self._tenant_bytes.get(key.tenant, 0) + size

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                return None
            self._policy.access(key=key)
            return obj.ref_up()

    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        with self._lock:
            found = [k in self._entries for k in keys]
            if pin:
                self._pins.pin_all(key for key, hit in zip(keys, found) if hit)
            return found

    @hookimpl
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        with self._lock:
            self._pins.unpin_all(keys)

    @hookimpl
    def operator_pin(self, keys: Sequence[CacheKey]) -> list[str]:
        with self._lock:
            out = []
            held = sum(self._operator_pins.values())
            for key in keys:
                obj = self._entries.get(key)
                if key in self._operator_pins:
                    out.append("pinned")
                elif obj is None:
                    out.append("absent")
                elif held + obj.nbytes > self._max_pinned * self.capacity:
                    out.append("over_limit")
                else:
                    self._pins.pin(key)
                    self._operator_pins[key] = obj.nbytes
                    held += obj.nbytes
                    out.append("pinned")
            return out

    @hookimpl
    def operator_unpin(self, keys: Sequence[CacheKey]) -> list[bool]:
        with self._lock:
            out = []
            for key in keys:
                held = self._operator_pins.pop(key, None) is not None
                if held:
                    self._pins.unpin(key)
                out.append(held)
            return out

    @hookimpl
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        freed = 0
        with self._lock:
            if keys is not None:
                for key in keys:
                    if self._evictable(key):
                        freed += self._drop(key)
                return freed
            while freed < nbytes:
                got = self._evict(nbytes - freed)
                if not got:
                    break
                freed += got
        return freed

    @hookimpl
    def stats(self) -> dict[str, float]:
        with self._lock:
            pool = self.pool.stats()
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "capacity": self.capacity,
                "pinned": len(self._pins),
                "operator_pinned": len(self._operator_pins),
                "operator_pinned_bytes": sum(self._operator_pins.values()),
                "skipped_puts": self._skipped_puts,
                "alloc_failures": self._alloc_failures,
                "evictions": self._evictions,
                "tenants": len(self._tenant_bytes),
                "quota_skipped_puts": self._quota_skipped,
                "quota_evictions": self._quota_evictions,
                "pool_used": pool.used,
                "pool_fragmentation": pool.fragmentation,
                **{f"eviction_{k}": v for k, v in self._policy_stats().items()},
            }

    def _policy_stats(self) -> dict[str, float]:
        stats = getattr(self._policy, "stats", None)
        return dict(stats() or {}) if callable(stats) else {}

    @hookimpl
    def close(self) -> None:
        with self._lock:
            for key, obj in self._entries.items():
                self._policy.remove(key=key)
                obj.ref_down()
            self._entries.clear()
            self._pins.clear()
            self._operator_pins.clear()
            self._bytes = 0
            self._tenant_bytes.clear()
        self.pool.close()  # its background backing stops: no thread outlives the tier
