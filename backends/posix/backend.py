"""The ``posix`` tier: one safetensors chunk file per key in a local (or shared) directory.

* Layout: ``<path>/<2 hex of the hash>/<safe key name>.safetensors`` (:mod:`kvplug.chunkfile`),
  names built only from the key's safe string form, so no input can escape ``path``.
* Writes run on ``io_threads`` threads, never on the caller's; each goes to a hidden temporary
  name and is renamed into place (readers never see a partial file); ``fsync`` is optional.
* Reads go with ``os.preadv`` straight into memory from ``ctx.allocate`` (L1's pool, so a
  promotion is zero-copy), whole chunks or a range of layers, every layer checksum verified.
* The index is rebuilt from the directory at startup, on a background thread (serving starts at
  once: a lookup that misses the index falls back to a ``stat``, so files not yet indexed, or
  another process wrote, are found; stores wait for the scan). Several processes may share a
  directory.
* Capacity: LRU by file mtime (bumped on every read and pin, shared by all processes); when over,
  the oldest files not pinned by this process are deleted. Files vanishing under us are misses.
  Another eviction policy (``eviction: {policy: s3fifo}``, :mod:`kvplug.policyspecs`) picks the
  victims among the files this process has indexed instead, in its own order.
* Pins hold across processes: a pinned file is kept open (:mod:`.held`) and read through that
  descriptor, so another process's eviction cannot take a promised hit away.
* A file with a wrong size, header, key or checksum is a miss: logged with its path, deleted,
  counted. A file of another format version is a miss left in place (rolling upgrades share a
  directory), counted as ``other_version``. A full disk or read-only directory makes stores fail
  soft; loads go on.
* Files are private (directories 0700, files 0600; ``file_mode``/``group`` for a group-shared
  directory) and every access under the root goes through :mod:`.fs`: no link followed (the
  shard directory's included), no open that can block, nothing deleted outside the root; an
  entry that is not a regular file is a miss (``not_regular``), left in place. Every wait is
  bounded (a hung file system delays a store or ``close``, never stops serving).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvplug import chunkfile as cf
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.logs import LogOnce
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.policies.eviction import LRUEviction

from . import fs
from .held import HeldFiles, fd_limit, fd_path
from .index import Entry, PosixIndex, RescanClock, pack_rel, scan, stat_entry, unlink_entries
from .io import (
    CorruptChunk,
    ForeignChunk,
    Known,
    KnownHeaders,
    direct_io_usable,
    header_digest,
    layer_range_copy,
    read_chunk,
    remove_if_same,
    wider_than,
    writable_dir,
    write_chunk,
)
from .lookup import LookupAndPins
from .options import PosixOptions
from .reaper import Reaper

logger = logging.getLogger("kvplug.backends.posix")
_MAX_CORRUPT_LOGS = 20
_TOUCH_EVERY_S = 1.0  # an LRU stamp younger than this is not bumped again (saves a syscall)
#: how long a write waits for its victims' files to be deleted before it goes on (a stuck disk)
REAPER_WAIT_S = 60.0
#: how long a write waits for the startup scan (a hung file system) before its store is skipped
INDEX_WAIT_S = 60.0
#: how long ``close`` waits for the scan, the writes and the deletes (each) before it goes on
CLOSE_WAIT_S = 60.0


def _open_quietly(path: str) -> int | None:
    """A read-only descriptor of ``path`` (a chunk file just written), or None (gone, or no
    longer a regular file: the same open as every read, :func:`.fs.open_chunk`)."""
    try:
        return fs.open_chunk(path)
    except OSError:
        return None


class PosixBackend(LookupAndPins):
    """A directory of chunk files with an LRU byte capacity."""

    Options = PosixOptions
    #: Victims are chosen by ``ctx.eviction``; ``lru`` is the index's own (shared mtime) LRU.
    eviction_policy = True

    def __init__(self, ctx: TierContext) -> None:
        opts: PosixBackend.Options = ctx.options
        self.name = ctx.name
        self.opts = opts
        self._allocate = ctx.allocate
        #: The deployment's keyring (``auth_key_env``): MACs and keyed names; None = plain.
        self._auth = ctx.auth
        self.root = Path(opts.path).expanduser().resolve()
        self._root_s = str(self.root) + os.sep
        self.capacity = int(opts.capacity)
        #: every thread, event, condition and clock of the tier (kvplug.runtime)
        self._rt = ctx.runtime
        self._lock = threading.Lock()
        self._idle = self._rt.condition(self._lock)
        policy = ctx.eviction
        self._index = PosixIndex(None if policy is None or isinstance(policy, LRUEviction)
                                 else policy)
        #: per-tenant byte quotas (the tier's ``quotas``): tenants counted from file names
        self._quotas = ctx.quotas
        if self._quotas is not None:
            self._index.track_tenants()
        self._gid = opts.gid
        self._held = HeldFiles(fd_limit(opts.max_pinned_fds), self._open_held)
        self._pending: dict[str, MemoryObj] = {}
        self._releasing = 0  # writes out of the queue whose object the writer still holds
        self._headers = KnownHeaders()
        self._cancelled: set[str] = set()
        self._warnings = LogOnce(logger)
        self._closed = False
        self._counters = dict.fromkeys(
            ("writes", "disk_bytes_written", "reads", "disk_bytes_read", "pending_hits", "dropped_puts",
             "failed_puts", "skipped_puts", "corrupt", "read_errors", "alloc_failures",
             "evictions", "vanished", "rescans", "other_version", "not_regular"), 0)
        existed = os.path.lexists(self.root)
        why_not = writable_dir(self.root, opts.mode, self._gid)
        self._writable = why_not is None
        if why_not:
            self._log_once("dir", "%s", why_not)
        elif existed and (wider := wider_than(self.root, opts.mode)):
            logger.warning("tier %r: %s", self.name, wider)
        self.o_direct = bool(opts.o_direct and self._writable
                             and direct_io_usable(self.root, self.name))
        self._rescans = RescanClock(opts.rescan_interval_s, self._rt.monotonic)
        self._scan_lock = threading.Lock()
        #: set once the startup scan has indexed the directory (lookups need not wait for it)
        self._indexed = self._rt.event()
        self._pool = self._rt.executor(opts.io_threads, f"kvplug-{self.name}")
        self._reaper = Reaper(self._root_s, self._unlink_failed, self.name, self._rt)
        self._scan_thread = self._rt.executor(1, f"kvplug-{self.name}-scan", daemon=True)
        self._scanner = self._scan_thread.submit(self._initial_scan)

    # -- helpers --------------------------------------------------------------------------------
    def _log_once(self, what: str, msg: str, *args: object) -> None:
        """Warn about one kind of problem once per tier (later ones are counted in stats)."""
        self._warnings(what, "tier %r: " + msg + " (further occurrences are counted in stats)",
                       self.name, *args)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _rel(self, key: CacheKey) -> str:
        """The chunk file of ``key`` relative to the root (keyed names with ``auth``)."""
        return cf.relative_chunk_path(key, self._auth)

    def _path(self, rel: str) -> str:
        return self._root_s + rel

    def _not_regular(self, rel: str, exc: OSError) -> None:
        """An entry at a chunk path that is not a regular file in a real shard directory (a
        link, a FIFO...): a miss, counted, logged once, left in place (the next store of the
        key replaces it)."""
        with self._lock:
            self._index.remove(rel)
            self._counters["not_regular"] += 1
        self._log_once("not_regular", "%s is not a chunk file (%s); treated as a miss, never "
                       "followed nor opened for I/O", self._path(rel), exc.strerror or exc)

    def _open_held(self, rel: str) -> int | None:
        """Open ``rel``'s file to hold it pinned (:mod:`.held`); None if missing or unusable."""
        try:
            return fs.open_chunk(self._path(rel))
        except FileNotFoundError:
            return None
        except fs.NotRegular as exc:
            self._not_regular(rel, exc)
            return None

    def _remember(self, rel: str, known: Known | None) -> None:
        """Remember (or with ``None`` forget) the parsed header of a file (see KnownHeaders)."""
        with self._lock:
            self._headers.put(rel, known)

    def _initial_scan(self) -> None:
        """Index the directory in the background: serving starts at once (a lookup the index
        cannot answer yet falls back to a ``stat``), stores wait for it (capacity needs it)."""
        try:
            self._trim_to_capacity()
        except Exception as exc:  # noqa: BLE001 - never raised into a thread's void
            self._log_once("scan", "scan of %s failed: %r", self.root, exc)
        finally:
            self._indexed.set()

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Wait until the startup scan has indexed every file; False on timeout."""
        return self._indexed.wait(timeout)

    def _rescan(self, only_if_due: bool = False) -> None:
        """Merge a fresh scan into the index; the scan and the sort run without the lock."""
        if not self._scan_lock.acquire(timeout=INDEX_WAIT_S):  # one at a time (bounded)
            self._log_once("rescan_wait", "a scan of %s has run for over %.0f s (a hung file "
                           "system?); this rescan is skipped", self.root, INDEX_WAIT_S)
            return
        try:
            if only_if_due and not self._rescans.due():
                return
            cpu0 = time.thread_time()
            with self._lock:
                current = self._index.begin_merge()
                doomed = self._reaper.doomed()  # evicted before the scan: not indexed again
            try:
                found = scan(self.root)
                for rel in doomed:
                    found.entries.pop(pack_rel(rel, register=False), None)
                prepared = PosixIndex.prepare_merge(current, found)
            except BaseException:
                with self._lock:
                    self._index.abort_merge()
                raise
            with self._lock:
                self._index.finish_merge(prepared)
                self._rescans.scanned(cpu0)
                self._counters["rescans"] += 1
        finally:
            self._scan_lock.release()

    def _trim_to_capacity(self, writer: bool = False) -> None:
        """Rescan the directory and delete LRU files until it is within capacity (the writes
        reserved included): at startup and close on this thread (no write lands meanwhile), for
        a ``writer`` through the reaper, waiting until the files are gone."""
        self._rescan()
        with self._lock:
            victims = self._index.take_victims(
                self._index.bytes + self._index.reserved - self.capacity)
            if writer:
                self._unlink_victims(victims)
        if writer:
            self._wait_deleted(victims)
        else:
            self._unlink_now(victims)

    def _unlink_victims(self, victims: list[tuple[str, Entry]]) -> int:
        """Under the tier's lock (so no put of a victim slips in before it is doomed): queue the
        victims' files for deletion in the background (:mod:`.reaper`); their bytes."""
        if victims:
            self._counters["evictions"] += len(victims)
        return self._reaper.submit(victims)

    def _unlink_now(self, victims: list[tuple[str, Entry]]) -> int:
        """Delete the victims' files on this thread (not under the lock); the bytes freed."""
        freed, failed = unlink_entries(self._root_s, victims)
        for path, exc in failed:
            self._unlink_failed(path, exc)
        self._count("evictions", len(victims))
        return freed

    def _unlink_failed(self, path: str, exc: OSError) -> None:
        self._log_once("unlink", "cannot delete %s: %s", path, exc)

    def _quarantine(self, rel: str, err: CorruptChunk) -> None:
        """Delete a damaged file (only if it is still the file that was read)."""
        path = self._path(rel)
        with self._lock:
            self._index.remove(rel)
            self._counters["corrupt"] += 1
            n = self._counters["corrupt"]
        if n <= _MAX_CORRUPT_LOGS:
            logger.warning("tier %r: chunk file %s is unusable (%s); deleted, treated as a miss",
                           self.name, path, err)
        remove_if_same(path, err.ino)

    def _other_version(self, rel: str, err: ForeignChunk) -> None:
        """A file of another format version: a miss for reads and lookups, left on disk."""
        with self._lock:
            self._index.mark_foreign(rel, err.ino)
            self._counters["other_version"] += 1
        self._log_once("version", "chunk file %s is of another format version (%s); treated as a "
                       "miss and left in place", self._path(rel), err)

    def _touch(self, rel: str, size: int | None = None) -> bool:
        """Make ``rel`` the most recently used entry here and in the LRU shared with other
        processes (its mtime, bumped at most every ``_TOUCH_EVERY_S``); an entry not in the
        index is added with ``size`` (skipped if ``size`` is None). False if the file is gone."""
        now = time.time()
        with self._lock:
            due = self._index.touch(rel, now, size, _TOUCH_EVERY_S)
        try:
            if due:
                fs.touch_chunk(self._path(rel), now)
        except FileNotFoundError:
            return False
        except OSError:
            pass  # read-only: the LRU stamp is advisory
        return True

    # -- writes ---------------------------------------------------------------------------------
    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs, strict=False):
            rel = self._rel(key)
            with self._lock:
                if self._closed or not self._writable:
                    self._counters["dropped_puts"] += 1
                    continue
                if rel in self._index or rel in self._pending or rel in self._reaper:
                    self._counters["skipped_puts"] += 1  # (evicted, not deleted yet: next time)
                    continue
                full = len(self._pending) >= self.opts.max_pending_writes
                if full:
                    self._counters["dropped_puts"] += 1
                else:
                    self._pending[rel] = obj.ref_up()
                    self._cancelled.discard(rel)
            if full:
                self._log_once("queue", "write queue full (%d); stores dropped",
                               self.opts.max_pending_writes)
                continue
            self._pool.submit(self._write, key, rel, obj)

    def _make_room(self, size: int, tenant: str = "") -> bool:
        """Reserve ``size`` bytes of ``tenant``, evicting LRU files (that tenant's first when
        it is over its quota); False if pinned files leave no room.

        The writer (a background thread) waits until its victims' files are deleted, so the
        directory never holds more than the capacity plus the writes in flight, however far the
        reaper lags on a busy machine; only ``evict`` (the caller's hot path) leaves them queued."""
        if not self._indexed.wait(INDEX_WAIT_S):  # capacity is known once the scan is done
            self._log_once("scan_wait", "the startup scan of %s is not done after %.0f s; stores "
                           "skipped meanwhile", self.root, INDEX_WAIT_S)
            return False
        with self._lock:
            over = self._index.bytes + self._index.reserved + size > self.capacity
        if over and self._rescans.due():
            self._rescan(only_if_due=True)
        short = self._reaper.short_batches
        limit = self._quotas.limit(tenant) if self._quotas is not None else None
        with self._lock:
            victims = self._index.reserve(size, self.capacity, tenant, limit)
            if victims is None:
                return False
            self._unlink_victims(victims)
        self._wait_deleted(victims)
        if victims and self._reaper.short_batches > short:
            # A victim was already gone: another process evicted it too, for a file of its own
            # that this view lacks. Look again, or each such race leaves the directory a chunk
            # over for good.
            self._trim_to_capacity(writer=True)
        return True

    def _wait_deleted(self, victims: list[tuple[str, Entry]]) -> None:
        if victims and not self._reaper.wait_gone([rel for rel, _ in victims], REAPER_WAIT_S):
            self._log_once("reaper", "deletes of evicted files lag past %.0f s; writing anyway "
                           "(the directory may exceed its capacity until they are done)",
                           REAPER_WAIT_S)

    # -- the byte-moving steps (the gds tier overrides these two) ---------------------------------
    def _prepare_write(self, key: CacheKey, rel: str, obj: MemoryObj) -> tuple[int, Callable[[str], int]]:
        """The file's size and a function that writes it at a path (returns bytes written)."""
        header, bufs, head = cf.encode_chunk_with_header(key, obj, self._auth)

        def write_file(path: str) -> int:
            written = write_chunk(path, obj, header, bufs, fsync=self.opts.fsync,
                                  direct=self.o_direct, file_mode=self.opts.mode, gid=self._gid)
            self._remember(rel, (header_digest(header, self._auth), head))
            return written

        return len(header) + sum(len(b) for b in bufs), write_file

    def _read_file(self, fd: int, key: CacheKey, layers: tuple[int, int] | None,
                   known: Known | None) -> tuple[MemoryObj | None, int, Known | None]:
        """Read (a layer range of) the open chunk file ``fd`` (a private open file description,
        opened by :meth:`_open_for_read`) into ``ctx.allocate`` memory, verified."""
        return read_chunk(fd, key, self._allocate, layers, direct=self.o_direct, known=known,
                          auth=self._auth)

    def _open_for_read(self, rel: str, held: int | None) -> int:
        """A private descriptor of ``rel``'s file: a fresh open of the ``held`` one (the file a
        pin keeps, even if unlinked since), else of the path (:func:`.fs.open_chunk`: no link
        followed, no blocking open, a regular file)."""
        if held is not None:
            return fs.reopen(fd_path(held))
        return fs.open_chunk(self._path(rel))

    def _write(self, key: CacheKey, rel: str, obj: MemoryObj) -> None:
        path = self._path(rel)
        reserved = 0
        try:
            if self._cancelled and rel in self._cancelled:
                return
            entry = stat_entry(path)  # another process (or an earlier run) stored it already
            if entry is not None:
                # counted as this write would have been: room made within the capacity and the
                # tenant's quota first (else this view holds more than either allows)
                if self._make_room(entry.size, key.tenant):
                    reserved = entry.size
                with self._lock:
                    self._index.add(rel, entry.size, entry.stamp)
                    self._index.unreserve(reserved, key.tenant)
                    reserved = 0
                return
            size, write_file = self._prepare_write(key, rel, obj)
            if not self._make_room(size, key.tenant):
                self._count("skipped_puts")
                self._log_once("full", "capacity %d bytes is full of pinned files; stores "
                               "skipped", self.capacity)
                return
            reserved = size
            written = write_file(path)
            with self._lock:
                self._index.add(rel, written, time.time())
                # in the same lock: the file is counted once (indexed), never twice (reserved too)
                self._index.unreserve(reserved, key.tenant)
                reserved = 0
                self._counters["writes"] += 1
                self._counters["disk_bytes_written"] += written
        except Exception as exc:  # noqa: BLE001 - OSError (full disk...) or not: never raised
            self._count("failed_puts")
            kind = errno.errorcode.get(getattr(exc, "errno", None) or 0, type(exc).__name__)
            self._log_once(f"write:{kind}", "store into %s failed: %s", self.root, exc)
        finally:
            fd = _open_quietly(path)  # opened before the lock (no I/O under it)
            with self._lock:
                # pinned while it was queued: held now, under the lock the pin looked at the
                # queue under (.lookup._pin), so no pin falls between the two
                taken = self._held.attach(rel, fd)
                self._index.unreserve(reserved, key.tenant)
                self._pending.pop(rel, None)
                self._cancelled.discard(rel)
                self._releasing += 1
            if fd is not None and not taken:
                os.close(fd)
            obj.ref_down()
            with self._lock:  # flush() is true only once the writer holds nothing
                self._releasing -= 1
                if not self._pending and not self._releasing:
                    self._idle.notify_all()

    # -- reads ----------------------------------------------------------------------------------
    def _read(self, key: CacheKey, layers: tuple[int, int] | None) -> MemoryObj | None:
        rel = self._rel(key)
        with self._lock:
            queued = self._pending.get(rel)
            if queued is not None and layers is None:  # not on disk yet: the bytes being written
                self._counters["pending_hits"] += 1
                return queued.ref_up()
            if rel in self._reaper:  # evicted, its file not deleted yet
                return None
            if queued is not None and queued.meta.fmt == MemoryFormat.KV_PAGES:
                queued.ref_up()  # a layer range of a chunk still being written: copied from it
            else:
                queued = None
            known = self._headers.get(rel)
        if queued is not None:  # a layer-wise load of a chunk whose write has not finished
            try:
                out = layer_range_copy(queued, layers, self._allocate)  # type: ignore[arg-type]
            finally:
                queued.ref_down()
            if out is not None:
                self._count("pending_hits")
            return out
        held = self._held.dup(rel)  # pinned: read the file we hold, even if it was unlinked
        fd = None
        try:
            fd = self._open_for_read(rel, held)
            obj, size, known = self._read_file(fd, key, layers, known)
        except FileNotFoundError:
            self._remember(rel, None)
            with self._lock:
                if self._index.remove(rel) is not None:
                    self._counters["vanished"] += 1
            return None
        except fs.NotRegular as exc:  # a link, a FIFO...: never followed, never blocks
            self._remember(rel, None)
            self._not_regular(rel, exc)
            return None
        except ForeignChunk as exc:  # another version's file: not ours to judge or delete
            self._other_version(rel, exc)
            return None
        except CorruptChunk as exc:
            self._remember(rel, None)
            self._held.drop(rel)
            self._quarantine(rel, exc)
            return None
        except ValueError as exc:  # a layer range the chunk does not have: the caller's mistake
            self._log_once("range", "bad layer range for %s: %s", key, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - OSError, or an I/O library's error: a miss
            self._count("read_errors")
            self._log_once("read", "read of %s failed: %r", self._path(rel), exc)
            return None
        finally:
            for d in (fd, held):
                if d is not None:
                    os.close(d)
        self._remember(rel, known)
        if obj is None:
            self._count("alloc_failures")
            self._log_once("alloc", "no memory to read chunks into; treated as misses")
            return None
        self._touch(rel, size)
        with self._lock:
            self._counters["reads"] += 1
            self._counters["disk_bytes_read"] += obj.nbytes
        return obj

    def tenant_usage(self) -> dict[str, int]:
        """Bytes of the files this process has indexed, per tenant id (from the names, so the
        files of every process sharing the directory count, once a rescan has seen them)."""
        with self._lock:
            if self._index.tenants is None:
                index = PosixIndex()
                index._lru = dict(self._index._lru)
                index.track_tenants()
                return dict(index.tenants or {})
            return dict(self._index.tenants)

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        return self._read(key, None)

    @hookimpl
    def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """:meth:`get` of each key in turn, in the calling thread: a read from the page cache
        costs less than handing it to another thread (``kvplug bench``: 96 keys of 256 KiB in
        one call ~2.5 GB/s, one bounded call per key ~0.5 GB/s on 2 cores). The StorageManager
        still spreads a large batch over its readers, one call per group of keys."""
        out: list[MemoryObj | None] = []
        try:
            for key in keys:
                out.append(self._read(key, None))
        except BaseException:  # the caller gets nothing: give back what was read so far
            for obj in out:
                if obj is not None:
                    obj.ref_down()
            raise
        return out

    @hookimpl
    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int) -> MemoryObj | None:
        return self._read(key, (first_layer, num_layers))

    # -- lifecycle ------------------------------------------------------------------------------
    @hookimpl
    def flush(self, timeout: float) -> bool:
        """Wait until every queued write and delete is done (the writer holds no object)."""
        deadline = self._rt.monotonic() + timeout
        with self._idle:
            if not self._idle.wait_for(lambda: not self._pending and not self._releasing,
                                       timeout):
                return False
        return self._reaper.drain(max(0.0, deadline - self._rt.monotonic()))

    @hookimpl
    def close(self) -> None:
        with self._lock:
            already_closed, self._closed = self._closed, True
        if already_closed:
            return
        scanning = not self._rt.wait_all([self._scanner], CLOSE_WAIT_S)
        self._scan_thread.shutdown(wait=False)
        if scanning:
            self._log_once("close_scan", "the startup scan of %s is still running after %.0f s "
                           "(a hung file system?); closing without it", self.root, CLOSE_WAIT_S)
        with self._idle:
            written = self._idle.wait_for(lambda: not self._pending, CLOSE_WAIT_S)
        if not written:
            self._log_once("close_writes", "%d writes still running after %.0f s (a hung file "
                           "system?); closing without them", len(self._pending), CLOSE_WAIT_S)
        self._pool.shutdown(wait=written, cancel_futures=not written)
        self._held.close()
        if self._writable and written and not scanning:
            # other processes may have written meanwhile: leave the bound kept
            try:
                self._trim_to_capacity()
            except OSError as exc:
                self._log_once("close", "final capacity check of %s failed: %s", self.root, exc)
        if not self._reaper.close(CLOSE_WAIT_S):  # every queued delete done
            self._log_once("close_deletes", "deletes of evicted files still running after %.0f "
                           "s; closing without them", CLOSE_WAIT_S)

    @hookimpl
    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counters)
            policy = self._index.policy
            if policy is not None and callable(getattr(policy, "stats", None)):
                out.update({f"eviction_{k}": v for k, v in (policy.stats() or {}).items()})
            if self._index.tenants is not None:
                out["tenants"] = len(self._index.tenants)
            out.update(entries=len(self._index), bytes=self._index.bytes, capacity=self.capacity,
                       indexed=int(self._indexed.is_set()),
                       pinned=len(self._index.pins), pending_writes=len(self._pending),
                       pending_deletes=len(self._reaper),
                       o_direct=int(self.o_direct), writable=int(self._writable))
        out.update(self._held.stats())
        return out
