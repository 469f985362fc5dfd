"""Stores of a remote tier (resp, mooncake, fsspec): a bounded queue drained by writer threads,
in batches (one pipelined round trip, one batch call; fsspec uploads one object per batch).

:meth:`ValueWriter.enqueue` only queues (taking a reference); a full queue drops the store and counts it
(``dropped_queue_full``, logged once naming the option to raise), so the engine never waits. The
queue is bounded by stores and by bytes (:data:`MAX_PENDING_WRITES`, :data:`MAX_PENDING_BYTES`:
each queued store holds its memory object, L1 memory that cannot be evicted meanwhile); the
defaults keep a long prompt's chunks stored in one engine step (hundreds of them). The writer
threads come from the tier's runtime (``TierContext.runtime``, :mod:`kvplug.runtime`): a burst of
stores is one task on them. A writer takes what is queued (up to ``batch_bytes``), encodes each
chunk in the shared chunk format into its reused scratch buffer (or, where the store keeps the
buffer it is given, ``io.keeps_values``, into fresh bytes: one copy either way, after which the memory object is
released) and sends all of them in one batch. A value is visible whole or not at all (``SET``,
Mooncake's puts and fsspec's whole-object uploads are atomic). A store refused by the server
(full: ``OOM`` under ``noeviction``, Mooncake's -200) is dropped and counted (``dropped_full``); it
does not count against the breaker (the store answered); one whose part of the store did not
answer (:class:`~.value_io.Unanswered`: a cluster's master down) is a failed store (``put_errors``).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvplug import chunkfile as cf
from kvplug.keys import CacheKey
from kvplug.logs import LogOnce
from kvplug.memory import MemoryObj
from kvplug.runtime import THREADS, Runtime

from .chunks import HeaderCache
from .index import CapacityIndex, Pins, TTLSet
from .tenant_budget import TenantBudget
from .value_io import GuardedCalls, Unanswered

logger = logging.getLogger("kvplug.backends.values")

Item = tuple[str, CacheKey, MemoryObj]
#: Default bounds of the write queue (the ``max_pending_writes`` and ``max_pending_bytes``
#: options of every remote tier): a prompt of 256k tokens is 1024 chunks of 256 tokens.
MAX_PENDING_WRITES = 1024
MAX_PENDING_BYTES = 1 << 30


@dataclass(frozen=True)
class TierParts:
    """What a remote tier shares with its writer: its name (for messages and thread names), its
    guarded calls, capacity index, parsed headers (a written name's is dropped), pins (spared by
    capacity evictions), log-once, keyring (``auth_key_env``: chunks are MAC'd) and runtime."""

    name: str
    io: GuardedCalls
    index: CapacityIndex
    headers: HeaderCache
    pins: Pins
    log_once: LogOnce
    auth: cf.Keyring | None = None
    runtime: Runtime = THREADS


class ValueWriter:
    """Owns the queue and its threads, the stores in flight (invisible to lookups until written),
    the recently written names (trusted without a round trip) and the store counters. It works
    on the tier's shared parts (:class:`TierParts`), never calls back into the tier: a capacity
    eviction spares what is pinned or in flight, deletes its victims from the store and the
    header cache; a finished store drops the name's cached header. A store that keeps the buffer
    it is given (``io.keeps_values``) gets each value in fresh bytes."""

    def __init__(self, parts: TierParts, *, max_pending: int, threads: int, batch_bytes: int,
                 written_ttl_s: float, max_pending_bytes: int = MAX_PENDING_BYTES,
                 budget: TenantBudget | None = None) -> None:
        self._parts = parts
        self._name = parts.name
        self._auth = parts.auth
        self._io = parts.io
        self._index = parts.index
        self._log_once = parts.log_once
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._queued_bytes = 0  # of stores queued, not yet taken by a writer (under the lock)
        self._batch_bytes = batch_bytes
        runtime = parts.runtime
        self._rt = runtime
        #: per-tenant quotas, counted on this path (:mod:`.tenant_budget`: approximate)
        self.budget = budget
        self._threads = threads
        self._lock = threading.Lock()
        self._idle = runtime.condition(self._lock)
        self._pending: dict[str, int] = {}
        self._written = TTLSet(written_ttl_s, clock=runtime.monotonic)
        self._counts = dict.fromkeys(("written", "bytes_put", "dropped_puts", "dropped_queue_full",
                                      "dropped_down", "dropped_full", "put_errors"), 0)
        self._closed = False
        self._local = threading.local()
        self._queue: deque[Item] = deque()  # bounded by max_pending (under the lock)
        self._draining = 0  # writer tasks queued or running (at most ``threads``)
        #: the writer threads: daemon threads of the tier's runtime (kvplug.runtime), one task
        #: per burst of stores (a simulation orders each against everything else)
        self._pool = runtime.executor(threads, f"kvplug-{self._name}-w", daemon=True)
        runtime.start_threads(self._pool, threads)  # now, not on the first store

    # -- what lookups and eviction need to know -------------------------------------------------
    def known(self, names: Sequence[str], trust_written: bool) -> list[bool | None]:
        """Per name: ``False`` while its store is in flight, ``True`` if written here recently
        and ``trust_written``, else ``None`` (ask the store)."""
        with self._lock:
            return [False if n in self._pending else True if trust_written and n in self._written
                    else None for n in names]

    def protected(self, name: str) -> bool:
        """Whether eviction must spare ``name``: its store is in flight, or a lookup pinned it."""
        with self._lock:
            if name in self._pending:
                return True
        return name in self._parts.pins

    def forget(self, name: str) -> None:
        """The value was deleted, evicted by the store or found corrupt: stop trusting it."""
        with self._lock:
            self._written.discard(name)
        if self.budget is not None:
            self.budget.forget(name)

    # -- stores ---------------------------------------------------------------------------------
    def enqueue(self, name: str, key: CacheKey, obj: MemoryObj) -> None:
        """Queue a store of ``obj`` (a reference is held until it is written or dropped)."""
        if self.budget is not None and not self.budget.admit(name, key.tenant, obj.nbytes):
            return
        with self._lock:
            if self._closed or name in self._pending or name in self._written:
                return
            self._pending[name] = self._pending.get(name, 0) + 1
        try:
            obj.ref_up()
        except BaseException:  # a freed object: not in flight after all (flush() can be true)
            self._done([name])
            raise
        with self._lock:
            fits = self._queued_bytes + obj.nbytes <= self._max_pending_bytes
            full = self._closed or len(self._queue) >= self._max_pending or not fits
            start = not full and self._draining < self._threads
            if not full:
                self._queue.append((name, key, obj))
                self._queued_bytes += obj.nbytes
                self._draining += start
            queued, queued_bytes = len(self._queue), self._queued_bytes
        if start:
            self._pool.submit(self._run)
        if full:
            obj.ref_down()
            self._done([name])
            self._count("dropped_puts", "dropped_queue_full")
            self._log_once("queue_full", "tier %r: write queue full (%s); a store was dropped — "
                           "the store is slower than the engine stores: raise %s if memory "
                           "allows; further drops are counted in stats (dropped_queue_full), not "
                           "logged", self._name,
                           f"{queued} of max_pending_writes {self._max_pending}"
                           if fits else f"{queued_bytes} bytes queued, max_pending_bytes "
                           f"{self._max_pending_bytes}",
                           "max_pending_writes" if fits else "max_pending_bytes")

    def submit(self, name: str, key: CacheKey, obj: MemoryObj) -> None:
        """Deprecated: :meth:`enqueue`."""
        warnings.warn("ValueWriter.submit is deprecated, use ValueWriter.enqueue",
                      DeprecationWarning, stacklevel=2)
        self.enqueue(name, key, obj)

    def flush(self, timeout: float) -> bool:
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
                           self._name, drain_s)
        with self._lock:
            left, self._queue = list(self._queue), deque()
            self._queued_bytes = 0
        for name, _, obj in left:
            obj.ref_down()
            self._done([name])
            self._count("dropped_puts")
        self._pool.shutdown(wait=True, timeout=join_s)
        return True

    def _count(self, *what: str, n: int = 1) -> None:
        with self._lock:
            for w in what:
                self._counts[w] += n

    def _done(self, names: Sequence[str]) -> None:
        with self._lock:
            for name in names:
                left = self._pending.get(name, 0) - 1
                if left > 0:
                    self._pending[name] = left
                else:
                    self._pending.pop(name, None)
            if not self._pending:
                self._idle.notify_all()

    def _take(self) -> list[Item]:
        """What is queued, up to the batch size (at least one store); empty if nothing is."""
        with self._lock:
            batch: list[Item] = []
            size = 0
            while self._queue and (not batch or size < self._batch_bytes):
                item = self._queue.popleft()
                batch.append(item)
                size += item[2].nbytes
            self._queued_bytes -= size
            if not batch:
                self._draining -= 1  # under the lock enqueue() looks at
            return batch

    def _run(self) -> None:
        """One writer task: batches until nothing is queued."""
        while True:
            batch = self._take()
            if not batch:
                return
            try:
                self._write(batch)
            except Exception as exc:  # noqa: BLE001 - a store never raises into the engine
                self._count("dropped_puts", n=len(batch))
                self._log_once("write_bug", "tier %r: store failed: %s — further ones are counted "
                               "in stats, not logged", self._name, self._io.redact.error(exc))
            finally:
                self._done([name for name, _, _ in batch])

    def _scratch(self, size: int) -> memoryview:
        """This thread's encoding buffer, at least ``size`` bytes: reused from batch to batch, so
        encoding a value costs one copy into memory already touched (no fresh allocation and
        page faults per value)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < size:  # sized for a whole batch at once: made (and, where
            # the store sends from registered memory, registered) once per thread
            want = max(size, self._batch_bytes)
            buf = self._local.scratch = self._io.new_buffer(want + want // 4)
        return buf

    def _encode(self, batch: list[Item]) -> list[tuple[str, bytes | memoryview]]:
        """Each chunk as one value, copied into this thread's scratch buffer (valid until this
        thread's next batch); every object is released, also on a failure."""
        try:
            parts = [(name, cf.encode_chunk(key, obj, self._auth)) for name, key, obj in batch]
            if self._io.keeps_values:
                return [(name, b"".join([h, *bufs])) for name, (h, bufs) in parts]
            sizes = [len(h) + sum(len(b) for b in bufs) for _, (h, bufs) in parts]
            scratch = self._scratch(sum(sizes))
            out, off = [], 0
            for (name, (header, bufs)), size in zip(parts, sizes):
                pos = off
                for piece in (header, *bufs):
                    scratch[pos : pos + len(piece)] = piece
                    pos += len(piece)
                out.append((name, scratch[off : off + size]))
                off += size
            return out
        finally:
            for _, _, obj in batch:
                obj.ref_down()  # the bytes are copied: L1 may reuse the memory now

    def _write(self, batch: list[Item]) -> None:
        if not self._io.allow():  # the store is down: drop without encoding
            for _, _, obj in batch:
                obj.ref_down()
            self._count("dropped_puts", "dropped_down", n=len(batch))
            return
        try:
            items = self._encode(batch)
        except BaseException:
            self._io.forgo()  # the call the breaker granted will not be made
            raise
        room: list[tuple[str, bytes | memoryview]] = []
        for name, data in items:
            victims = self._index.reserve(len(data), self.protected)
            if victims is None:
                self._count("dropped_puts")
                continue
            self._evicted([v for v, _ in victims])
            room.append((name, data))
        if not room:
            self._io.forgo()
            return
        results = self._io.set_many(room)
        if results is None:  # the round trip failed (counted by the breaker)
            for _, data in room:
                self._index.release(len(data))
            self._count("dropped_puts", "put_errors", n=len(room))
            return
        for (name, data), error in zip(room, results):
            if isinstance(error, Unanswered):  # its part of the store is down (its breaker says)
                self._index.release(len(data))
                self._count("dropped_puts", "put_errors")
                continue
            if error is not None:
                self._index.release(len(data))
                self._count("dropped_puts", "dropped_full")
                self._log_once("store_full", "tier %r: the store refused a value (%s); stores "
                               "are dropped while it is full — further ones are counted in stats "
                               "(dropped_full), not logged", self._name,
                               self._io.redact.error(error))
                continue
            with self._lock:
                self._counts["written"] += 1
                self._counts["bytes_put"] += len(data)
                self._written.add(name)
            self._parts.headers.pop(name)  # a header read before describes another value
            self._index.commit(name, len(data))
            if self.budget is not None:
                self.budget.written(name, len(data))

    def _evicted(self, names: list[str]) -> None:
        """Delete the victims of the capacity bound (from the store and what remembers them)."""
        if not names:
            return
        with self._lock:
            for n in names:
                self._written.discard(n)
        for n in names:
            self._parts.headers.pop(n)
        self._io.delete(names)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counts.items()}
            out["pending_writes"] = float(sum(self._pending.values()))
            out["queued_bytes"] = float(self._queued_bytes)
        if self.budget is not None:
            out.update(self.budget.stats())
        return out
