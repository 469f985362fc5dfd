"""Per-tenant quotas on tiers whose store evicts by itself (a real redis-server, a real fsspec
directory): kvplug counts what it stored per tenant and skips a store past its tenant's quota
(``quota_skipped_puts``), so a flooding tenant cannot fill the store; another tenant's stores go
on. Without quotas (the negative control) the flood is stored whole. Mooncake's tier is the same
code (``ValueStoreTier`` and its writer)."""

from __future__ import annotations

import dataclasses

import pytest
from kvplug.policies.tenants import tenant_id
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

from tests.support.redis_server import redis_server  # noqa: F401 - fixture

SALT_A, SALT_B = "salt-of-tenant-a", "salt-of-tenant-b"
A, B = tenant_id(SALT_A), tenant_id(SALT_B)
NB = 16 << 10  # fill_random's chunks
FAST = {"timeout_s": 5, "breaker_backoff_s": 0.2}


def flood(mgr: StorageManager, tenant: str, start: int, n: int) -> list:
    keys = [dataclasses.replace(make_key(start + i), tenant=tenant) for i in range(n)]
    for i, k in enumerate(keys):
        obj = fill_random(mgr, seed=start + i)
        mgr.batched_put([k], [obj])
        obj.ref_down()
        assert mgr.flush(30)
    return keys


def remote_tier(kind: str, where, quotas: dict | None) -> dict:
    if kind == "resp":
        tier = {"backend": "resp", "name": "remote",
                "options": {"url": where.url, "prefix": "q:", **FAST}}
    else:
        tier = {"backend": "fsspec", "name": "remote",
                "options": {"url": f"file://{where}/store", "timeout_s": 5}}
    if quotas:
        tier["quotas"] = quotas
    return tier


@pytest.mark.parametrize("kind", ["resp", "fsspec"])
def test_a_flooding_tenant_is_held_to_its_quota_on_a_self_evicting_store(kind, request,
                                                                          tmp_path):
    held = {}
    for quotas in (None, {"default": "64MiB", "tenants": {SALT_B: 4 * (NB + 4096)}}):
        where = request.getfixturevalue("redis_server") if kind == "resp" \
            else tmp_path / ("q" if quotas else "n")
        if kind == "resp":
            where.client().flushall()
        cfg = {"chunk_size": 16, "tiers": [
            {"backend": "local_cpu", "name": "ram", "options": {"capacity": "4MiB"}},
            remote_tier(kind, where, quotas)]}
        with StorageManager(cfg) as mgr:
            b_keys = flood(mgr, B, 0, 12)
            a_keys = flood(mgr, A, 1000, 3)
            got_b = sum(mgr.holds("remote", b_keys))
            got_a = sum(mgr.holds("remote", a_keys))
            stats = mgr.stats()["remote"]
            held[bool(quotas)] = (got_b, got_a, stats.get("quota_skipped_puts", 0))
    assert held[False] == (12, 3, 0), held  # the negative control: no quota, the flood lands
    got_b, got_a, skipped = held[True]
    assert got_a == 3, "another tenant's stores were skipped"
    assert 1 <= got_b <= 4 and skipped == 12 - got_b, held


def test_deleting_a_value_gives_its_bytes_back_to_the_tenant(redis_server):  # noqa: F811
    cfg = {"chunk_size": 16, "tiers": [
        {"backend": "local_cpu", "name": "ram", "options": {"capacity": "4MiB"}},
        {**remote_tier("resp", redis_server, {"tenants": {SALT_B: 2 * (NB + 4096)}})}]}
    with StorageManager(cfg) as mgr:
        first = flood(mgr, B, 0, 3)
        assert mgr.holds("remote", first) == [True, True, False]
        mgr.evict(keys=first[:2], tiers=["remote"])
        later = flood(mgr, B, 100, 2)
        assert mgr.holds("remote", later) == [True, True], "deleted bytes still counted"
        assert mgr.stats()["remote"]["quota_skipped_puts"] == 1
