"""``{{ cookiecutter.backend_name }}``: a bounded in-memory store of chunks, LRU-evicted by bytes.

It already honours the whole kvplug contract (``kvplug.hookspecs``), so the package works before
you write a line. Replace the dict with your storage (a service, a device, a file system) hook by
hook; ``pytest`` runs kvplug's conformance suite against it after every change.

What the contract asks, and how this store answers:

* ``batched_submit_put`` must not block on I/O: it copies the bytes (a memcpy, no I/O) and returns.
  A slow store would queue the objects (``obj.ref_up()``) for a writer thread and ``ref_down()``
  each one when written.
* ``get`` returns memory the caller owns: it takes a fresh object from ``ctx.allocate`` (the
  fastest tier's pool, so promotion into L1 is free), fills it and returns it. A checksum mismatch
  is a miss.
* ``contains(pin=True)`` pins hits; pinned entries are never evicted until ``unpin``.
* Capacity is in bytes; stats report ``bytes`` so kvplug (and its tests) can check the bound.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvplug.config import BaseOptions
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
{%- if cookiecutter.owns_allocator == "yes" %}
from kvplug.memory import MemoryFormat, MemoryObj, MemoryObjMeta
from kvplug.pool import HostMemoryPool
{%- else %}
from kvplug.memory import MemoryObj, MemoryObjMeta
{%- endif %}
from pydantic import ByteSize, Field

logger = logging.getLogger("{{ cookiecutter.__module_name }}")


@dataclass
class _Entry:
    data: torch.Tensor  # flat uint8 copy of the chunk
    meta: MemoryObjMeta  # shape, dtype, format, token count
    checksum: int  # crc32 of data, checked on every read


def _crc(data: torch.Tensor) -> int:
    return zlib.crc32(data.numpy())


class {{ cookiecutter.__class_name }}:
    """The ``{{ cookiecutter.backend_name }}`` tier: chunks kept as private byte copies, LRU by bytes."""

    class Options(BaseOptions):
        """What a tier config may put under ``options:`` (kvplug's base: unknown keys and booleans
        given for numbers are rejected, naming the key)."""

        capacity: ByteSize = Field(default=ByteSize(256 << 20), description="bytes kept, e.g. 1GiB")
{%- if cookiecutter.owns_allocator == "yes" %}
        pool_capacity: ByteSize = Field(
            default=ByteSize(64 << 20), description="host memory pool served by allocate"
        )
{%- endif %}

    def __init__(self, ctx: TierContext) -> None:
        opts = ctx.options
        self.name = ctx.name
        self.capacity = int(opts.capacity)
        self._allocate = ctx.allocate
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._pins: dict[CacheKey, int] = {}
        self._bytes = 0
        self._lock = threading.RLock()
        self._counters = {"evictions": 0, "skipped_puts": 0, "corrupt": 0, "alloc_failures": 0}
        self._warned: set[str] = set()
{%- if cookiecutter.owns_allocator == "yes" %}
        self.pool = HostMemoryPool(int(opts.pool_capacity))
{%- endif %}

    # -- helpers --------------------------------------------------------------------------------
    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("tier %r: " + message + " (further ones are counted in stats)",
                           self.name, *args)

    def _drop(self, key: CacheKey) -> int:
        entry = self._entries.pop(key)
        self._pins.pop(key, None)
        self._bytes -= entry.data.numel()
        return entry.data.numel()

    def _evict_lru(self) -> int:
        """Drop the least recently used unpinned entry; 0 when every entry is pinned."""
        for key in self._entries:
            if not self._pins.get(key):
                self._counters["evictions"] += 1
                return self._drop(key)
        return 0

    # -- hooks ----------------------------------------------------------------------------------
{%- if cookiecutter.owns_allocator == "yes" %}
    @hookimpl
    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat, num_tokens: int
    ) -> MemoryObj | None:
        """Memory from this tier's own pool; None when it is full (never blocks)."""
        obj = self.pool.allocate(shape, dtype, fmt, num_tokens)
        if obj is None:
            with self._lock:
                self._counters["alloc_failures"] += 1
        return obj
{% endif %}
    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """Copy each chunk in; make room by LRU eviction; skip (and count) what cannot fit."""
        for key, obj in zip(keys, objs, strict=True):
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
                    continue
            data = obj.byte_view.detach().to("cpu", copy=True).contiguous()
            entry = _Entry(data, obj.meta, _crc(data))
            size = data.numel()
            with self._lock:
                if key in self._entries:
                    continue
                while self._bytes + size > self.capacity and self._evict_lru():
                    pass
                if self._bytes + size > self.capacity:
                    self._counters["skipped_puts"] += 1
                    self._warn_once(
                        "full", "full of pinned entries (%d bytes); a store was skipped",
                        self._bytes,
                    )
                    continue
                self._entries[key] = entry
                self._bytes += size

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        """A fresh object (owned by the caller) holding the chunk, or None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        if _crc(entry.data) != entry.checksum:
            with self._lock:
                self._counters["corrupt"] += 1
                if self._entries.get(key) is entry:
                    self._drop(key)
            self._warn_once("corrupt", "entry %s failed its checksum and was dropped", key.hex)
            return None
        meta = entry.meta
        obj = self._allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:  # memory is full: a miss, never an error
            with self._lock:
                self._counters["alloc_failures"] += 1
            return None
        obj.byte_view.copy_(entry.data)
        return obj

    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        """One bool per key; with pin=True each hit is pinned until unpin."""
        with self._lock:
            found = [key in self._entries for key in keys]
            if pin:
                for key, hit in zip(keys, found, strict=True):
                    if hit:
                        self._pins[key] = self._pins.get(key, 0) + 1
            return found

    @hookimpl
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        """Release one pin per key; unknown keys are ignored."""
        with self._lock:
            for key in keys:
                count = self._pins.get(key, 0)
                if count > 1:
                    self._pins[key] = count - 1
                else:
                    self._pins.pop(key, None)

    @hookimpl
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        """Drop ``keys`` (pinned ones stay), or free ``nbytes`` in LRU order; bytes freed."""
        freed = 0
        with self._lock:
            if keys is not None:
                for key in keys:
                    if key in self._entries and not self._pins.get(key):
                        freed += self._drop(key)
                return freed
            while freed < nbytes:
                got = self._evict_lru()
                if not got:
                    break
                freed += got
        return freed

    @hookimpl
    def stats(self) -> dict[str, float]:
        """Counters for logs and metrics; ``bytes`` never exceeds ``capacity``."""
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "capacity": self.capacity,
                "pinned": len(self._pins),
                **self._counters,
            }

    @hookimpl
    def close(self) -> None:
        """Forget every entry (this store is memory only: nothing survives a restart)."""
        with self._lock:
            self._entries.clear()
            self._pins.clear()
            self._bytes = 0
