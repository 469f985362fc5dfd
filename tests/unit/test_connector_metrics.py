"""kvplug's stats -> Prometheus path without an engine: tier counters sampled as growth, samples
concatenated across workers, the metrics vLLM's front end would expose, and the hit-source split."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvplug.connector.prom import KVPlugPromMetrics, hit_sources  # noqa: E402
from kvplug.connector.stats import KVPlugStats, StatsRecorder  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402


def test_tier_counters_are_reported_as_growth_once():
    rec = StatsRecorder()
    rec.sample_tiers({"ram": {"bytes_written": 100, "evictions": 2, "faults": 0}})
    rec.sample_tiers({"ram": {"bytes_written": 300, "evictions": 2, "faults": 0},
                      "disk": {"dropped_puts": 1, "skipped_puts": 2, "corrupt": 1}})
    got = rec.take().data
    assert got["tier_stored_bytes.ram"] == 300 and got["tier_evictions.ram"] == 2
    assert got["tier_dropped_stores.disk"] == 3 and got["tier_corrupt.disk"] == 1
    assert "tier_faults.ram" not in got
    rec.sample_tiers({"ram": {"bytes_written": 300, "evictions": 2}})
    assert rec.take() is None  # nothing grew since


def test_latency_samples_concatenate_across_workers():
    a, b = KVPlugStats(), KVPlugStats()
    a.observe("load_latency.ram", 0.01)
    b.observe("load_latency.ram", 0.02)
    b.add("load_bytes", 5)
    assert a.aggregate(b).data["load_latency.ram"] == [0.01, 0.02]
    assert a.data["load_bytes"] == 5


def test_prom_metrics_from_a_stats_dict():
    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVPlugPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["model_name", "engine"], {0: ["m", "0"]})
    stats = KVPlugStats()
    stats.add("lookups", 2)
    stats.add("tier_hit_tokens.ram", 512)
    stats.add("tier_stored_bytes.disk", 4096)
    stats.add("tier_evictions.ram", 3)
    stats.observe("load_latency.ram", 0.003)
    prom.observe(stats.to_dict(), 0)
    prom.observe(stats.to_dict(), 0)
    v = partial(reg.get_sample_value, labels={"model_name": "m", "engine": "0"})
    t = partial(reg.get_sample_value, labels={"model_name": "m", "engine": "0", "tier": "ram"})
    assert v("vllm:kvplug_lookups_total") == 4
    assert v("vllm:kvplug_load_errors_total") == 0  # shown from the start
    assert t("vllm:kvplug_hit_tokens_total") == 1024
    assert t("vllm:kvplug_evictions_total") == 6
    assert t("vllm:kvplug_load_seconds_count") == 2
    assert reg.get_sample_value("vllm:kvplug_stored_bytes_total",
                                {"model_name": "m", "engine": "0", "tier": "disk"}) == 8192


def test_hit_sources_by_tier_kind():
    assert hit_sources(256, 0, ["local_cpu", "posix"]) == {CacheHitSource.HOST: 256}
    assert hit_sources(256, 512, ["local_cpu", "posix"]) == {CacheHitSource.HOST: 256,
                                                              CacheHitSource.DISK: 512}
    assert hit_sources(0, 512, ["local_cpu", "fsspec"]) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 512}


def test_hit_split_counts_the_external_tokens_of_slow_chunks():
    from kvplug.connector.config import load_connector_config
    from kvplug.connector.scheduler import SchedulerSide
    from kvplug.connector.tracker import RequestTracker

    sched = SchedulerSide(load_connector_config({"chunk_size": 256}), 128, "kv_both",
                          lookup=SimpleNamespace())
    # hit of 896 tokens: chunks 0, 1, 2 and a 128-token tail (chunk 3); chunks 1 and 3 are slow
    sched.trackers["r"] = RequestTracker(request=None, prompt_len=1000, can_load=True,
                                         can_save=True, lookup_tokens=896, usable_tokens=896,
                                         slow_chunks=frozenset({1, 3}))
    assert sched.hit_split("r", 896) == (512, 384)
    assert sched.hit_split("r", 384) == (256, 128)  # vLLM held the first 512 tokens itself
    assert sched.hit_split("gone", 64) == (64, 0)
