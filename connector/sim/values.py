"""A remote value tier under the simulation: kvplug's real ``ValueStoreTier`` (the base of the
``resp`` and ``mooncake`` tiers: the queued batched writer, ``batched_get``, the header cache,
pins, the circuit breaker and the negative cache) over an in-process store of values.

Why not a real server: redis-server or Mooncake's master run in their own processes and answer
on their own time, and their clients block on sockets; the simulation's one thread could not
decide when a reply arrives, so a seed would not replay. The store here answers at once, and its
faults are the schedule's: values lost (evicted by the server), a store that is down (every call
raises, so the breaker opens and reads are misses) and batches answered in part.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvplug.backends.common.breaker import CircuitBreaker
from kvplug.backends.common.value_io import ValueIO
from kvplug.backends.common.value_tier import ValueStoreOptions, ValueStoreTier
from kvplug.hookspecs import TierContext
from kvplug.redact import Redactor
from pydantic import Field

#: url -> the store (one per rank and seed; the world drops it at close)
STORES: dict[str, SimStore] = {}


class SimStore:
    """The server: values, and the faults the schedule turns on."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.down = False  # every call raises (an outage)
        self.partial = 0  # the next batch reads answer only their first half, this many times
        self.lock = threading.Lock()


class SimValueIO(ValueIO):
    def __init__(self, name: str, url: str, breaker: CircuitBreaker) -> None:
        super().__init__(name, breaker, Redactor(url, {}))
        self.store = STORES.setdefault(url, SimStore())

    def _up(self) -> SimStore:
        if self.store.down:
            raise ConnectionError("simulated outage")
        return self.store

    def _exists(self, names: Sequence[str]) -> list[bool | None]:
        st = self._up()
        return [n in st.values for n in names]

    def _get(self, name: str) -> bytes | None:
        return self._up().values.get(name)

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        st = self._up()
        out = [st.values.get(n) for n in names]
        if st.partial and len(out) > 1:  # a reply cut short: the rest read as missing
            st.partial -= 1
            out[len(out) // 2:] = [None] * (len(out) - len(out) // 2)
        return out

    def _get_range(self, name: str, start: int, end: int) -> bytes | None:
        value = self._up().values.get(name)
        return None if value is None else value[start:end]

    def _set_many(self, items: Sequence[tuple[str, Any]]) -> list[BaseException | None]:
        st = self._up()
        for name, data in items:
            st.values[name] = bytes(data)
        return [None] * len(items)

    def _delete(self, names: Sequence[str]) -> None:
        st = self._up()
        for name in names:
            st.values.pop(name, None)


class SimValueTier(ValueStoreTier):
    """The value tier of the simulation (``kvplug.connector.sim.values:SimValueTier``)."""

    kind = "simulated value store"
    never_blocks = False

    class Options(ValueStoreOptions):
        url: str = Field(default="sim://default", description="the store's name in STORES")

    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        io = SimValueIO(ctx.name, ctx.options.url, breaker)
        return io, ctx.options.url
