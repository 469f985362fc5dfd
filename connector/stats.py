"""Connector statistics shown in vLLM's periodic "KV Transfer metrics" log line.

Workers and the scheduler each fill a :class:`KVPlugStats` with plain counters; vLLM sums them
across workers (``aggregate``), ships ``to_dict()`` to the front end, rebuilds the object through
``KVPlugConnector.build_kv_connector_stats`` and logs ``reduce()``. Per-tier hit counters are keys
``tier_hit_tokens.<tier>``.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: Counters summed across processes and intervals.
COUNTERS = (
    "lookups",
    "lookup_query_tokens",
    "lookup_hit_tokens",
    "lookup_timeouts",
    "loads",
    "load_tokens",
    "load_bytes",
    "load_seconds",
    "load_failures",
    "failed_blocks",
    "stores",
    "store_tokens",
    "store_bytes",
    "store_seconds",
    "store_failures",
)
TIER_PREFIX = "tier_hit_tokens."


class KVPlugStats(KVConnectorStats):
    """Summable counters; ``reduce`` adds hit rate and GB/s."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def add(self, key: str, value: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVPlugStats:
        for k, v in other.data.items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "lookups": d.get("lookups", 0),
            "hit_tokens": d.get("lookup_hit_tokens", 0),
            "hit_rate": round(d.get("lookup_hit_tokens", 0) / d["lookup_query_tokens"], 3)
            if d.get("lookup_query_tokens")
            else 0.0,
            "loaded_tokens": d.get("load_tokens", 0),
            "loaded_MB": round(d.get("load_bytes", 0) / 1e6, 1),
            "load_GBps": _gbps(d.get("load_bytes", 0), d.get("load_seconds", 0)),
            "stored_tokens": d.get("store_tokens", 0),
            "stored_MB": round(d.get("store_bytes", 0) / 1e6, 1),
            "store_GBps": _gbps(d.get("store_bytes", 0), d.get("store_seconds", 0)),
            "failures": d.get("load_failures", 0) + d.get("store_failures", 0)
            + d.get("lookup_timeouts", 0),
        }
        for k, v in sorted(d.items()):
            if k.startswith(TIER_PREFIX) and v:
                out["hit_tokens_" + k[len(TIER_PREFIX):]] = v
        return out


def _gbps(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


class StatsRecorder:
    """Thread-safe accumulator a process drains once per step into a :class:`KVPlugStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVPlugStats()
        self._total = KVPlugStats()

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._stats.add(key, value)
            self._total.add(key, value)

    def take(self) -> KVPlugStats | None:
        """The counters since the last call, or None when nothing happened."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVPlugStats()
            return out

    def totals(self) -> dict[str, Any]:
        """Everything since start (never reset): for tests and the demo."""
        with self._lock:
            return dict(self._total.data)
