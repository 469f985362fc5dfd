"""Tenants and per-tier byte quotas: tenant ids (never the salt), ids in object names, and a
tenant over its quota evicting its own entries first on L1 and posix."""

from __future__ import annotations

import os

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.chunkfile.auth import Keyring
from kvplug.config import load_config
from kvplug.errors import ConfigError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat
from kvplug.policies.tenants import TenantQuotas, tenant_id, tenant_of_name
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

CHUNK = (2, 2, 4096)  # 16 KiB
NB = 2 * 2 * 4096
SALT_A, SALT_B = "salt-of-team-a-5f3c", "salt-of-team-b-91d2"


def put(mgr: StorageManager, k: CacheKey) -> None:
    obj = mgr.allocate(CHUNK, torch.uint8, MemoryFormat.KV_PAGES, 16)
    obj.byte_view.fill_(7)
    mgr.batched_put([k], [obj])
    obj.ref_down()


def test_tenant_ids_hide_the_salt_and_are_stable():
    a = tenant_id(SALT_A)
    assert len(a) == 16 and int(a, 16) >= 0 and a == tenant_id(SALT_A) != tenant_id(SALT_B)
    assert tenant_id(None) == tenant_id("") == ""
    ring = Keyring(b"k" * 32)
    keyed = tenant_id(SALT_A, ring)
    assert keyed != a and keyed == tenant_id(SALT_A, Keyring(b"k" * 32))
    assert keyed != tenant_id(SALT_A, Keyring(b"j" * 32))
    assert "team" not in repr(TenantQuotas.from_config(
        load_config({"tiers": [{"backend": "local_cpu", "quotas": {"tenants": {SALT_A: "1MiB"}}}]}
                    ).tiers[0].quotas))


@pytest.mark.parametrize("auth", [None, Keyring(b"k" * 32)])
def test_the_tenant_is_in_every_object_name(auth):
    t = tenant_id(SALT_A)
    rel = cf.relative_chunk_path(make_key(1, tenant=t), auth)
    assert tenant_of_name(rel) == t and SALT_A not in rel
    assert tenant_of_name(cf.relative_chunk_path(make_key(1), auth)) == ""
    # a key without a tenant is named exactly as before tenants existed
    assert cf.chunk_name(make_key(1)) == f"{make_key(1).namespace}.{make_key(1).hex}{cf.FILE_SUFFIX}"
    assert make_key(1).namespace.endswith(".tp1-0")
    assert make_key(1, tenant=t).namespace.endswith(f".t{t}")
    assert CacheKey.from_fields(make_key(1, tenant=t).fields()) == make_key(1, tenant=t)
    assert "tenant" not in make_key(1).fields()
    with pytest.raises(ConfigError, match="tenant"):
        make_key(1, tenant="not-hex")


def test_quota_config_errors_never_echo_a_tenant():
    with pytest.raises(ConfigError) as err:
        load_config({"tiers": [{"backend": "local_cpu",
                                "quotas": {"tenants": {SALT_A: "lots"}}}]})
    assert SALT_A not in str(err.value) and "<a tenant>" in str(err.value)
    with pytest.raises(ConfigError) as err:  # (policy names are checked where tiers are built)
        StorageManager({"tiers": [{"backend": "local_cpu", "eviction": "nope",
                                   "quotas": {"tenants": {SALT_A: "1MiB"}}}]})
    assert SALT_A not in str(err.value) and "'nope'" in str(err.value)
    with pytest.raises(ConfigError, match="per-tenant quotas"):  # neither evicts nor counts
        StorageManager({"tiers": [{"backend": "tests.support.tiers_for_tests:DictTier",
                                   "quotas": {"default": "1MiB"}}]})


def _tiers(kind: str, tmp_path, quotas: dict | None, eviction: str = "lru") -> list[dict]:
    opts = {"capacity": 16 * NB if kind == "local_cpu" else 16 * (NB + 4096)}
    if kind == "posix":
        opts["path"] = str(tmp_path / "c")
    tier = {"backend": kind, "options": opts, "eviction": eviction}
    if quotas:
        tier["quotas"] = quotas
    return [tier]


def _held(mgr: StorageManager, tier: str, keys: list[CacheKey]) -> int:
    return sum(mgr.holds(tier, keys))


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
@pytest.mark.parametrize("kind", ["local_cpu", "posix"])
def test_a_flooding_tenant_evicts_its_own_entries_not_anothers(tmp_path, kind, eviction):
    """A holds 4 chunks; B floods 60 through a 16-chunk tier. With B's quota (the default, 8
    chunks) B evicts its own entries and A's hold; without quotas (the negative control) B's
    flood pushes A's out."""
    a, b = tenant_id(SALT_A), tenant_id(SALT_B)
    per = NB if kind == "local_cpu" else NB + 4096
    results = {}
    for quotas in (None, {"default": 8 * per, "tenants": {SALT_A: 6 * per}}):
        root = tmp_path / ("q" if quotas else "n")
        with StorageManager({"tiers": _tiers(kind, root, quotas, eviction), "chunk_size": 16}) as mgr:
            if kind == "posix":
                assert mgr.backend(0).wait_indexed(30)
            mine = [make_key(i, tenant=a) for i in range(4)]
            for k in mine:
                put(mgr, k)
            mgr.flush(30)
            for i in range(100, 160):
                put(mgr, make_key(i, tenant=b))
                if kind == "posix":
                    mgr.flush(30)
            mgr.flush(30)
            results[bool(quotas)] = _held(mgr, kind, mine)
            usage = mgr.backend(0).tenant_usage()
            st = mgr.stats()[kind]
            assert st["bytes"] <= 16 * per
            if quotas:
                assert usage[b] <= 8 * per and usage[a] == 4 * per, usage
                assert st["quota_evictions" if kind == "local_cpu" else "evictions"] >= 50
    assert results == {False: 0, True: 4}, results


def test_a_tenant_whose_quota_is_full_of_pinned_entries_is_skipped():
    a = tenant_id(SALT_A)
    with StorageManager({"tiers": [{"backend": "local_cpu", "options": {"capacity": 16 * NB},
                                    "quotas": {"tenants": {SALT_A: 2 * NB}}}],
                         "chunk_size": 16}) as mgr:
        put(mgr, make_key(1, tenant=a))
        put(mgr, make_key(2, tenant=a))
        assert mgr.lookup_prefix([make_key(1, tenant=a), make_key(2, tenant=a)], pin=True).num_chunks == 2
        put(mgr, make_key(3, tenant=a))
        assert mgr.holds("local_cpu", [make_key(i, tenant=a) for i in (1, 2, 3)]) == [
            True, True, False]
        assert mgr.stats()["local_cpu"]["quota_skipped_puts"] == 1
        put(mgr, make_key(4))  # another tenant (none) is not bound by A's quota
        assert mgr.holds("local_cpu", [make_key(4)]) == [True]
        mgr.unpin([make_key(1, tenant=a), make_key(2, tenant=a)], ["local_cpu", "local_cpu"])
        put(mgr, make_key(3, tenant=a))
        assert mgr.holds("local_cpu", [make_key(1, tenant=a), make_key(3, tenant=a)]) == [False, True]


def test_processes_sharing_a_directory_count_each_tenant_the_same(tmp_path):
    """Another process (here a second StorageManager on the directory) counts every tenant's
    bytes from the file names alone, and enforces the quotas over files it did not write."""
    a, b = tenant_id(SALT_A), tenant_id(SALT_B)
    tiers = [{"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": "64MiB"},
              "quotas": {"default": "64MiB", "tenants": {SALT_A: 5 * (NB + 4096)}}}]
    with StorageManager({"tiers": tiers, "chunk_size": 16}) as one:
        for i in range(3):
            put(one, make_key(i, tenant=a))
        for i in range(5):
            put(one, make_key(10 + i, tenant=b))
        assert one.flush(30)
        usage = one.backend(0).tenant_usage()
        with StorageManager({"tiers": tiers, "chunk_size": 16}) as two:
            assert two.backend(0).wait_indexed(30)
            assert two.backend(0).tenant_usage() == usage
            assert usage[a] == 3 * (NB + 4096) and usage[b] == 5 * (NB + 4096)
            for i in range(20, 24):  # A's quota is 5 files: two's stores evict one's files
                put(two, make_key(i, tenant=a))
            assert two.flush(30)
            assert two.backend(0).tenant_usage()[a] <= 5 * (NB + 4096)
            names = sorted(p.name for p in (tmp_path / "c").rglob("*.safetensors"))
            assert sum(tenant_of_name(n) == a for n in names) <= 5
            assert sum(tenant_of_name(n) == b for n in names) == 5
            assert not any(SALT_A in n or SALT_B in n for n in names)
    assert not any(SALT_A in p for p in os.listdir(tmp_path / "c"))


# -- the connector: a request's tenant reaches its keys ------------------------------------------------
def test_the_scheduler_sends_the_tenant_of_the_salt_only(tmp_path):
    """vLLM's own Scheduler (no engine): a salted request's lookup and its save carry the id of
    its salt; one naming a tenant in ``kv_transfer_params["tenant"]`` (without its salt: it
    would be charged to and evict that tenant's entries) and one with neither carry none; the
    worker's keys carry it, so the salt never travels."""
    pytest.importorskip("vllm")
    from kvplug.connector.demo.model import make_model
    from kvplug.connector.protocol.lookup import Lookup

    from tests.support.vllm_helpers import FakeLookup, make_request, make_scheduler, model_runner_output, prompt

    class Recording(FakeLookup):
        def lookup(self, req_id, hashes, tails, tenant=""):
            self.tenants = {**getattr(self, "tenants", {}), req_id: tenant}
            return super().lookup(req_id, hashes, tails)

    s = make_scheduler(make_model("tiny", weights=False, root=tmp_path / "m"))
    side = s.connector.scheduler_side
    side.lookup = Recording()
    reqs = [make_request("salted", prompt(600, 1), cache_salt=SALT_A),
            make_request("named", prompt(600, 2)), make_request("plain", prompt(600, 3))]
    reqs[1].kv_transfer_params = {"tenant": "team-b"}
    for r in reqs:
        s.add_request(r)
    scheduler_output = s.schedule()
    metadata = scheduler_output.kv_connector_metadata
    s.update_from_output(scheduler_output, model_runner_output(scheduler_output))
    want = {"salted": tenant_id(SALT_A), "named": "", "plain": ""}
    assert side.lookup.tenants == want
    assert {r.req_id: r.tenant for r in metadata.requests} == want
    msg = Lookup(1, "salted", [b"h" * 32], [], tenant=want["salted"])
    assert SALT_A.encode() not in __import__("msgspec").msgpack.encode(msg)


def test_kvplug_inspect_counts_each_tenant(tmp_path):
    """``kvplug inspect`` counts bytes per tenant from the object names, and shows ids only."""
    from click.testing import CliRunner
    from kvplug.cli import main as cli

    a, b = tenant_id(SALT_A), tenant_id(SALT_B)
    tiers = [{"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": "64MiB"}}]
    with StorageManager({"tiers": tiers, "chunk_size": 16}) as mgr:
        for i in range(3):
            put(mgr, make_key(i, tenant=a))
        for i in range(2):
            put(mgr, make_key(10 + i, tenant=b))
        put(mgr, make_key(20))
        assert mgr.flush(30)
    out = CliRunner().invoke(cli, ["inspect", str(tmp_path / "c"), "--json"])
    assert out.exit_code == 0, out.output
    import json

    report = json.loads(out.output)
    per = {t: u["chunks"] for t, u in report["tenants"].items()}
    assert per == {a: 3, b: 2, "-": 1}
    assert sorted(g["tenant"] for g in report["groups"]) == sorted([a, b, "-"])
    text = CliRunner().invoke(cli, ["inspect", str(tmp_path / "c")]).output
    assert a in text and SALT_A not in text and SALT_B not in text


def test_without_auth_names_carry_no_unkeyed_hash_of_a_salt(tmp_path):
    """Without ``auth_key_env`` the id in object names is keyed too (the deployment's tenant key:
    drawn once, kept private): the unkeyed 64-bit hash of a salt, which anyone computes from a
    guessed salt, is in no name. Another process agrees on the ids (the key is shared)."""
    import hashlib
    import stat

    from tests.support.engine_processes import run_python

    unkeyed = hashlib.blake2b(SALT_A.encode(), digest_size=8, person=b"kvplug-tenant").hexdigest()
    a = tenant_id(SALT_A)
    tiers = [{"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": "64MiB"}}]
    with StorageManager({"tiers": tiers, "chunk_size": 16}) as mgr:
        for i in range(3):
            put(mgr, make_key(i, tenant=a))
        assert mgr.flush(30)
    names = [p.name for p in (tmp_path / "c").rglob("*.safetensors")]
    assert len(names) == 3 and all(tenant_of_name(n) == a for n in names)  # still countable
    assert not any(unkeyed in n for n in names), "an unkeyed hash of the salt is in a name"
    from kvplug.policies.tenants import tenant_key_path

    assert stat.S_IMODE(os.stat(tenant_key_path()).st_mode) == 0o600
    code = ("from kvplug.policies.tenants import tenant_id; "
            f"print('ID', tenant_id({SALT_A!r}))")
    other = run_python(code, dict(os.environ), str(tmp_path), 120)
    assert other.returncode == 0, other.stderr
    assert f"ID {a}" in other.stdout
