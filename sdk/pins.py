"""Pin counts: how many lookups promised an entry to a request and have not yet released it.

``contains(pin=True)`` pins every entry it answers ``True`` for; ``unpin`` releases one pin; an
entry is protected from eviction while its count is above zero. Every tier that honours pins
keeps them in a :class:`PinCounts` (the owner's lock guards it; it takes none of its own).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PinCounts(Generic[K]):
    """A multiset of pinned keys: ``pin`` adds one, ``unpin`` removes one (unknown keys are
    ignored), ``key in pins`` while any pin is held."""

    def __init__(self) -> None:
        self._counts: dict[K, int] = {}

    def pin(self, key: K) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def unpin(self, key: K) -> None:
        count = self._counts.get(key, 0)
        if count > 1:
            self._counts[key] = count - 1
        elif count == 1:
            del self._counts[key]

    def pin_all(self, keys: Iterable[K]) -> None:
        for key in keys:
            self.pin(key)

    def unpin_all(self, keys: Iterable[K]) -> None:
        for key in keys:
            self.unpin(key)

    def count(self, key: K) -> int:
        return self._counts.get(key, 0)

    def discard(self, key: K) -> None:
        """Forget every pin of ``key`` (its entry is gone)."""
        self._counts.pop(key, None)

    def clear(self) -> None:
        self._counts.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        """How many distinct keys are pinned."""
        return len(self._counts)
