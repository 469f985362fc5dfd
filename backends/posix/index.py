"""The posix tier's index: which chunk files exist, their sizes, LRU order and this process's pins.

The directory is the source of truth; the index is a cache of it. It is rebuilt by :func:`scan`
at startup and merged with a fresh scan from time to time (other processes sharing the directory
add and evict files). The LRU stamp of a file is its mtime, which every reader bumps with
``os.utime`` — so processes sharing a directory share one LRU order. Not thread-safe by itself:
the backend guards it with its lock.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvplug import chunkfile as cf
from kvplug.pins import PinCounts


@dataclass
class Entry:
    size: int
    stamp: float  # last access (wall clock, comparable with file mtimes)


@dataclass
class ScanResult:
    entries: dict[str, Entry]
    started: float


def _is_shard(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def scan(root: Path, tmp_max_age_s: float = cf.TEMP_MAX_AGE_S) -> ScanResult:
    """Every chunk file under ``root`` (``"shard/name"`` -> size, mtime). Temporary files older
    than ``tmp_max_age_s`` (left by a writer that crashed, in any process) are deleted."""
    started = time.time()
    entries: dict[str, Entry] = {}
    try:
        shards = [d for d in os.scandir(root) if _is_shard(d.name) and d.is_dir()]
    except OSError:  # missing, not a directory, unreadable: nothing to index
        return ScanResult(entries, started)
    for shard in shards:
        try:
            files = list(os.scandir(shard.path))
        except OSError:
            continue
        for f in files:
            try:
                if cf.is_chunk_file(f.name):
                    st = f.stat()
                    entries[f"{shard.name}/{f.name}"] = Entry(st.st_size, st.st_mtime)
                elif cf.is_temp(f.name) and cf.is_stale_temp(f.name, f.stat().st_mtime, started,
                                                             tmp_max_age_s):
                    os.unlink(f.path)
            except OSError:  # removed by another process meanwhile, or not ours to delete
                continue
    return ScanResult(entries, started)


class PosixIndex:
    """LRU of chunk files (least recent first) with byte accounting; ``pins`` holds this
    process's pins (a pinned entry is never a victim)."""

    def __init__(self) -> None:
        self._lru: OrderedDict[str, Entry] = OrderedDict()
        self.pins: PinCounts[str] = PinCounts()
        self.bytes = 0
        self.reserved = 0  # bytes of writes in progress (not indexed until they finish)
        #: files of another format version (rolling upgrades): path -> inode; misses, kept on disk
        self.foreign: OrderedDict[str, int] = OrderedDict()

    def mark_foreign(self, rel: str, ino: int, limit: int = 4096) -> None:
        """Remember that ``rel`` (inode ``ino``) is another version's file: lookups miss it."""
        self.foreign[rel] = ino
        self.foreign.move_to_end(rel)
        if len(self.foreign) > limit:
            self.foreign.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, rel: str) -> bool:
        return rel in self._lru

    def add(self, rel: str, size: int, stamp: float) -> None:
        """Insert or refresh an entry as the most recently used."""
        old = self._lru.pop(rel, None)
        if old is not None:
            self.bytes -= old.size
        self._lru[rel] = Entry(size, stamp)
        self.bytes += size

    def touch(self, rel: str, stamp: float, size: int | None = None, every: float = 0.0) -> bool:
        """Make ``rel`` the most recently used entry at ``stamp``; one not indexed is added if
        its ``size`` is given. True when the file's own stamp (its mtime, the LRU shared with
        other processes) is due a bump too: the entry was added, or its stamp is ``every``
        seconds old or more."""
        entry = self._lru.get(rel)
        if entry is None:
            if size is not None:
                self.add(rel, size, stamp)
            return size is not None
        due = stamp - entry.stamp >= every
        entry.stamp = stamp
        self._lru.move_to_end(rel)
        return due

    def remove(self, rel: str) -> Entry | None:
        entry = self._lru.pop(rel, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    # -- eviction -------------------------------------------------------------------------------
    def take_victims(self, nbytes: int) -> list[tuple[str, Entry]]:
        """Remove and return least recently used unpinned entries totalling ``>= nbytes`` (or all
        unpinned ones if that is not enough)."""
        out: list[tuple[str, Entry]] = []
        freed = 0
        for rel, entry in self._lru.items():
            if freed >= nbytes:
                break
            if rel in self.pins:
                continue
            out.append((rel, entry))
            freed += entry.size
        for rel, _ in out:
            self.remove(rel)
        return out

    def reserve(self, size: int, capacity: int) -> list[tuple[str, Entry]] | None:
        """Reserve ``size`` bytes within ``capacity``: the LRU victims to delete for it, or None
        (nothing taken) when pinned entries leave no room."""
        over = self.bytes + self.reserved + size - capacity
        victims = self.take_victims(over) if over > 0 else []
        if over - sum(e.size for _, e in victims) > 0:
            for rel, entry in victims:  # not enough: keep what we took
                self.add(rel, entry.size, entry.stamp)
            return None
        self.reserved += size
        return victims

    def merge(self, result: ScanResult) -> None:
        """Adopt a fresh scan: files found are added (newest stamp wins), entries whose files
        vanished before the scan started are dropped; LRU order is rebuilt from stamps."""
        merged: dict[str, Entry] = {}
        for rel, entry in self._lru.items():
            found = result.entries.get(rel)
            if found is not None:
                merged[rel] = Entry(found.size, max(found.stamp, entry.stamp))
            elif entry.stamp >= result.started:  # written after the scan listed its shard
                merged[rel] = entry
        for rel, found in result.entries.items():
            merged.setdefault(rel, found)
        self._lru = OrderedDict(sorted(merged.items(), key=lambda kv: kv[1].stamp))
        self.bytes = sum(e.size for e in self._lru.values())


def stat_entry(path: str) -> Entry | None:
    """An index entry (size, mtime stamp) for a file, or None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Entry(st.st_size, st.st_mtime)


def unlink_entries(root: str, victims: list[tuple[str, Entry]]) -> tuple[int, list[tuple[str, OSError]]]:
    """Delete the files of evicted entries (``root`` ends with a separator): ``(bytes freed,
    [(path, error)])``. A file already gone (another process evicted it) frees nothing."""
    freed = 0
    failed: list[tuple[str, OSError]] = []
    for rel, entry in victims:
        try:
            os.unlink(root + rel)
            freed += entry.size
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append((root + rel, exc))
    return freed, failed
