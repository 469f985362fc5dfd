"""Stores of the fsspec tier: a bounded queue drained by writer threads.

``batched_submit_put`` only queues (taking a reference); a full queue drops the store and counts
it, so the engine never waits. A writer encodes the chunk file (one copy, after which the memory
object is released), makes room under the optional capacity and uploads it whole, so readers on
any host see all of an object or nothing.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvplug import chunk_format as cf
from kvplug.hookspecs import hookimpl
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

from .fsspec_breaker import CircuitBreaker
from .fsspec_index import CapacityIndex, TTLSet
from .fsspec_io import Redactor, RemoteIO


class WriteMixin:
    """The write half of :class:`~kvplug.backends.fsspec_remote.FsspecBackend`."""

    name: str
    opts: Any
    io: RemoteIO
    breaker: CircuitBreaker
    redact: Redactor
    _lock: threading.Lock
    _counts: dict[str, int]
    _written: TTLSet
    _absent: TTLSet
    _index: CapacityIndex | None
    _headers: OrderedDict[str, cf.ChunkHeader]
    _pins: dict[str, int]
    _allocate: Callable[..., MemoryObj | None]

    _idle: threading.Condition
    _pending: dict[str, int]
    _queue: queue.Queue
    _stop: threading.Event
    _closed: bool

    if TYPE_CHECKING:  # provided by FsspecBackend / the other mixin
        def _count(self, what: str, n: int = 1) -> None: ...
        def _once(self, what: str, msg: str, *args: Any) -> None: ...
        def _remote_failed(self, exc: BaseException) -> None: ...
        def path_of(self, key: CacheKey) -> str: ...

    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs):
            path = self.path_of(key)
            with self._lock:
                if self._closed or path in self._pending or path in self._written:
                    continue
                if self._index is not None and path in self._index.sizes:
                    continue
                self._pending[path] = self._pending.get(path, 0) + 1
            try:
                self._queue.put_nowait((path, key, obj.ref_up()))
            except queue.Full:
                obj.ref_down()
                self._done(path)
                self._count("dropped_puts")
                self._count("dropped_queue_full")
                self._once("queue_full", "tier %r: write queue full (%d); a store was dropped",
                           self.name, self.opts.max_pending_writes)

    def _done(self, path: str) -> None:
        with self._lock:
            left = self._pending.get(path, 0) - 1
            if left > 0:
                self._pending[path] = left
            else:
                self._pending.pop(path, None)
            if not self._pending:
                self._idle.notify_all()

    def _writer(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            path, key, obj = item
            try:
                self._write(path, key, obj)
            except Exception as exc:  # noqa: BLE001 - a store never raises into the engine
                self._count("dropped_puts")
                self._once("write_bug", "tier %r: store failed: %s", self.name,
                           self.redact.error(exc))
            finally:
                self._done(path)

    def _write(self, path: str, key: CacheKey, obj: MemoryObj) -> None:
        try:
            header, bufs = cf.encode_chunk(key, obj)
            data = b"".join([header, *bufs])
        finally:
            obj.ref_down()  # the bytes are copied: L1 may reuse the memory now
        if not self.breaker.allow():
            self._count("dropped_puts")
            self._count("dropped_down")
            return
        if not self._reserve(len(data)):
            return
        try:
            self.io.run(lambda: self.io.put(path, data))
        except Exception as exc:  # noqa: BLE001
            self._release(len(data))
            self._count("dropped_puts")
            self._count("put_errors")
            self._remote_failed(exc)
            return
        self.breaker.success()
        with self._lock:
            self._counts["written"] += 1
            self._counts["bytes_put"] += len(data)
            self._absent.discard(path)
            self._written.add(path)
            if self._index is not None:
                self._index.reserved -= len(data)
                self._index.add(path, len(data))

    def _reserve(self, size: int) -> bool:
        """Make room under ``capacity`` (deleting LRU objects); False drops the store."""
        if self._index is None:
            return True
        with self._lock:
            victims = self._index.victims(size, self._protected)
            if victims is None:
                self._counts["dropped_puts"] += 1
                return False
            self._index.reserved += size
        self._delete([p for p, _ in victims])
        return True

    def _release(self, size: int) -> None:
        if self._index is not None:
            with self._lock:
                self._index.reserved -= size

    def _protected(self, path: str) -> bool:
        return self._pins.get(path, 0) > 0 or path in self._pending

    def _delete(self, paths: Sequence[str]) -> None:
        if not paths:
            return
        with self._lock:
            for p in paths:
                self._written.discard(p)
                self._headers.pop(p, None)
            self._counts["evicted"] += len(paths)
        try:
            results = self.io.run_many([lambda p=p: self.io.rm(p) for p in paths])
        except Exception as exc:  # noqa: BLE001
            self._remote_failed(exc)
            return
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._remote_failed(errors[0])

    @hookimpl
    def flush(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout=timeout)
