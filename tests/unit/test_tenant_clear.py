"""A clear by tenant on real tiers (RAM in front of a posix directory), no engine: the tenant's
entries really go (files on disk counted, another process's included), the others stay, the
result is measured per tier (the tenant's bytes before and after), a tier that cannot list its
entries says it is not available, and a tier that claims a removal it did not do is caught."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from kvplug.hookspecs import hookimpl
from kvplug.management import clear_tenant, pin_keys
from kvplug.policies.tenants import tenant_id
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

from tests.support.tiers_for_tests import DictTier

A, B = tenant_id("salt-of-a"), tenant_id("salt-of-b")


def config(tmp_path, lower: dict | None = None) -> dict:
    return {"chunk_size": 16, "tiers": [
        {"backend": "local_cpu", "name": "ram", "options": {"capacity": "8MiB"}},
        {"backend": "posix", "name": "disk",
         "options": {"path": str(tmp_path / "chunks"), "capacity": "64MiB"}},
        *([lower] if lower else [])]}


def store(mgr: StorageManager, keys: list) -> None:
    for i, k in enumerate(keys):
        obj = fill_random(mgr, seed=i)
        mgr.batched_put([k], [obj])
        obj.ref_down()
    assert mgr.flush(30)


def files_of(tmp_path, tenant: str) -> int:
    return sum(1 for p in (tmp_path / "chunks").rglob("*.safetensors") if f".t{tenant}" in p.name)


def test_a_tenant_clear_removes_that_tenants_entries_only(tmp_path):
    rng = random.Random(5)
    a_keys = [make_key(i, tenant=A) for i in rng.sample(range(1000), 5)]
    b_keys = [make_key(i, tenant=B) for i in rng.sample(range(1000, 2000), 4)]
    lower = {"backend": "tests.support.tiers_for_tests:DictTier", "name": "remote"}
    with StorageManager(config(tmp_path, lower)) as mgr, \
            StorageManager(config(tmp_path)) as other:  # another process sharing the directory
        store(mgr, a_keys[:4] + b_keys)
        store(other, a_keys[4:])
        assert files_of(tmp_path, A) == 5 and files_of(tmp_path, B) == 4
        res = clear_tenant(mgr, A)
        assert res["ram"] == {**res["ram"], "removed": 4, "remaining": 0, "remaining_bytes": 0,
                              "complete": True}
        assert res["disk"] == {**res["disk"], "removed": 5, "remaining": 0, "complete": True}
        assert res["disk"]["removed_bytes"] > 0
        assert files_of(tmp_path, A) == 0, "the disk tier said it removed files still on disk"
        assert files_of(tmp_path, B) == 4
        for tier in ("ram", "disk"):
            assert mgr.holds(tier, a_keys[:4]) == [False] * 4
            assert mgr.holds(tier, b_keys) == [True] * 4
        assert res["remote"]["complete"] is False and "not available" in res["remote"]["error"]
        assert mgr.holds("remote", a_keys[:1]) == [True]  # untouched, as it said


def test_a_pinned_chunk_of_the_tenant_is_left_and_said(tmp_path):
    keys = [make_key(i, tenant=A) for i in range(3)]
    with StorageManager(config(tmp_path)) as mgr:
        store(mgr, keys)
        pin_keys(mgr, keys[:1])
        res = clear_tenant(mgr, A)
        for tier in ("ram", "disk"):
            assert res[tier]["removed"] == 2 and res[tier]["remaining"] == 1
            assert res[tier]["complete"] is False and res[tier]["remaining_bytes"] > 0
            assert "unpin" in res[tier]["note"]


class ClaimingTier(DictTier):
    """A broken tier: lists tenants, claims their entries removed, keeps every one."""

    @hookimpl
    def tenant_usage(self):
        with self.lock:
            return {k.tenant: sum(v[0].numel() for kk, v in self.data.items()
                                  if kk.tenant == k.tenant) for k in self.data}

    @hookimpl
    def evict_tenant(self, tenant):
        return [sum(k.tenant == tenant for k in self.data), 0]


def test_a_tier_that_claims_a_tenant_clear_is_not_believed(tmp_path):
    lower = {"backend": f"{__name__}:ClaimingTier", "name": "liar"}
    with StorageManager(config(tmp_path, lower)) as mgr:
        store(mgr, [make_key(1, tenant=A), make_key(2, tenant=A)])
        res = clear_tenant(mgr, A)["liar"]
        assert res["removed"] == 2  # its word
        assert res["complete"] is False and res["remaining_bytes"] > 0  # what was measured


def test_cache_clear_tenant_on_the_stores_without_an_engine(tmp_path):
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text(json.dumps(config(tmp_path)))
    with StorageManager(config(tmp_path)) as mgr:
        store(mgr, [make_key(1, tenant=A), make_key(2, tenant=A), make_key(3, tenant=B)])
    out = subprocess.run([sys.executable, "-m", "kvplug.cli", "cache", "clear", "--config",
                          str(cfg), "--tenant", "salt-of-a", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["ok"] and body["tiers"]["disk"]["removed"] == 2
    assert files_of(tmp_path, A) == 0 and files_of(tmp_path, B) == 1
    assert "salt-of-a" not in out.stdout + out.stderr
