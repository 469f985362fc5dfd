{% if cookiecutter.store_kind == "key_value" -%}
"""``{{ cookiecutter.backend_name }}``: a kvplug tier over a key-value store.

What you write is ``{{ cookiecutter.__class_name }}IO``: your store's primitives (exists, get,
set many, delete, and the optional ones). The one declaration to read is
``kvplug.backends.common.value_io.ValueIO`` (kvplug's ``backends/common/value_io.py``): which
primitives are required and which optional, what each flag (``reads_into``, ``sized_reads``,
...) asks for, how a failed call is reported (raise: kvplug counts it and answers a miss) and
what kvplug verifies in the bytes you return (all of it).

Nothing else needs reading: kvplug's hooks (``sdk/hookspecs.py``) are implemented for you by
``ValueStoreTier``, the base of kvplug's own ``resp`` and ``mooncake`` tiers: chunks stored as
values in kvplug's chunk format, batched stores on writer threads, batched lookups, every layer's
checksum verified before a byte is returned, layer ranges, pins, an optional LRU ``capacity`` and
a circuit breaker that turns an outage into misses. ``{{ cookiecutter.__class_name }}.Options``
adds how to reach your store (here ``url``) to the options every such tier has (``prefix``,
``capacity``, ``timeout_s``, ``io_threads``, breaker settings); ``open_io`` builds your ``IO``.

Out of the box the "store" is an in-process dict per ``url`` (``_DictClient``), so the package
works and passes ``tests/test_backend.py`` (kvplug's conformance kit and its simulation) before
you write a line; replace it with your store's client and run ``python -m pytest``. Pass
credentials by environment variable name, never in the options (``Redactor`` keeps what is there
out of logs).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvplug.backends.common.breaker import CircuitBreaker
from kvplug.backends.common.value_io import ValueIO
from kvplug.backends.common.value_tier import ValueStoreOptions, ValueStoreTier
from kvplug.hookspecs import TierContext
from kvplug.redact import Redactor
from pydantic import Field


class _DictClient:
    """A stand-in for your store's client: one dict of values per ``url``, shared by every tier
    of this process that names it (as a server is shared by its clients)."""

    _stores: dict[str, dict[str, bytes]] = {}
    _stores_lock = threading.Lock()

    def __init__(self, url: str) -> None:
        with self._stores_lock:
            self.values = self._stores.setdefault(url, {})
        self.lock = threading.Lock()


class {{ cookiecutter.__class_name }}IO(ValueIO):
    """The store's primitives, as ``ValueIO`` declares them: the four required ones, plus
    ``_get_many`` (one batch call) and ``_get_range`` (layer ranges, for ``get_layers``). Each
    raises on a failed call; none retries (the breaker decides when to call again)."""

    def __init__(self, name: str, url: str, breaker: CircuitBreaker) -> None:
        super().__init__(name, breaker, Redactor(url, {}))
        self.client = _DictClient(url)

    def _exists(self, names: Sequence[str]) -> list[bool | None]:
        with self.client.lock:
            return [n in self.client.values for n in names]

    def _get(self, name: str) -> bytes | None:
        with self.client.lock:
            return self.client.values.get(name)

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        with self.client.lock:  # a real store: one pipeline or batch call for all of them
            return [self.client.values.get(n) for n in names]

    def _get_range(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a value; None when it is missing."""
        with self.client.lock:
            value = self.client.values.get(name)
        return None if value is None else value[start:end]

    def _set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None]:
        """Store every value (copy it: the writer reuses its buffer); per value ``None``, or why
        the store refused it (``kvplug.backends.common.value_io.StoreRefused``)."""
        with self.client.lock:
            for name, data in items:
                self.client.values[name] = bytes(data)
        return [None] * len(items)

    def _delete(self, names: Sequence[str]) -> None:
        with self.client.lock:
            for name in names:
                self.client.values.pop(name, None)


class {{ cookiecutter.__class_name }}(ValueStoreTier):
    """The ``{{ cookiecutter.backend_name }}`` tier: chunks as values in a key-value store."""

    kind = "{{ cookiecutter.backend_name }} store"
    #: The store is reached over I/O that may wait: kvplug bounds every call by ``timeout_s``.
    never_blocks = False

    class Options(ValueStoreOptions):
        """What a tier config may put under ``options:`` (kvplug's base: unknown keys and booleans
        given for numbers are rejected, naming the key)."""

        url: str = Field(default="memory://default", description="where the store is")

    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        """The store's calls and its name for log lines (never with credentials)."""
        opts: {{ cookiecutter.__class_name }}.Options = ctx.options
        io = {{ cookiecutter.__class_name }}IO(ctx.name, opts.url, breaker)
        return io, io.redact(opts.url)
{% else -%}
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
* ``get_layers`` (optional) returns a range of layers: in layer-wise mode the connector loads a
  chunk one layer at a time, each just before the engine needs it.
* ``contains(pin=True)`` pins hits; pinned entries are never evicted until ``unpin``, not even to
  make room for a new chunk.
* Capacity is in bytes; stats report ``bytes`` so kvplug (and its tests) can check the bound.
* ``never_blocks`` stays ``False``: kvplug calls the tier on threads of its own, each call bounded
  by the tier's ``timeout_s``, so a slow store degrades to a miss instead of stalling the engine.

A tier over a key-value store (get/set/delete by name: a cache service, a database) does not start
from this file: generate one with ``store_kind=key_value`` (``kvplug new-backend NAME
--key-value``), built on kvplug's value-store base, which already does the batching, checksums,
pins and eviction.
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

    #: ``True`` is a promise that no hook ever waits on I/O: kvplug then calls the tier on the
    #: caller's thread, without the ``timeout_s`` bound, and reads it inside the engine step
    #: (kvplug's ``local_cpu`` does). Keep ``False`` for any store that may wait (a device, a
    #: file system, a network).
    never_blocks = False

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

    def _verified(self, key: CacheKey) -> _Entry | None:
        """The entry of ``key`` if its checksum holds; a bad entry is dropped and missed."""
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
        return entry

    def _filled(self, meta: MemoryObjMeta, shape: tuple[int, ...], data: torch.Tensor
                ) -> MemoryObj | None:
        """A fresh object of ``shape`` from ``ctx.allocate`` holding ``data``; None when memory
        is full (a miss, never an error)."""
        obj = self._allocate(shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:
            with self._lock:
                self._counters["alloc_failures"] += 1
            return None
        obj.byte_view.copy_(data)
        return obj

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        """A fresh object (owned by the caller) holding the chunk, or None on a miss."""
        entry = self._verified(key)
        if entry is None:
            return None
        return self._filled(entry.meta, entry.meta.shape, entry.data)

    @hookimpl
    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int) -> MemoryObj | None:
        """Layers ``[first_layer, first_layer + num_layers)`` of the chunk (its layers are the
        first dimension), as an object of their own; None on a miss or a range it lacks."""
        entry = self._verified(key)
        if entry is None:
            return None
        layers = entry.meta.shape[0]
        if first_layer < 0 or num_layers < 1 or first_layer + num_layers > layers:
            return None
        rows = entry.data.view(layers, -1)[first_layer : first_layer + num_layers]
        return self._filled(entry.meta, (num_layers, *entry.meta.shape[1:]), rows.reshape(-1))

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
{% endif -%}
