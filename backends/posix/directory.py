"""The posix tier's directory as this process knows it: the index under the tier's lock, kept
true and within capacity.

* The index (:mod:`.index`) is rebuilt at startup by a scan on a background thread (serving
  starts at once; a lookup the index cannot answer falls back to a ``stat``, so files not yet
  indexed, or written by another process, are found; writes wait for the scan, capacity needs
  it) and merged with a fresh scan from time to time (other processes add and evict files).
* Capacity: a write reserves its bytes; the victims (the index's LRU by file mtime, bumped on
  every read and pin and shared by all processes, or the tier's eviction policy; a tenant over
  its quota loses its own first) leave the index at once and their files are deleted by the
  :class:`.Reaper`. Pinned entries are never victims.
* Entries that cannot be used are judged here: vanished (a miss), not a regular file (a miss,
  left in place), damaged (deleted if still the file that was read), of another format version
  (a miss, left in place for the version that wrote it).

The lock (:attr:`Directory.lock`) is the tier's: the write queue (:mod:`.writer`) is guarded by
it too, because a store, a pin and an eviction look at both at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvplug.policies.tenants import tenant_of_name
from kvplug.runtime import Runtime

from ..common.bad_entries import BadEntries
from . import fs
from .index import Entry, PosixIndex, RescanClock, pack_rel, scan, stat_entry, unlink_entries
from .io import CorruptChunk, ForeignChunk, remove_if_same
from .reaper import Reaper

logger = logging.getLogger("kvplug.backends.posix")
_TOUCH_EVERY_S = 1.0  # an LRU stamp younger than this is not bumped again (saves a syscall)
#: how long a write waits for its victims' files to be deleted before it goes on (a stuck disk)
REAPER_WAIT_S = 60.0
#: a tier without quotas counts bytes per tenant (tenant_usage) from its index only up to this
#: many files (~0.1 s of CPU); a tier with quotas counts them as files come and go
COUNT_TENANTS_MAX = 50_000
#: how long a write waits for the startup scan (a hung file system) before its store is skipped
INDEX_WAIT_S = 60.0

#: ``warn(what, msg, *args)``: log one kind of problem once per tier (:class:`kvplug.logs.LogOnce`)
Warn = Callable[..., None]


class Directory:
    """The index of the chunk files under ``root`` (a resolved directory), ``capacity`` bytes."""

    def __init__(self, root: Path, capacity: int, name: str, runtime: Runtime, warn: Warn,
                 bad: BadEntries, *, policy: Any = None, quotas: Any = None,
                 rescan_interval_s: float = 10.0) -> None:
        self.root = root
        self.root_s = str(root) + os.sep
        self.capacity = capacity
        self.name = name
        self._rt = runtime
        self._warn = warn
        #: the one policy for corrupt and other-version entries (counts, logs, deletes)
        self.bad = bad
        self.lock = threading.Lock()
        self.index = PosixIndex(policy)
        #: per-tenant byte quotas (the tier's ``quotas``): tenants counted from file names
        self.quotas = quotas
        if quotas is not None:
            self.index.track_tenants()
        self.counters = dict.fromkeys(
            ("evictions", "rescans", "vanished", "not_regular"), 0)
        self._rescans = RescanClock(rescan_interval_s, runtime.monotonic)
        self._scan_lock = threading.Lock()
        #: set once the startup scan has indexed the directory (lookups need not wait for it)
        self.indexed = runtime.event()
        self.reaper = Reaper(self.root_s, self._unlink_failed, name, runtime)
        self._stamps: dict[str, float] = {}  # mtimes to bump on the reaper's thread, by rel
        self._scan_thread = runtime.executor(1, f"kvplug-{name}-scan", daemon=True)
        self.scanner: Any = None

    def start_scan(self, around: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Start the startup scan in the background; ``around(trim)`` runs the trim to capacity
        with what must happen before and after it (the operator's pins restored)."""
        self.scanner = self._scan_thread.submit(self._initial_scan, around)

    def path(self, rel: str) -> str:
        return self.root_s + rel

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    # -- scans ----------------------------------------------------------------------------------
    def _initial_scan(self, around: Callable[[Callable[[], None]], None] | None) -> None:
        """Index the directory in the background: serving starts at once (a lookup the index
        cannot answer yet falls back to a ``stat``), stores wait for it (capacity needs it)."""
        try:
            if around is None:
                self.trim_to_capacity()
            else:
                around(self.trim_to_capacity)
        except Exception as exc:  # noqa: BLE001 - never raised into a thread's void
            self._warn("scan", "scan of %s failed: %r", self.root, exc)
        finally:
            self.indexed.set()

    def stop_scanning(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the startup scan, then stop its thread; False if it is
        still running (a hung file system: the daemon thread is left to finish)."""
        done = self.scanner is None or self._rt.wait_all([self.scanner], timeout)
        self._scan_thread.shutdown(wait=False)
        return done

    def rescan(self, only_if_due: bool = False) -> None:
        """Merge a fresh scan into the index; the scan and the sort run without the lock."""
        if not self._scan_lock.acquire(timeout=INDEX_WAIT_S):  # one at a time (bounded)
            self._warn("rescan_wait", "a scan of %s has run for over %.0f s (a hung file "
                       "system?); this rescan is skipped", self.root, INDEX_WAIT_S)
            return
        try:
            if only_if_due and not self._rescans.due():
                return
            cpu0 = time.thread_time()
            with self.lock:
                current = self.index.begin_merge()
                doomed = self.reaper.doomed()  # evicted before the scan: not indexed again
            try:
                found = scan(self.root, self._rt.time)
                for rel in doomed:
                    found.entries.pop(pack_rel(rel, register=False), None)
                prepared = PosixIndex.prepare_merge(current, found)
            except BaseException:
                with self.lock:
                    self.index.abort_merge()
                raise
            with self.lock:
                self.index.finish_merge(prepared)
                self._rescans.scanned(cpu0)
                self.counters["rescans"] += 1
        finally:
            self._scan_lock.release()

    # -- capacity -------------------------------------------------------------------------------
    def trim_to_capacity(self, writer: bool = False) -> None:
        """Rescan the directory and delete LRU files until it is within capacity (the writes
        reserved included): at startup and close on this thread (no write lands meanwhile), for
        a ``writer`` through the reaper, waiting until the files are gone."""
        self.rescan()
        with self.lock:
            victims = self.index.take_victims(
                self.index.bytes + self.index.reserved - self.capacity)
            if writer:
                self.unlink_victims(victims)
        if writer:
            self._wait_deleted(victims)
        else:
            self.unlink_now(victims)

    def make_room(self, size: int, tenant: str = "") -> bool:
        """Reserve ``size`` bytes of ``tenant``, evicting LRU files (that tenant's first when
        it is over its quota); False if pinned files leave no room.

        The writer (a background thread) waits until its victims' files are deleted, so the
        directory never holds more than the capacity plus the writes in flight, however far the
        reaper lags on a busy machine; only ``evict`` (the caller's hot path) leaves them queued."""
        if not self.indexed.wait(INDEX_WAIT_S):  # capacity is known once the scan is done
            self._warn("scan_wait", "the startup scan of %s is not done after %.0f s; stores "
                       "skipped meanwhile", self.root, INDEX_WAIT_S)
            return False
        with self.lock:
            over = self.index.bytes + self.index.reserved + size > self.capacity
        # A view with room may still lack the files other processes wrote since it last looked:
        # with rescan_interval_s 0 every write looks again, else one that needs room does.
        if (over or self._rescans.every_write) and self._rescans.due():
            self.rescan(only_if_due=True)
        short = self.reaper.short_batches
        limit = self.quotas.limit(tenant) if self.quotas is not None else None
        with self.lock:
            victims = self.index.reserve(size, self.capacity, tenant, limit)
            if victims is None:
                return False
            self.unlink_victims(victims)
        self._wait_deleted(victims)
        if victims and self.reaper.short_batches > short:
            # A victim was already gone: another process evicted it too, for a file of its own
            # that this view lacks. Look again, or each such race leaves the directory a chunk
            # over for good.
            self.trim_to_capacity(writer=True)
        return True

    def _wait_deleted(self, victims: list[tuple[str, Entry]]) -> None:
        if victims and not self.reaper.wait_gone([rel for rel, _ in victims], REAPER_WAIT_S):
            self._warn("reaper", "deletes of evicted files lag past %.0f s; writing anyway (the "
                       "directory may exceed its capacity until they are done)", REAPER_WAIT_S)

    def unlink_victims(self, victims: list[tuple[str, Entry]]) -> int:
        """Under the lock (so no put of a victim slips in before it is doomed): queue the
        victims' files for deletion in the background (:mod:`.reaper`); their bytes."""
        if victims:
            self.counters["evictions"] += len(victims)
        return self.reaper.delete(victims)

    def unlink_now(self, victims: list[tuple[str, Entry]]) -> int:
        """Delete the victims' files on this thread (not under the lock); the bytes freed."""
        freed, failed = unlink_entries(self.root_s, victims)
        for path, exc in failed:
            self._unlink_failed(path, exc)
        self.count("evictions", len(victims))
        return freed

    def _unlink_failed(self, path: str, exc: OSError) -> None:
        self._warn("unlink", "cannot delete %s: %s", path, exc)

    def evict_lru(self, nbytes: int) -> int:
        """Free ``nbytes`` under the tier's order: the victims' files are deleted in the
        background (:mod:`.reaper`); their bytes."""
        with self.lock:
            return self.unlink_victims(self.index.take_victims(nbytes) if nbytes > 0 else [])

    def evict(self, rels: Sequence[str], cancel: Callable[[str], None]) -> int:
        """Delete the files of ``rels`` now (the caller wants them gone, as other processes
        see), pinned ones excepted; ``cancel(rel)`` (under the lock) stops a queued write of
        each. The bytes freed."""
        victims, unindexed = [], []
        with self.lock:
            for rel in rels:
                if rel in self.index.pins:
                    continue
                cancel(rel)
                entry = self.index.remove(rel)
                if entry is not None:
                    victims.append((rel, entry))
                else:
                    unindexed.append(rel)
        for rel in unindexed:  # another process's file, maybe: a stat, never under the lock
            entry = stat_entry(self.path(rel))
            if entry is not None:
                victims.append((rel, entry))
        return self.unlink_now(victims)

    def evict_tenant(self, tenant: str, queued: Callable[[], Sequence[str]],
                     cancel: Callable[[str], None]) -> list[int]:
        """Every unpinned file of ``tenant`` (by its name), after a rescan (so other processes'
        files count), deleted now; its writes ``queued()`` are called off (``cancel``, under the
        lock). ``[removed, left pinned]``."""
        self.rescan()
        victims, kept = [], 0
        with self.lock:
            for rel in queued():
                if tenant_of_name(rel) == tenant:
                    cancel(rel)
            for rel in self.index.rels():
                if tenant_of_name(rel) != tenant:
                    continue
                if rel in self.index.pins:
                    kept += 1
                    continue
                entry = self.index.remove(rel)
                if entry is not None:
                    victims.append((rel, entry))
        self.unlink_now(victims)
        return [len(victims), kept]

    def touch(self, rel: str, size: int | None = None, *, later: bool = False) -> bool:
        """Make ``rel`` the most recently used entry here and in the LRU shared with other
        processes (its mtime, bumped at most every ``_TOUCH_EVERY_S``); an entry not in the
        index is added with ``size`` (skipped if ``size`` is None). False if the file is gone.
        ``later``: the mtime is bumped on the reaper's thread (a read that must not wait on the
        file system), and True is returned."""
        now = self._rt.time()
        with self.lock:
            due = self.index.touch(rel, now, size, _TOUCH_EVERY_S)
            start = later and due and not self._stamps
            if later and due:
                self._stamps[rel] = now
        if later:
            if start:
                self.reaper.later(self._stamp_files)
            return True
        try:
            if due:
                fs.touch_chunk(self.path(rel), now)
        except FileNotFoundError:
            return False
        except OSError:
            pass  # read-only: the LRU stamp is advisory
        return True

    def _stamp_files(self) -> None:
        """Bump the mtimes that reads without waiting left for later (on the reaper's thread)."""
        with self.lock:
            stamps, self._stamps = self._stamps, {}
        for rel, stamp in stamps.items():
            try:
                fs.touch_chunk(self.path(rel), stamp)
            except OSError:
                pass  # gone or read-only: the LRU stamp is advisory

    # -- lookups --------------------------------------------------------------------------------
    def find_unindexed(self, rels: list[str], found: list[bool]) -> None:
        """Complete a lookup the index answered (``found``): a miss that is on disk all the same
        (another process wrote it, or the scan has not reached it) is found by a ``stat`` and
        indexed, up to the first real miss; a file known to be of another version is a miss."""
        for i, rel in enumerate(rels):
            if found[i]:
                continue
            if self.adopt(rel) is None:
                # Lookups are prefix lookups: past the first real miss only the index answers
                # (no stat per key for a long run of misses; "on doubt, answer False").
                break
            found[i] = True
        self._miss_other_versions(rels, found)

    def adopt(self, rel: str) -> int | None:
        """Index ``rel``'s file if it is on disk though not indexed here (another process wrote
        it, or the scan has not reached it); its size, or None if there is no file to adopt.

        An evicted file whose delete is still queued is none: its bytes already made room for
        a write, so indexing it again would count them twice (over the capacity or a quota)."""
        if rel in self.reaper:
            return None
        entry = stat_entry(self.path(rel))
        if entry is None:
            return None
        with self.lock:
            if rel not in self.index:
                self.index.add(rel, entry.size, entry.stamp)
        return entry.size

    def _miss_other_versions(self, rels: list[str], found: list[bool]) -> None:
        """Found files known to be of another format version (same inode still) are misses."""
        with self.lock:
            suspects = [i for i, rel in enumerate(rels) if found[i] and rel in self.index.foreign]
        for i in suspects:
            try:
                ino = os.stat(self.path(rels[i])).st_ino
            except OSError:
                ino = None
            with self.lock:
                if self.index.foreign.get(rels[i]) == ino:
                    found[i] = False
                else:  # replaced (or gone) since: judge it afresh
                    self.index.foreign.pop(rels[i], None)

    def open_held(self, rel: str) -> int | None:
        """Open ``rel``'s file to hold it pinned (:mod:`.held`); None if missing or unusable."""
        try:
            return fs.open_chunk(self.path(rel))
        except FileNotFoundError:
            return None
        except fs.NotRegular as exc:
            self.not_regular(rel, exc)
            return None

    # -- entries that cannot be used ----------------------------------------------------------
    def vanished(self, rel: str) -> None:
        """``rel``'s file is gone (another process evicted it): a miss, counted if indexed."""
        with self.lock:
            if self.index.remove(rel) is not None:
                self.counters["vanished"] += 1

    def not_regular(self, rel: str, exc: OSError) -> None:
        """An entry at a chunk path that is not a regular file in a real shard directory (a
        link, a FIFO...): a miss, counted, logged once, left in place (the next store of the
        key replaces it)."""
        with self.lock:
            self.index.remove(rel)
            self.counters["not_regular"] += 1
        self._warn("not_regular", "%s is not a chunk file (%s); treated as a miss, never "
                   "followed nor opened for I/O", self.path(rel), exc.strerror or exc)

    def quarantine(self, rel: str, err: CorruptChunk) -> None:
        """A damaged file: unindexed, and through the tier's :class:`BadEntries` counted,
        logged once and deleted (only if it is still the file that was read)."""
        path = self.path(rel)
        with self.lock:
            self.index.remove(rel)
        self.bad.corrupt(str(path), str(err), lambda: remove_if_same(path, err.ino))

    def other_version(self, rel: str, err: ForeignChunk) -> None:
        """A file of another format version: a miss for reads and lookups (while it is the same
        inode), left on disk; counted and logged once through :class:`BadEntries`."""
        with self.lock:
            self.index.mark_foreign(rel, err.ino)
        self.bad.other_version(str(self.path(rel)), err)

    # -- figures --------------------------------------------------------------------------------
    def tenant_usage(self) -> dict[str, int]:
        """Bytes of the files this process has indexed, per tenant id (from the names, so the
        files of every process sharing the directory count, once a rescan has seen them); a tier
        without quotas counts at most :data:`COUNT_TENANTS_MAX` files (else: ``{}``)."""
        with self.lock:
            if self.index.tenants is not None:  # a tier with quotas counts as it goes
                return dict(self.index.tenants)
            if len(self.index) > COUNT_TENANTS_MAX:
                return {}  # counting would cost a metrics scrape too much: set quotas
            index = PosixIndex()
            index._lru = dict(self.index._lru)  # counted from a copy, outside the lock
        index.track_tenants()
        return dict(index.tenants or {})

    def stats_locked(self) -> dict[str, float]:
        """Under the lock: the directory's counters and figures."""
        out: dict[str, float] = {**self.counters, **self.bad.stats()}
        policy = self.index.policy
        if policy is not None and callable(getattr(policy, "stats", None)):
            out.update({f"eviction_{k}": v for k, v in (policy.stats() or {}).items()})
        if self.index.tenants is not None:
            out["tenants"] = len(self.index.tenants)
        out.update(entries=len(self.index), bytes=self.index.bytes, capacity=self.capacity,
                   indexed=int(self.indexed.is_set()), pinned=len(self.index.pins),
                   pending_deletes=len(self.reaper))
        return out
