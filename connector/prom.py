"""kvplug's Prometheus metrics on vLLM's ``/metrics`` (``KVConnectorBase_V1.build_prom_metrics``).

vLLM's front end builds :class:`KVPlugPromMetrics` once and calls ``observe`` with each interval's
:class:`~kvplug.connector.protocol.stats.KVPlugStats` dict (summed over the workers and the scheduler).
Names start with ``vllm:kvplug_`` so vLLM's own ``unregister_vllm_metrics`` cleans them up too;
counters show with prometheus_client's ``_total`` suffix. Per-tier metrics carry a ``tier`` label
(the tier's name in the kvplug config); labels for a tier appear once it has something to count.
Per-tier levels (used and capacity bytes, entries, breakers open) are gauges, fed with their
changes (:data:`.stats.TIER_GAUGES`), as is the bytes held per tier and tenant (label ``tenant``:
the tenant's 16-hex id, never its salt; one series per tenant a tier holds, for the
:data:`.stats.TENANT_SERIES` tenants holding the most, the rest summed as ``other``; a tenant's
series goes when it holds nothing). These names are a
stable interface: dashboards and alerts (``deploy/``) use them; README.md "Metrics" lists them.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .protocol.stats import (
    LATENCY_PREFIX,
    LOAD_BYTES_PREFIX,
    TENANT_PREFIX,
    TIER_COUNTERS,
    TIER_GAUGES,
    TIER_PREFIX,
)

#: Backends whose hits vLLM's ``prompt_tokens_cached_by_source`` counts as ``disk``.
_DISK_BACKENDS = {"posix", "gds"}


def hit_sources(fast: int, slow: int, backends: list[str]) -> dict[CacheHitSource, int]:
    """vLLM's cache-hit sources of a kvplug hit: tokens a tier that never blocks held (host RAM)
    and tokens only a tier that may block held: ``disk`` when every such configured tier is a
    local disk (posix, gds), else ``external_unspecified`` (remote or third-party)."""
    slow_tiers = [b for b in backends if b != "local_cpu"]
    far = (CacheHitSource.DISK if slow_tiers and set(slow_tiers) <= _DISK_BACKENDS
           else CacheHitSource.EXTERNAL_UNSPECIFIED)
    return {src: n for src, n in ((CacheHitSource.HOST, fast), (far, slow)) if n}


#: stats key -> (metric name, help) for the counters without a tier.
_COUNTERS = {
    "lookups": ("vllm:kvplug_lookups", "kvplug lookups of requests that could load"),
    "lookup_query_tokens": ("vllm:kvplug_lookup_query_tokens",
                            "prompt tokens kvplug was asked about"),
    "lookup_hit_tokens": ("vllm:kvplug_lookup_hit_tokens", "tokens kvplug's tiers held"),
    "lookup_timeouts": ("vllm:kvplug_lookup_timeouts", "lookups past lookup_timeout_s (misses)"),
    "inline_local_loads": ("vllm:kvplug_inline_local_loads",
                           "hits of a local disk tier loaded inside the engine step "
                           "(in_step_load_bytes)"),
    "load_failures": ("vllm:kvplug_load_errors", "request loads with a missing/invalid chunk"),
    "failed_blocks": ("vllm:kvplug_failed_blocks", "blocks vLLM recomputed after a load error"),
    "store_tokens": ("vllm:kvplug_stored_tokens", "tokens the connector handed to the tiers"),
    "store_failures": ("vllm:kvplug_store_failures", "stores the connector could not stage"),
    "refused_no_salt": ("vllm:kvplug_refused_no_salt",
                        "requests without cache_salt not cached (require_cache_salt)"),
    "refused_mm_ids": ("vllm:kvplug_refused_mm_ids",
                       "multimodal requests not cached: identifiers not content hashes"),
}
#: per-tier stats key prefix -> (metric name, help).
_TIER_COUNTERS = {
    TIER_PREFIX: ("vllm:kvplug_hit_tokens", "tokens loaded into vLLM's KV cache, by tier"),
    LOAD_BYTES_PREFIX: ("vllm:kvplug_loaded_bytes", "bytes loaded into vLLM's KV cache, by tier"),
    "tier_stored_bytes.": ("vllm:kvplug_stored_bytes",
                           "bytes handed to the tier to store (promotions into L1 included)"),
    "tier_puts.": ("vllm:kvplug_tier_puts", "chunks handed to the tier to store"),
    "tier_put_seconds.": ("vllm:kvplug_tier_put_seconds", "seconds in the tier's put calls"),
    "tier_gets.": ("vllm:kvplug_tier_gets", "chunk reads from the tier"),
    "tier_get_seconds.": ("vllm:kvplug_tier_get_seconds", "seconds in the tier's get calls"),
    "tier_dropped_stores.": ("vllm:kvplug_dropped_stores",
                             "stores the tier dropped (full, queue full, write error)"),
    "tier_corrupt.": ("vllm:kvplug_corrupt_entries", "corrupt entries found (treated as misses)"),
    "tier_auth_failures.": ("vllm:kvplug_auth_failures",
                            "chunks that failed authentication (auth_key_env): never served"),
    "tier_faults.": ("vllm:kvplug_tier_faults", "tier calls that raised or timed out (reads "
                     "past a step's in_step_load_deadline_s included)"),
    "tier_evictions.": ("vllm:kvplug_evictions", "entries the tier evicted"),
}
assert {k + "." for k in TIER_COUNTERS} <= set(_TIER_COUNTERS)
#: per-tier levels (gauges, summed over ranks) -> (metric name, help).
_TIER_GAUGES = {
    "tier_used_bytes.": ("vllm:kvplug_tier_used_bytes", "bytes the tier holds"),
    "tier_capacity_bytes.": ("vllm:kvplug_tier_capacity_bytes", "the tier's capacity in bytes"),
    "tier_entries.": ("vllm:kvplug_tier_entries", "entries the tier holds"),
    "tier_breaker_open.": ("vllm:kvplug_breaker_open",
                           "ranks whose circuit breaker of the tier is open (calls refused)"),
}
assert {k + "." for k in TIER_GAUGES} == set(_TIER_GAUGES)
#: bytes held per tier and tenant (labels ``tier``, ``tenant``: the tenant's 16-hex id, ``-``
#: for chunks without one; never a salt), on the tiers that can list entries (L1, posix)
_TENANT_GAUGE = ("vllm:kvplug_tier_tenant_bytes",
                 "bytes the tier holds per tenant (its 16-hex id; '-': no tenant)")
#: Load latency buckets (seconds): a memcpy from RAM to a remote read.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


class KVPlugPromMetrics(KVConnectorPromMetrics):
    """Counters and a load-latency histogram, per engine (and per tier where it applies)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._plain = {key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                       for key, (name, doc) in _COUNTERS.items()}
        tiered = [*labelnames, "tier"]
        self._tiered = {prefix: self._counter_cls(name=name, documentation=doc,
                                                  labelnames=tiered)
                        for prefix, (name, doc) in _TIER_COUNTERS.items()}
        self._levels = {prefix: self._gauge_cls(name=name, documentation=doc,
                                                labelnames=tiered, multiprocess_mode="sum")
                        for prefix, (name, doc) in _TIER_GAUGES.items()}
        self._tenants = self._gauge_cls(name=_TENANT_GAUGE[0], documentation=_TENANT_GAUGE[1],
                                        labelnames=[*tiered, "tenant"], multiprocess_mode="sum")
        self._tenant_levels: dict[tuple[object, ...], float] = {}  # per series, to drop at 0
        self._latency = self._histogram_cls(
            name="vllm:kvplug_load_seconds", labelnames=tiered, buckets=LATENCY_BUCKETS,
            documentation="seconds per request load, by the farthest tier it read from")
        for values in per_engine_labelvalues.values():  # the plain counters show from the start
            for metric in self._plain.values():
                metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if key in self._plain:
                if value > 0:
                    self._plain[key].labels(*values).inc(value)
                continue
            prefix, _, tier = key.partition(".")
            if not tier:
                continue
            if prefix + "." == TENANT_PREFIX:
                name, _, tenant = tier.rpartition(".")
                if value:
                    self._tenant_change((*values, name, tenant), value)
                continue
            if prefix + "." == LATENCY_PREFIX:
                hist = self._latency.labels(*values, tier)
                for sample in value:
                    hist.observe(sample)
            elif (counter := self._tiered.get(prefix + ".")) is not None and value > 0:
                counter.labels(*values, tier).inc(value)
            elif (gauge := self._levels.get(prefix + ".")) is not None and value:
                gauge.labels(*values, tier).inc(value)

    def _tenant_change(self, labels: tuple[object, ...], change: float) -> None:
        """Add ``change`` to one tenant's series; a series back at 0 (the tenant left the tier,
        or fell among the ``other`` tenants) is removed, so departed tenants leave none."""
        level = self._tenant_levels.get(labels, 0.0) + change
        remove = getattr(self._tenants, "remove", None)  # (Ray's gauges have none: kept at 0)
        if level <= 0 and remove is not None:
            self._tenant_levels.pop(labels, None)
            try:
                remove(*labels)
            except KeyError:  # never shown
                pass
            return
        self._tenant_levels[labels] = level
        self._tenants.labels(*labels).inc(change)
