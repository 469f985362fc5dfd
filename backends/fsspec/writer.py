"""Stores of the fsspec tier: a bounded queue drained by writer threads.

``submit`` only queues (taking a reference); a full queue drops the store and counts it, so the
engine never waits. A writer thread encodes the chunk file (one copy, after which the memory
object is released), makes room under the optional capacity and uploads it whole, so readers on
any host see all of an object or nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from kvplug import chunkfile as cf
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

from ..common.index import TTLSet
from .io import TierParts

logger = logging.getLogger("kvplug.backends.fsspec")


class ChunkWriter:
    """Queued, whole-object stores. Owns the queue and its threads, the writes in flight (which
    lookups treat as missing until they are durable), the recently written objects (which they
    trust without a remote call) and the store counters.

    ``pinned(path)`` says whether a lookup pinned an object (never evicted to make room);
    ``delete(paths)`` removes evicted objects; ``stored(path)`` reports a finished upload.
    """

    def __init__(self, tier: TierParts, *, pinned: Callable[[str], bool],
                 delete: Callable[[Sequence[str]], None], stored: Callable[[str], None],
                 max_pending: int, threads: int, written_ttl_s: float) -> None:
        self._tier = tier
        self._pinned = pinned
        self._delete = delete
        self._stored = stored
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[str, int] = {}
        self._written = TTLSet(written_ttl_s)
        self._counts = dict.fromkeys(("written", "bytes_put", "dropped_puts", "dropped_queue_full",
                                      "dropped_down", "put_errors"), 0)
        self._closed = False
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[str, CacheKey, MemoryObj]] = queue.Queue(max_pending)
        self._threads = [threading.Thread(target=self._run, name=f"kvplug-fsspec-w{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    # -- what lookups and eviction need to know -------------------------------------------------
    def known(self, paths: Sequence[str], trust_written: bool) -> list[bool | None]:
        """Per path: ``False`` while its write is in flight (not durable yet: invisible), ``True``
        if this process wrote it recently and ``trust_written``, else ``None`` (ask the store)."""
        with self._lock:
            return [False if p in self._pending else True if trust_written and p in self._written
                    else None for p in paths]

    def protected(self, path: str) -> bool:
        """Whether eviction must spare ``path`` (pinned, or being written)."""
        with self._lock:
            if path in self._pending:
                return True
        return self._pinned(path)

    def forget(self, path: str) -> None:
        """The object was deleted or found corrupt: no longer trust that it exists."""
        with self._lock:
            self._written.discard(path)

    # -- stores ---------------------------------------------------------------------------------
    def submit(self, path: str, key: CacheKey, obj: MemoryObj) -> None:
        """Queue a store of ``obj`` (a reference is held until it is written or dropped)."""
        if path in self._tier.index:
            return
        with self._lock:
            if self._closed or path in self._pending or path in self._written:
                return
            self._pending[path] = self._pending.get(path, 0) + 1
        try:
            self._queue.put_nowait((path, key, obj.ref_up()))
        except queue.Full:
            obj.ref_down()
            self._done(path)
            self._count("dropped_puts", "dropped_queue_full")
            self._tier.log_once(
                "queue_full", "tier %r: write queue full (%d); a store was dropped — further "
                "ones are counted in stats, not logged", self._tier.name, self._max_pending,
            )

    def flush(self, timeout: float) -> bool:
        """Wait until no write is in flight; whether that happened within ``timeout``."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout=timeout)

    def close(self, drain_s: float, join_s: float) -> bool:
        """Refuse new stores, let queued ones finish for up to ``drain_s``, drop (and release)
        the rest and stop the threads. ``False`` if it was already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        if not self.flush(drain_s):
            logger.warning("tier %r: writes still pending after %.0fs at close; dropped",
                           self._tier.name, drain_s)
        while True:
            try:
                path, _, obj = self._queue.get_nowait()
            except queue.Empty:
                break
            obj.ref_down()
            self._done(path)
            self._count("dropped_puts")
        self._stop.set()
        for t in self._threads:
            t.join(timeout=join_s)
        return True

    def _count(self, *what: str, n: int = 1) -> None:
        with self._lock:
            for w in what:
                self._counts[w] += n

    def _done(self, path: str) -> None:
        with self._lock:
            left = self._pending.get(path, 0) - 1
            if left > 0:
                self._pending[path] = left
            else:
                self._pending.pop(path, None)
            if not self._pending:
                self._idle.notify_all()

    def _run(self) -> None:
        while True:
            try:
                path, key, obj = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                self._write(path, key, obj)
            except Exception as exc:  # noqa: BLE001 - a store never raises into the engine
                self._count("dropped_puts")
                self._tier.log_once(
                    "write_bug", "tier %r: store failed: %s — further ones are counted in stats, "
                    "not logged", self._tier.name, self._tier.remote.redact.error(exc),
                )
            finally:
                self._done(path)

    def _write(self, path: str, key: CacheKey, obj: MemoryObj) -> None:
        try:
            header, bufs = cf.encode_chunk(key, obj)
            data = b"".join([header, *bufs])
        finally:
            obj.ref_down()  # the bytes are copied: L1 may reuse the memory now
        if not self._tier.remote.allow():
            self._count("dropped_puts", "dropped_down")
            return
        victims = self._tier.index.reserve(len(data), self.protected)
        if victims is None:
            self._tier.remote.forgo()
            self._count("dropped_puts")
            return
        self._delete([p for p, _ in victims])
        if not self._tier.remote.put(path, data):
            self._tier.index.release(len(data))
            self._count("dropped_puts", "put_errors")
            return
        with self._lock:
            self._counts["written"] += 1
            self._counts["bytes_put"] += len(data)
            self._written.add(path)
        self._stored(path)
        self._tier.index.commit(path, len(data))

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counts.items()}
            out["pending_writes"] = float(sum(self._pending.values()))
        return out
