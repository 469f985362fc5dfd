"""Bookkeeping for the fsspec tier: short-lived lookup caches and the optional capacity index.

Not thread-safe by themselves: the backend guards them with its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


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
    """Objects this process knows under the prefix, in LRU order, with their sizes.

    ``reserved`` counts bytes of writes in flight, so ``used`` never exceeds the capacity once a
    write has made room for itself.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.stored = 0
        self.reserved = 0

    @property
    def used(self) -> int:
        return self.stored + self.reserved

    def add(self, path: str, size: int) -> None:
        old = self.sizes.pop(path, None)
        if old is not None:
            self.stored -= old
        self.sizes[path] = size
        self.stored += size

    def touch(self, path: str) -> None:
        if path in self.sizes:
            self.sizes.move_to_end(path)

    def pop(self, path: str) -> int | None:
        size = self.sizes.pop(path, None)
        if size is not None:
            self.stored -= size
        return size

    def victims(self, need: int, protected: Callable[[str], bool]) -> list[tuple[str, int]] | None:
        """Remove and return LRU entries until ``need`` more bytes fit; ``None`` (and nothing
        removed) when the unprotected entries cannot make enough room."""
        if need > self.capacity:
            return None
        excess = self.used + need - self.capacity
        if excess <= 0:
            return []
        chosen: list[tuple[str, int]] = []
        freed = 0
        for path, size in self.sizes.items():
            if freed >= excess:
                break
            if not protected(path):
                chosen.append((path, size))
                freed += size
        if freed < excess:
            return None
        for path, _ in chosen:
            self.pop(path)
        return chosen
