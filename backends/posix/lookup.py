"""Lookups, pins and eviction by key of the posix tier (a part of :class:`.PosixBackend`).

A lookup answers from the index, then with a ``stat`` for files other processes wrote; files
known to be of another format version are misses. A pin protects a file from this process's
eviction and, held open (:mod:`.held`), from every other process's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvplug.hookspecs import hookimpl
from kvplug.keys import CacheKey
from kvplug.policies.tenants import tenant_of_name

from .held import HeldFiles
from .index import PosixIndex, stat_entry

if TYPE_CHECKING:
    from kvplug.memory import MemoryObj

    from .index import Entry
    from .reaper import Reaper


class LookupAndPins:
    """The ``contains``/``unpin``/``evict`` hooks over the state :class:`.PosixBackend` owns."""

    _lock: threading.Lock
    _index: PosixIndex
    _held: HeldFiles
    _pending: dict[str, MemoryObj]
    _cancelled: set[str]
    _reaper: Reaper

    def _path(self, rel: str) -> str:
        raise NotImplementedError

    def _touch(self, rel: str, size: int | None = None) -> bool:
        raise NotImplementedError

    def _unlink_victims(self, victims: list[tuple[str, Entry]]) -> int:
        raise NotImplementedError

    def _unlink_now(self, victims: list[tuple[str, Entry]]) -> int:
        raise NotImplementedError

    def _rescan(self, only_if_due: bool = False) -> None:
        raise NotImplementedError

    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        rels = [self._rel(k) for k in keys]
        with self._lock:
            # a chunk still being written is a hit too: get() serves it from the queued object
            found = [rel in self._index or rel in self._pending for rel in rels]
        for i, rel in enumerate(rels):
            if found[i]:
                continue
            if rel in self._reaper:  # evicted, its file not deleted yet: a miss
                break
            entry = stat_entry(self._path(rel))  # another process may have written it
            if entry is None:
                # Lookups are prefix lookups: past the first real miss only the index answers
                # (no stat per key for a long run of misses; "on doubt, answer False").
                break
            found[i] = True
            with self._lock:
                if rel not in self._index:
                    self._index.add(rel, entry.size, entry.stamp)
        self._miss_other_versions(rels, found)
        for i, rel in enumerate(rels):
            if pin and found[i] and not self._pin(rel):
                found[i] = False
        return found

    def _miss_other_versions(self, rels: list[str], found: list[bool]) -> None:
        """Found files known to be of another format version (same inode still) are misses."""
        with self._lock:
            suspects = [i for i, rel in enumerate(rels) if found[i] and rel in self._index.foreign]
        for i in suspects:
            try:
                ino = os.stat(self._path(rels[i])).st_ino
            except OSError:
                ino = None
            with self._lock:
                if self._index.foreign.get(rels[i]) == ino:
                    found[i] = False
                else:  # replaced (or gone) since: judge it afresh
                    self._index.foreign.pop(rels[i], None)

    def _pin(self, rel: str) -> bool:
        """Pin ``rel``: never evicted by this process, held open against others (see .held),
        newest in the shared LRU. False (nothing pinned) when its file is gone."""
        with self._lock:
            self._index.pins.pin(rel)
            if rel in self._pending:
                # counted under the tier lock, so the writer (which hands its file to the held
                # pins under the same lock, .backend._write) holds the file once it lands
                return self._held.hold(rel, None)
        if self._held.hold(rel, self._path(rel)):
            self._touch(rel)  # newest in the shared LRU: other processes evict it last
            return True
        with self._lock:
            self._index.pins.unpin(rel)
            self._index.remove(rel)
        return False

    @hookimpl
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        rels = [self._rel(key) for key in keys]
        with self._lock:
            self._index.pins.unpin_all(rels)
        for rel in rels:
            self._held.release(rel)

    @hookimpl
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        """LRU victims (``keys`` None): their files are deleted in the background (.reaper);
        named keys: deleted now (the caller wants those files gone, as other processes see)."""
        victims, unindexed = [], []
        with self._lock:
            if keys is None:
                victims = self._index.take_victims(nbytes) if nbytes > 0 else []
                return self._unlink_victims(victims)
            for key in keys:
                rel = self._rel(key)
                if rel in self._index.pins:
                    continue
                if rel in self._pending:
                    self._cancelled.add(rel)
                entry = self._index.remove(rel)
                if entry is not None:
                    victims.append((rel, entry))
                else:
                    unindexed.append(rel)
        for rel in unindexed:  # another process's file, maybe: a stat, never under the lock
            entry = stat_entry(self._path(rel))
            if entry is not None:
                victims.append((rel, entry))
        return self._unlink_now(victims)


    @hookimpl
    def evict_tenant(self, tenant: str) -> list[int]:
        """Every unpinned file of ``tenant`` (by its name), after a rescan (so other processes'
        files count): deleted now, as an evict of named keys."""
        self._rescan()
        victims, kept = [], 0
        with self._lock:
            for rel in self._pending:  # queued, not begun: never written
                if tenant_of_name(rel) == tenant:
                    self._cancelled.add(rel)
            for rel in self._index.rels():
                if tenant_of_name(rel) != tenant:
                    continue
                if rel in self._index.pins:
                    kept += 1
                    continue
                entry = self._index.remove(rel)
                if entry is not None:
                    victims.append((rel, entry))
        self._unlink_now(victims)
        return [len(victims), kept]
