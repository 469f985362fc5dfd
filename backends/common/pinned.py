"""Pins and eviction, answered the same way by every remote tier (resp, mooncake, fsspec) over
its store names: what a lookup pinned is never evicted; an unbounded evict asks the capacity
index for victims (sparing pinned names and stores in flight)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvplug.hookspecs import hookimpl
from kvplug.keys import CacheKey
from kvplug.pins import PinCounts

from .index import CapacityIndex
from .value_writer import ValueWriter


class PinnedStore:
    """Mixin: ``unpin`` and ``evict``, and :meth:`_pin_hits` for ``contains``. The tier sets
    ``_lock``, ``_pins``, ``_index`` and ``_writer`` and says how a key is named
    (:meth:`store_name`) and how names are deleted (:meth:`_delete`)."""

    _lock: threading.Lock
    _pins: PinCounts[str]
    _index: CapacityIndex
    _writer: ValueWriter

    def store_name(self, key: CacheKey) -> str:
        raise NotImplementedError

    def _delete(self, names: Sequence[str]) -> None:
        raise NotImplementedError

    def _pin_hits(self, names: Sequence[str], hits: Sequence[bool]) -> None:
        with self._lock:
            self._pins.pin_all(n for n, hit in zip(names, hits) if hit)

    @hookimpl
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        with self._lock:
            self._pins.unpin_all(self.store_name(k) for k in keys)

    def _pinned(self, name: str) -> bool:
        with self._lock:
            return name in self._pins

    @hookimpl
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        if keys is None:  # bounded by this process only; else the store's own policy evicts
            victims = self._index.shrink(nbytes, self._writer.protected)
        else:
            names = [n for n in map(self.store_name, keys) if not self._pinned(n)]
            victims = [(n, self._index.forget(n) or 0) for n in names]
        self._delete([n for n, _ in victims])
        return sum(s for _, s in victims)
