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

from kvplug import chunk_format as cf

from .posix_io import TMP_SUFFIX


@dataclass
class Entry:
    size: int
    stamp: float  # last access (wall clock, comparable with file mtimes)


@dataclass
class ScanResult:
    entries: dict[str, Entry]
    stale_tmp: list[Path]
    started: float


def _is_shard(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def scan(root: Path, tmp_max_age_s: float = 600.0) -> ScanResult:
    """Every chunk file under ``root`` (``"shard/name"`` -> size, mtime), plus temporary files
    older than ``tmp_max_age_s`` (left by a writer that crashed)."""
    started = time.time()
    entries: dict[str, Entry] = {}
    stale: list[Path] = []
    try:
        shards = [d for d in os.scandir(root) if _is_shard(d.name) and d.is_dir()]
    except OSError:  # missing, not a directory, unreadable: nothing to index
        return ScanResult(entries, stale, started)
    for shard in shards:
        try:
            files = list(os.scandir(shard.path))
        except OSError:
            continue
        for f in files:
            try:
                if f.name.endswith(cf.FILE_SUFFIX) and not f.name.startswith("."):
                    st = f.stat()
                    entries[f"{shard.name}/{f.name}"] = Entry(st.st_size, st.st_mtime)
                elif f.name.startswith(".") and f.name.endswith(TMP_SUFFIX):
                    if f.stat().st_mtime < started - tmp_max_age_s:
                        stale.append(Path(f.path))
            except FileNotFoundError:  # removed by another process meanwhile
                continue
    return ScanResult(entries, stale, started)


class PosixIndex:
    """LRU of chunk files (least recent first) with byte accounting and pin counts."""

    def __init__(self) -> None:
        self._lru: OrderedDict[str, Entry] = OrderedDict()
        self._pins: dict[str, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, rel: str) -> bool:
        return rel in self._lru

    def get(self, rel: str) -> Entry | None:
        return self._lru.get(rel)

    def add(self, rel: str, size: int, stamp: float) -> None:
        """Insert or refresh an entry as the most recently used."""
        old = self._lru.pop(rel, None)
        if old is not None:
            self.bytes -= old.size
        self._lru[rel] = Entry(size, stamp)
        self.bytes += size

    def touch(self, rel: str, stamp: float) -> None:
        entry = self._lru.get(rel)
        if entry is not None:
            entry.stamp = stamp
            self._lru.move_to_end(rel)

    def remove(self, rel: str) -> Entry | None:
        entry = self._lru.pop(rel, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    # -- pins -----------------------------------------------------------------------------------
    def pin(self, rel: str) -> None:
        self._pins[rel] = self._pins.get(rel, 0) + 1

    def unpin(self, rel: str) -> None:
        count = self._pins.get(rel, 0)
        if count > 1:
            self._pins[rel] = count - 1
        elif count == 1:
            del self._pins[rel]

    def pinned(self, rel: str) -> bool:
        return rel in self._pins

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    # -- eviction -------------------------------------------------------------------------------
    def take_victims(self, nbytes: int) -> list[tuple[str, Entry]]:
        """Remove and return least recently used unpinned entries totalling ``>= nbytes`` (or all
        unpinned ones if that is not enough)."""
        out: list[tuple[str, Entry]] = []
        freed = 0
        for rel, entry in self._lru.items():
            if freed >= nbytes:
                break
            if rel in self._pins:
                continue
            out.append((rel, entry))
            freed += entry.size
        for rel, _ in out:
            self.remove(rel)
        return out

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
