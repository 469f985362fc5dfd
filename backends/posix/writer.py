"""The posix tier's write queue: stores never wait on the disk.

``batched_submit_put`` queues each chunk (its object held, one reference) and returns; a write
runs on one of ``io_threads`` threads of the tier's runtime: it skips a file already there,
reserves room (:meth:`.Directory.make_room`, which evicts), writes a hidden temporary file and
renames it into place (:class:`.io.ChunkFileIO`: readers never see a partial file), indexes it,
and hands its file to a pin taken while it was queued (:class:`.HeldFiles`). A queued chunk is
served from memory meanwhile (:mod:`.reader`). A full queue, a full disk or a read-only directory
drops the store, counted and logged once; nothing is raised into the engine.

The queue is guarded by the directory's lock (:attr:`.Directory.lock`): a store, a pin and an
eviction look at the queue and the index at once.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from kvplug.chunkfile.atomic import directory_of
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime import Runtime

from . import fs
from .directory import Directory, Warn
from .held import HeldFiles
from .io import ChunkFileIO


def _open_quietly(path: str) -> int | None:
    """A read-only descriptor of ``path`` (a chunk file just written), or None (gone, or no
    longer a regular file: the same open as every read, :func:`.fs.open_chunk`)."""
    try:
        return fs.open_chunk(path)
    except OSError:
        return None


class Writer:
    """Queued chunk writes of one tier, ``max_pending`` at most, on ``threads`` threads."""

    def __init__(self, directory: Directory, held: HeldFiles, files: ChunkFileIO,
                 runtime: Runtime, warn: Warn, *, threads: int, max_pending: int,
                 writable: bool) -> None:
        self._dir = directory
        self._lock = directory.lock
        self._held = held
        self.files = files
        self._rt = runtime
        self._warn = warn
        self.max_pending = max_pending
        self.writable = writable
        self.closed = False
        #: chunks queued or being written, by relative path (each holds one reference)
        self.pending: dict[str, MemoryObj] = {}
        self.cancelled: set[str] = set()  # queued writes an eviction of their key called off
        self._releasing = 0  # writes out of the queue whose object the writer still holds
        self._idle = runtime.condition(self._lock)
        self.counters = dict.fromkeys(
            ("writes", "disk_bytes_written", "dropped_puts", "failed_puts", "skipped_puts"), 0)
        self._threads = threads
        self._pool = runtime.executor(threads, f"kvplug-{directory.name}")
        runtime.start_threads(self._pool, threads)  # now, not on the first store

    def enqueue(self, keys: Sequence[CacheKey], rels: Sequence[str],
                objs: Sequence[MemoryObj]) -> None:
        """Queue a write of ``objs[i]`` as the file ``rels[i]`` of ``keys[i]`` (not blocking).
        One call's writes go to the threads as at most one job per thread (keys in turn), not
        one hand-off per key."""
        queued: list[tuple[CacheKey, str, MemoryObj]] = []
        full = 0
        with self._lock:
            for key, rel, obj in zip(keys, rels, objs, strict=False):
                if self.closed or not self.writable:
                    self.counters["dropped_puts"] += 1
                    continue
                if rel in self._dir.index or rel in self.pending or rel in self._dir.reaper:
                    self.counters["skipped_puts"] += 1  # (evicted, not deleted yet: next time)
                    continue
                if len(self.pending) >= self.max_pending:
                    self.counters["dropped_puts"] += 1
                    full += 1
                    continue
                self.pending[rel] = obj.ref_up()
                self.cancelled.discard(rel)
                queued.append((key, rel, obj))
        if full:
            self._warn("queue", "write queue full (%d); stores dropped", self.max_pending)
        jobs = min(self._threads, len(queued))
        for j in range(jobs):
            self._pool.submit(self._write_all, queued[j::jobs])

    def cancel_locked(self, rel: str) -> None:
        """Under the lock: a queued write of ``rel`` is called off (its key was evicted)."""
        if rel in self.pending:
            self.cancelled.add(rel)

    def _write_all(self, items: list[tuple[CacheKey, str, MemoryObj]]) -> None:
        for key, rel, obj in items:
            self._write(key, rel, obj)

    def _write(self, key: CacheKey, rel: str, obj: MemoryObj) -> None:
        path = self._dir.path(rel)
        files = self.files
        reserved = 0
        try:
            if self.cancelled and rel in self.cancelled:
                return
            # the shard directory, opened once (never through a link) for the check, the write
            # and the rename
            with directory_of(path, fsync=files.fsync, file_mode=files.file_mode, gid=files.gid,
                              no_follow=True) as dfd:
                name = os.path.basename(path)
                st = fs.stat_in(dfd, name)
                if st is not None:  # another process (or an earlier run) stored it already
                    # counted as this write would have been: room made within the capacity and
                    # the tenant's quota first (else this view holds more than either allows)
                    if self._dir.make_room(st.st_size, key.tenant):
                        reserved = st.st_size
                    with self._lock:
                        self._dir.index.add(rel, st.st_size, st.st_mtime)
                        self._dir.index.unreserve(reserved, key.tenant)
                        reserved = 0
                    return
                size, write_file = files.prepare_write(key, rel, obj)
                if not self._dir.make_room(size, key.tenant):
                    with self._lock:
                        self.counters["skipped_puts"] += 1
                    self._warn("full", "capacity %d bytes is full of pinned files; stores "
                               "skipped", self._dir.capacity)
                    return
                reserved = size
                written = write_file(path, dfd)
                stamp = self._stamp(dfd, name)
            with self._lock:
                self._dir.index.add(rel, written, stamp)
                # in the same lock: the file is counted once (indexed), never twice (reserved too)
                self._dir.index.unreserve(reserved, key.tenant)
                reserved = 0
                self.counters["writes"] += 1
                self.counters["disk_bytes_written"] += written
        except Exception as exc:  # noqa: BLE001 - OSError (full disk...) or not: never raised
            with self._lock:
                self.counters["failed_puts"] += 1
            kind = errno.errorcode.get(getattr(exc, "errno", None) or 0, type(exc).__name__)
            self._warn(f"write:{kind}", "store into %s failed: %s", self._dir.root, exc)
        finally:
            self._done(rel, path, obj, key, reserved)

    def _done(self, rel: str, path: str, obj: MemoryObj, key: CacheKey, reserved: int) -> None:
        """A write of ``rel`` is over (done or not): out of the queue, its object dropped, and
        its file handed to a pin taken while it was queued."""
        fd = None
        opened = False
        while True:
            with self._lock:
                # pinned while it was queued: held now, under the lock the pin looked at the
                # queue under (PosixBackend._pin), so no pin falls between the two; the file is
                # opened (outside the lock: no I/O under it) only for such a pin
                if opened or not self._held.waits_for(rel):
                    taken = self._held.attach(rel, fd)
                    self._dir.index.unreserve(reserved, key.tenant)
                    self.pending.pop(rel, None)
                    self.cancelled.discard(rel)
                    self._releasing += 1
                    break
            fd, opened = _open_quietly(path), True
        if fd is not None and not taken:
            os.close(fd)
        obj.ref_down()
        with self._lock:  # flush() is true only once the writer holds nothing
            self._releasing -= 1
            if not self.pending and not self._releasing:
                self._idle.notify_all()

    def _stamp(self, dir_fd: int, name: str) -> float:
        """Give the file ``name`` just written in the shard open as ``dir_fd`` its LRU stamp from
        the runtime's wall clock (its mtime, the order processes sharing the directory evict
        in), so the index and the file agree and a simulated clock orders the files, not the
        kernel's; the stamp."""
        stamp = self._rt.time()
        try:
            fs.touch_in(dir_fd, name, stamp)
        except OSError:
            pass  # gone already (evicted by another process), or read-only: the stamp is advisory
        return stamp

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done and the writer holds no object."""
        with self._idle:
            return self._idle.wait_for(lambda: not self.pending and not self._releasing, timeout)

    def stop(self) -> bool:
        """Take no more stores; False if the writer was stopped already."""
        with self._lock:
            already, self.closed = self.closed, True
        return not already

    def close(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the queued writes, then stop the threads (cancelling what
        has not started when the wait ran out); False if writes were still running."""
        with self._idle:
            written = self._idle.wait_for(lambda: not self.pending, timeout)
        if not written:
            self._warn("close_writes", "%d writes still running after %.0f s (a hung file "
                       "system?); closing without them", len(self.pending), timeout)
        self._pool.shutdown(wait=written, cancel_futures=not written)
        return written

    def stats_locked(self) -> dict[str, float]:
        """Under the lock: the writer's counters and queue length."""
        return {**self.counters, "pending_writes": len(self.pending)}
