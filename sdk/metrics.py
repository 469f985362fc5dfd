"""Per-tier metrics as pluggy wrappers: hits, misses, bytes, latency, for every backend for free."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from .hookspecs import hookimpl


class TierMetrics:
    """A ``wrapper=True`` plugin registered next to one tier's backend."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {
            "gets": 0, "hits": 0, "misses": 0, "bytes_read": 0, "get_seconds": 0.0,
            "puts": 0, "bytes_written": 0, "put_seconds": 0.0,
            "lookups": 0, "keys_looked_up": 0, "keys_found": 0, "lookup_seconds": 0.0,
        }

    def _add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def _reads(self, gets: int, hits: int, nbytes: int, seconds: float) -> None:
        """:meth:`_add` of a read's counters (every load passes here: no keyword dict)."""
        with self._lock:
            c = self.counters
            c["gets"] += gets
            c["hits"] += hits
            c["misses"] += gets - hits
            c["bytes_read"] += nbytes
            c["get_seconds"] += seconds

    @hookimpl(wrapper=True)
    def get(self, key):  # noqa: ANN001 - signature fixed by the spec
        t0 = time.perf_counter()
        obj = yield
        if obj is None:
            self._reads(1, 0, 0, time.perf_counter() - t0)
        else:
            self._reads(1, 1, obj.nbytes, time.perf_counter() - t0)
        return obj

    @hookimpl(wrapper=True)
    def batched_get(self, keys: Sequence):
        t0 = time.perf_counter()
        objs = yield
        hits = [o for o in objs or () if o is not None]
        self._reads(len(keys), len(hits), sum([o.nbytes for o in hits]),
                    time.perf_counter() - t0)
        return objs

    @hookimpl(wrapper=True)
    def batched_get_nowait(self, keys: Sequence):
        """Only its hits count (the keys it did not serve are asked again, and counted then)."""
        t0 = time.perf_counter()
        objs = yield
        hits = [o for o in objs or () if o is not None]
        if hits:
            self._reads(len(hits), len(hits), sum([o.nbytes for o in hits]),
                        time.perf_counter() - t0)
        return objs

    @hookimpl(wrapper=True)
    def batched_submit_put(self, keys: Sequence, objs: Sequence):
        t0 = time.perf_counter()
        result = yield
        self._add(
            puts=len(keys),
            bytes_written=sum(o.nbytes for o in objs),
            put_seconds=time.perf_counter() - t0,
        )
        return result

    @hookimpl(wrapper=True)
    def contains(self, keys: Sequence, pin: bool):
        t0 = time.perf_counter()
        result = yield
        found = sum(1 for r in result or () if r)
        self._add(
            lookups=1, keys_looked_up=len(keys), keys_found=found,
            lookup_seconds=time.perf_counter() - t0,
        )
        return result

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)
