"""What lookups pinned in a remote tier (resp, mooncake, fsspec), by store name: never evicted,
neither by ``evict`` nor by the writer making room under the tier's capacity bound."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvplug.pins import PinCounts


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
