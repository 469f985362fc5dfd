"""Bookkeeping shared by the remote tiers (resp, mooncake, fsspec) over their store names:
short-lived lookup caches, the optional capacity index and what lookups pinned (never evicted,
neither by ``evict`` nor by the writer making room under the capacity bound).

A :class:`TTLSet` is guarded by its owner's lock (the reader's or the writer's). The
:class:`CapacityIndex` has a lock of its own, since the reader, the writer and eviction all report
objects to it; the ``protected`` callbacks it runs under that lock may take their owners' locks,
so no owner calls into the index while holding its own lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvplug.pins import PinCounts

#: ``(object name, size)`` of objects to delete to make room.
Victims = list[tuple[str, int]]


class TTLSet:
    """Paths remembered for ``ttl`` seconds (bounded; oldest forgotten first)."""

    def __init__(self, ttl: float, max_entries: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, path: str) -> None:
        if self.ttl <= 0:
            return
        self._until.pop(path, None)
        self._until[path] = self._clock() + self.ttl
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def discard(self, path: str) -> None:
        self._until.pop(path, None)

    def __contains__(self, path: str) -> bool:
        until = self._until.get(path)
        if until is None:
            return False
        if until < self._clock():
            del self._until[path]
            return False
        return True

    def __len__(self) -> int:
        return len(self._until)


class CapacityIndex:
    """Objects this process knows under the prefix, in LRU order, with their sizes, bounded by
    ``capacity`` bytes. With ``capacity=None`` the store is unbounded: nothing is tracked and
    nothing is ever chosen for eviction (expire objects with a bucket lifecycle rule instead).

    Bytes of writes in flight are reserved, so ``used`` never exceeds the capacity once a write
    has made room for itself.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._stored = 0
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def bounded(self) -> bool:
        return self.capacity is not None

    @property
    def used(self) -> int:
        """Bytes stored plus bytes reserved by writes in flight."""
        return self._stored + self._reserved

    def __contains__(self, path: str) -> bool:
        return path in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def learn(self, path: str, size: int, touch: bool = False) -> None:
        """Record an object seen under the prefix (a known one keeps its size); ``touch`` also
        marks it most recently used."""
        if self.capacity is None:
            return
        with self._lock:
            if path not in self._sizes:
                self._add(path, size)
            elif touch:
                self._sizes.move_to_end(path)

    def forget(self, path: str) -> int | None:
        """Drop an object (deleted, corrupt); its size if it was known."""
        with self._lock:
            size = self._sizes.pop(path, None)
            if size is not None:
                self._stored -= size
            return size

    def reserve(self, size: int, protected: Callable[[str], bool]) -> Victims | None:
        """Make room for a write of ``size`` bytes: the LRU objects to delete for it (removed from
        the index; ``size`` is reserved until :meth:`commit` or :meth:`release`), or ``None``
        (nothing changed) when the unprotected objects cannot make enough room."""
        if self.capacity is None:
            return []
        with self._lock:
            victims = self._victims(size, protected)
            if victims is not None:
                self._reserved += size
            return victims

    def commit(self, path: str, size: int) -> None:
        """A reserved write of ``size`` bytes is now the object ``path``."""
        if self.capacity is None:
            return
        with self._lock:
            self._reserved -= size
            self._add(path, size)

    def release(self, size: int) -> None:
        """A reserved write failed: give its bytes back."""
        if self.capacity is None:
            return
        with self._lock:
            self._reserved -= size

    def shrink(self, nbytes: int, protected: Callable[[str], bool]) -> Victims:
        """Objects to delete (removed from the index) so that ``nbytes`` more would fit; as many
        as can be found when the unprotected ones are not enough."""
        if self.capacity is None or nbytes <= 0:
            return []
        with self._lock:
            return self._victims(nbytes - max(0, self.capacity - self.used), protected) or []

    def stats(self) -> dict[str, float]:
        if self.capacity is None:
            return {}
        with self._lock:
            return {"entries": float(len(self._sizes)), "bytes": float(self.used),
                    "capacity": float(self.capacity)}

    def _add(self, path: str, size: int) -> None:
        old = self._sizes.pop(path, None)
        if old is not None:
            self._stored -= old
        self._sizes[path] = size
        self._stored += size

    def _victims(self, need: int, protected: Callable[[str], bool]) -> Victims | None:
        assert self.capacity is not None
        if need > self.capacity:
            return None
        excess = self.used + need - self.capacity
        if excess <= 0:
            return []
        chosen: Victims = []
        freed = 0
        for path, size in self._sizes.items():
            if freed >= excess:
                break
            if not protected(path):
                chosen.append((path, size))
                freed += size
        if freed < excess:
            return None
        for path, _ in chosen:
            self._stored -= self._sizes.pop(path)
        return chosen


class Pins:
    """The names lookups pinned, counted (thread-safe): shared by a tier and its writer, whose
    capacity evictions spare them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: PinCounts[str] = PinCounts()

    def pin_all(self, names: Iterable[str]) -> None:
        with self._lock:
            self._counts.pin_all(names)

    def unpin_all(self, names: Iterable[str]) -> None:
        with self._lock:
            self._counts.unpin_all(names)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._counts

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)
