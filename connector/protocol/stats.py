"""Connector statistics shown in vLLM's periodic "KV Transfer metrics" log line.

Workers and the scheduler each fill a :class:`KVPlugStats` with plain counters; vLLM sums them
across workers (``aggregate``), ships ``to_dict()`` to the front end, rebuilds the object through
``KVPlugConnector.build_kv_connector_stats`` and logs ``reduce()``; :mod:`..prom` turns the same
dict into Prometheus metrics. Per-tier counters are keys ``<counter>.<tier>`` (``TIER_PREFIX`` for
hit tokens, ``TIER_COUNTERS`` for the rest); a key holding a list (``load_latency.<tier>``) holds
samples for a histogram and is concatenated, not summed.
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
    "weight_resets",
    "refused_no_salt",
    "refused_mm_ids",
)
TIER_PREFIX = "tier_hit_tokens."
LOAD_BYTES_PREFIX = "tier_load_bytes."
LATENCY_PREFIX = "load_latency."  # per-request load seconds, by the farthest tier it read from
#: Per-tier counters sampled from ``StorageManager.stats()``: stats key -> the tier counters summed
#: into it (the metrics wrapper's, the StorageManager's ``faults``, the backends' own).
TIER_COUNTERS: dict[str, tuple[str, ...]] = {
    "tier_stored_bytes": ("bytes_written",),
    "tier_puts": ("puts",),
    "tier_put_seconds": ("put_seconds",),
    "tier_gets": ("gets",),
    "tier_get_seconds": ("get_seconds",),
    "tier_dropped_stores": ("dropped_puts", "skipped_puts", "failed_puts"),
    "tier_corrupt": ("corrupt",),
    "tier_auth_failures": ("auth_failures",),
    "tier_faults": ("faults", "deadline_misses"),
    "tier_evictions": ("evictions", "evicted"),
}
#: Per-tier levels sampled from ``StorageManager.stats()``: stats key -> the tier's own field.
#: Sent as their change since the last sample (summed over workers like the counters), so the
#: front end's gauge, adding the changes up, holds the level summed over ranks.
TIER_GAUGES: dict[str, str] = {
    "tier_used_bytes": "bytes",
    "tier_capacity_bytes": "capacity",
    "tier_entries": "entries",
    "tier_breaker_open": "breaker_open",
}

#: Per-tier, per-tenant bytes held (a tier's ``tenant_usage``): keys ``<this><tier>.<tenant id>``
#: (``-`` for chunks without a tenant), sent as changes like :data:`TIER_GAUGES`.
TENANT_PREFIX = "tier_tenant_bytes."
#: Tenants a tier reports by id (those holding the most bytes); the others' bytes are summed under
#: :data:`OTHER_TENANTS`, so a deployment with thousands of tenants keeps a bounded number of series.
TENANT_SERIES = 100
OTHER_TENANTS = "other"
#: how often a worker asks its tiers for their bytes per tenant (a disk tier counts its index)
TENANT_SAMPLE_S = 10.0


def capped_tenants(usage: dict[str, int]) -> dict[str, float]:
    """One tier's bytes per tenant as reported: the :data:`TENANT_SERIES` tenants holding the
    most by id (``-``: chunks without a tenant, always), the rest summed under
    :data:`OTHER_TENANTS`; tenants holding nothing left out."""
    out: dict[str, float] = {}
    named = sorted(((n, t) for t, n in usage.items() if t and n), reverse=True)
    for nbytes, tenant in named[:TENANT_SERIES]:
        out[tenant] = nbytes
    rest = sum(n for n, _ in named[TENANT_SERIES:])
    if rest:
        out[OTHER_TENANTS] = rest
    if usage.get("", 0):
        out["-"] = usage[""]
    return out


class KVPlugStats(KVConnectorStats):
    """Summable counters; ``reduce`` adds hit rate and GB/s."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def add(self, key: str, value: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def observe(self, key: str, value: float) -> None:
        """Add one histogram sample."""
        self.data.setdefault(key, []).append(value)

    def aggregate(self, other: KVConnectorStats) -> KVPlugStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data[k] = [*self.data.get(k, []), *v]
            elif isinstance(v, (int, float)):
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
            "weight_resets": d.get("weight_resets", 0),
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
        self._seen: dict[str, float] = {}  # last sampled tier counters
        self._tenant_seen: dict[str, float] = {}  # last sampled bytes per tier and tenant
        self._tenants_at = float("-inf")
        self._tenants_cost = 0.0  # seconds the last sample took

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._stats.add(key, value)
            self._total.add(key, value)

    def observe(self, key: str, value: float) -> None:
        with self._lock:
            self._stats.observe(key, value)

    def sample_tiers(self, tier_stats: dict[str, dict[str, float]]) -> None:
        """Add what each tier's counters (``StorageManager.stats()``) grew by since the last call."""
        with self._lock:
            for tier, counters in tier_stats.items():
                for key, names in TIER_COUNTERS.items():
                    now = sum(counters.get(n, 0) for n in names)
                    full = f"{key}.{tier}"
                    grew = now - self._seen.get(full, 0)
                    self._seen[full] = now
                    if grew > 0:
                        self._stats.add(full, grew)
                        self._total.add(full, grew)
                for key, name in TIER_GAUGES.items():
                    if name not in counters:  # a tier that does not keep this level
                        continue
                    full = f"{key}.{tier}"
                    change = counters[name] - self._seen.get(full, 0)
                    self._seen[full] = counters[name]
                    if change:
                        self._stats.add(full, change)

    def sample_tenants(self, storage: Any, now: float | None = None) -> None:
        """Every :data:`TENANT_SAMPLE_S` at most (and never sooner than 50x the time the last
        sample took), by the storage's runtime clock: each tier's bytes per tenant id (the tiers
        that can list them: ``StorageManager.tenant_usage``; :func:`capped_tenants`), as changes
        since the last sample (a tenant gone is sent back to 0, and the front end drops its
        series). Only tenant ids, never a salt."""
        clock = storage.runtime.monotonic  # (the simulation's own clock under it: replays)
        now = clock() if now is None else now
        if now - self._tenants_at < max(TENANT_SAMPLE_S, 50 * self._tenants_cost):
            return
        self._tenants_at = now
        start = clock()
        current: dict[str, float] = {}
        for tier in storage.tier_names:
            for tenant, nbytes in capped_tenants(storage.tenant_usage(tier) or {}).items():
                current[f"{TENANT_PREFIX}{tier}.{tenant}"] = nbytes
        self._tenants_cost = max(0.0, clock() - start)
        with self._lock:
            for full in set(current) | set(self._tenant_seen):
                change = current.get(full, 0) - self._tenant_seen.get(full, 0)
                if change:
                    self._stats.add(full, change)
            self._tenant_seen = current

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
