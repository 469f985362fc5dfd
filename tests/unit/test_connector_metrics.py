"""kvplug's stats -> Prometheus path without an engine: tier counters sampled as growth, samples
concatenated across workers, the metrics vLLM's front end would expose, and the hit-source split."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvplug.connector.prom import KVPlugPromMetrics, hit_sources  # noqa: E402
from kvplug.connector.protocol.stats import KVPlugStats, StatsRecorder  # noqa: E402
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
    from kvplug.connector.protocol.config import load_connector_config
    from kvplug.connector.scheduler.side import RequestTracker, SchedulerSide

    sched = SchedulerSide(load_connector_config({"chunk_size": 256}), 128, "kv_both",
                          lookup=SimpleNamespace())
    # hit of 896 tokens: chunks 0, 1, 2 and a 128-token tail (chunk 3); chunks 1 and 3 are slow
    sched.trackers["r"] = RequestTracker(request=None, prompt_len=1000, can_load=True,
                                         can_save=True, lookup_tokens=896, usable_tokens=896,
                                         slow_chunks=frozenset({1, 3}))
    assert sched.hit_split("r", 896) == (512, 384)
    assert sched.hit_split("r", 384) == (256, 128)  # vLLM held the first 512 tokens itself
    assert sched.hit_split("gone", 64) == (64, 0)


def test_bytes_per_tenant_reach_a_gauge_labelled_by_the_tenant_id_only(tmp_path):
    """Real tiers (RAM, posix) hold two tenants' chunks: the per-tenant gauge says each tier's
    bytes per tenant id, drops the series of a tenant cleared away (a departed tenant leaves no
    series behind), and never shows a salt."""
    import dataclasses

    from kvplug.management import clear_tenant
    from kvplug.policies.tenants import tenant_id
    from kvplug.storage_manager import StorageManager
    from kvplug.testing import fill_random, make_key

    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVPlugPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["model_name", "engine"], {0: ["m", "0"]})
    a, b = tenant_id("salt-a-secret"), tenant_id("salt-b-secret")
    cfg = {"chunk_size": 16, "tiers": [
        {"backend": "local_cpu", "name": "ram", "options": {"capacity": "4MiB"}},
        {"backend": "posix", "name": "disk", "options": {"path": str(tmp_path), "capacity": "64MiB"}}]}
    rec = StatsRecorder()
    with StorageManager(cfg) as mgr:
        for i, tenant in enumerate([a, a, a, b, ""]):
            obj = fill_random(mgr, seed=i)
            mgr.batched_put([dataclasses.replace(make_key(i), tenant=tenant)], [obj])
            obj.ref_down()
        assert mgr.flush(30)
        rec.sample_tenants(mgr, now=100.0)
        prom.observe(rec.take().data, 0)

        def level(tier: str, tenant: str) -> float | None:
            return reg.get_sample_value("vllm:kvplug_tier_tenant_bytes", {
                "model_name": "m", "engine": "0", "tier": tier, "tenant": tenant})

        assert level("ram", a) == 3 * (16 << 10) and level("ram", b) == 16 << 10
        assert level("ram", "-") == 16 << 10 and level("disk", a) > 3 * (16 << 10)
        clear_tenant(mgr, a)
        rec.sample_tenants(mgr, now=105.0)  # within the sampling interval: not asked again
        assert rec.take() is None
        rec.sample_tenants(mgr, now=111.0)
        prom.observe(rec.take().data, 0)
        assert level("ram", a) is None and level("disk", a) is None, "a departed tenant's series"
        assert level("ram", b) == 16 << 10
    text = __import__("prometheus_client").generate_latest(reg).decode()
    assert "salt-a-secret" not in text and a not in text and b in text


def test_tenant_series_are_capped_per_tier_and_go_with_their_tenants():
    """200 tenants hold a chunk each in RAM: at most ``TENANT_SERIES`` of them are series of
    their own (the largest), the rest are summed under ``other``, the bytes add up; once every
    tenant has left, no series is left (not one per departed tenant)."""
    import dataclasses

    from kvplug.connector.protocol.stats import TENANT_SERIES
    from kvplug.management import clear_tenant
    from kvplug.policies.tenants import tenant_id
    from kvplug.storage_manager import StorageManager
    from kvplug.testing import fill_random, make_key

    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVPlugPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["model_name", "engine"], {0: ["m", "0"]})
    tenants = [tenant_id(f"salt-{i}") for i in range(200)]
    cfg = {"chunk_size": 16, "tiers": [
        {"backend": "local_cpu", "name": "ram", "options": {"capacity": "8MiB"}}]}
    rec = StatsRecorder()

    def series() -> dict[str, float]:
        return {s.labels["tenant"]: s.value for m in reg.collect()
                if m.name == "vllm:kvplug_tier_tenant_bytes" for s in m.samples}

    with StorageManager(cfg) as mgr:
        for i, tenant in enumerate(tenants):
            obj = fill_random(mgr, (2, 2, 1024) if i % 2 else (2, 2, 2048), seed=i)
            mgr.batched_put([dataclasses.replace(make_key(i), tenant=tenant)], [obj])
            obj.ref_down()
        rec.sample_tenants(mgr, now=100.0)
        prom.observe(rec.take().data, 0)
        shown = series()
        assert len(shown) == TENANT_SERIES + 1 < len(tenants), len(shown)
        assert sum(shown.values()) == 100 * 8192 + 100 * 4096
        big = {t for i, t in enumerate(tenants) if not i % 2}
        assert set(shown) - {"other"} <= big and shown["other"] > 0
        for tenant in tenants:
            clear_tenant(mgr, tenant)
        rec.sample_tenants(mgr, now=111.0)
        prom.observe(rec.take().data, 0)
        assert series() == {}, "departed tenants left series behind"
