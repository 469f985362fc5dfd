"""Management calls on real tiers (RAM in front of a posix directory), no engine: what a clear
removed and what it left, measured per tier (kvplug.management), and ``kvplug cache status|clear
--config`` acting on the stores directly (files on disk counted, not the tool's word)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from kvplug.hookspecs import hookimpl
from kvplug.management import clear_keys, clear_tiers, tier_status
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

from tests.support.tiers_for_tests import DictTier


def config(tmp_path) -> dict:
    return {"chunk_size": 16, "tiers": [
        {"backend": "local_cpu", "name": "ram", "options": {"capacity": "8MiB"}},
        {"backend": "posix", "name": "disk",
         "options": {"path": str(tmp_path / "chunks"), "capacity": "64MiB"}}]}


def policy_config(tmp_path) -> dict:
    cfg = config(tmp_path)
    cfg["tiers"][0]["eviction"] = "s3fifo"
    cfg["tiers"][1]["admission"] = {"policy": "tinylfu", "min_count": 3}
    return cfg


def store(mgr: StorageManager, ids: list[int]) -> None:
    for i in ids:
        obj = fill_random(mgr, seed=i)
        mgr.batched_put([make_key(i)], [obj])
        obj.ref_down()
    assert mgr.flush(30)


def files(tmp_path) -> int:
    return sum(1 for p in (tmp_path / "chunks").rglob("*") if p.is_file()
               and not p.name.startswith("."))


def test_clear_keys_reports_what_each_tier_removed_and_what_a_pin_kept(tmp_path):
    ids = random.Random(7).sample(range(1000), 6)
    with StorageManager(config(tmp_path)) as mgr:
        store(mgr, ids)
        keep = make_key(ids[0])
        assert mgr.lookup_prefix([keep], pin=True).num_chunks == 1  # a load in flight: pinned
        res = clear_keys(mgr, [make_key(i) for i in ids[:4]])
        assert res["ram"]["held_before"] == 4 and res["ram"]["removed"] == 3
        assert res["ram"]["remaining"] == 1 and "pinned" in res["ram"]["note"]
        assert res["disk"]["removed"] == 4 and res["disk"]["remaining"] == 0  # pinned in RAM only
        assert res["ram"]["removed_bytes"] > 0 and res["disk"]["removed_bytes"] > 0
        assert mgr.holds("disk", [make_key(i) for i in ids]) == [False] * 4 + [True] * 2
        assert mgr.holds("ram", [make_key(i) for i in ids]) == [True, False, False, False,
                                                                True, True]


def test_clear_tiers_is_complete_only_when_nothing_is_left(tmp_path):
    with StorageManager(config(tmp_path)) as mgr:
        store(mgr, list(range(5)))
        assert files(tmp_path) == 5
        mgr.lookup_prefix([make_key(0)], pin=True)
        res = clear_tiers(mgr)
        assert res["ram"] == {**res["ram"], "entries_before": 5, "removed": 4, "remaining": 1,
                              "complete": False}
        assert res["disk"]["removed"] == 5 and res["disk"]["complete"] is True
        assert files(tmp_path) == 0, "the disk tier said it removed entries still on disk"
        mgr.unpin([make_key(0)], ["ram"])
        assert clear_tiers(mgr, ["ram"])["ram"]["complete"] is True
        status = {t["name"]: t for t in tier_status(mgr)}
        assert status["ram"]["entries"] == 0 and status["disk"]["used_bytes"] == 0
        assert status["disk"]["capacity_bytes"] == 64 << 20
        assert status["ram"]["never_blocks"] and not status["disk"]["never_blocks"]
        # may_block, deprecated, stays the negation for readers of the old answer
        assert not status["ram"]["may_block"] and status["disk"]["may_block"]
        assert status["ram"]["policies"] == {"eviction": {"policy": "lru"},
                                             "admission": {"policy": "always"}}


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "kvplug.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_cache_status_and_clear_on_the_stores_without_an_engine(tmp_path):
    """``kvplug cache status|clear --config``, the config setting policies (status shows them
    by name and settings, in JSON and in the table)."""
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text(json.dumps(policy_config(tmp_path)))  # JSON is YAML
    with StorageManager(config(tmp_path)) as mgr:
        store(mgr, list(range(7)))
    out = cli("cache", "status", "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    tiers = {t["name"]: t for t in json.loads(out.stdout)["tiers"]}
    disk = tiers["disk"]
    assert disk["entries"] == 7 and disk["used_bytes"] > 0
    assert disk["policies"]["admission"] == {"policy": "tinylfu", "min_count": 3}
    assert tiers["ram"]["policies"]["eviction"] == {"policy": "s3fifo"}
    out = cli("cache", "status", "--config", str(cfg), COLUMNS="200")
    assert out.returncode == 0, out.stderr
    assert "tinylfu (min_count=3)" in out.stdout and "s3fifo" in out.stdout
    assert "PolicyConfig" not in out.stdout and "policy=" not in out.stdout
    out = cli("cache", "clear", "--config", str(cfg), "--tier", "disk")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "done" in out.stdout and "disk" in out.stdout
    assert files(tmp_path) == 0
    out = cli("cache", "clear", "--config", str(cfg), "--tier", "nope")
    assert out.returncode == 1 and "unknown tier" in out.stderr
    out = cli("cache", "clear", "--config", str(cfg), "--prompt", "hello")
    assert out.returncode == 1 and "--url" in out.stderr


def test_serve_allows_the_api_plugin_and_keeps_every_other_plugin():
    from importlib.metadata import entry_points

    from kvplug.cli.serve import ALLOWLISTED_GROUPS, plugins_env

    installed = {ep.name for g in ALLOWLISTED_GROUPS for ep in entry_points(group=g)}
    unset = plugins_env(None).split(",")
    assert set(unset) == installed | {"kvplug_api"} and "kvplug_connector" in unset
    assert plugins_env("a, b") == "a,b,kvplug_api"
    assert plugins_env("kvplug_api,x") == "kvplug_api,x"


def test_management_key_replaces_vllms_key_and_fails_closed():
    """With ``management_key_env`` only that key opens /kvplug/v1 (vLLM's --api-key, which
    every client holds, is refused); unset, the server does not start; no state: 503."""
    import pytest

    pytest.importorskip("vllm")
    from argparse import Namespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from kvplug.connector.api import api_keys, router
    from kvplug.connector.protocol.config import load_connector_config

    cfg = load_connector_config({"management_key_env": "OPS_KEY"})
    app = FastAPI()
    app.include_router(router)
    client = TestClient(app)
    assert client.get("/kvplug/v1/status").status_code == 503  # no state yet: closed
    app.state.kvplug_api_keys = api_keys(Namespace(api_key=["client-key"]), cfg,
                                         environ={"OPS_KEY": "ops-key"})
    for key, status in (("client-key", 401), (None, 401), ("ops-key", 503)):  # 503: no engine
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert client.get("/kvplug/v1/status", headers=headers).status_code == status, key
    with pytest.raises(RuntimeError, match=r"\$OPS_KEY"):
        api_keys(Namespace(api_key=None), cfg, environ={})
    assert api_keys(Namespace(api_key=None), load_connector_config({}), environ={}) == []


def test_an_open_management_api_is_warned_about_once_naming_the_fix(caplog):
    """Neither ``--api-key`` (``VLLM_API_KEY``) nor ``management_key_env``: the API plugin's keys
    are none (clear, pin and status answer anyone), and it says so once, naming the fix; with
    either key set it says nothing."""
    import logging
    from argparse import Namespace

    import pytest

    pytest.importorskip("vllm")
    from kvplug.connector import api
    from kvplug.connector.protocol.config import load_connector_config

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "management API" in r.getMessage()]

    cfg = load_connector_config({})
    api._open_warning.reset()  # (once per process: another test may have warned)
    caplog.set_level(logging.WARNING, logger="kvplug")
    assert api.api_keys(Namespace(api_key=None), cfg, environ={}) == []
    assert api.api_keys(Namespace(api_key=None), cfg, environ={}) == []
    assert len(warnings()) == 1, warnings()
    assert "open" in warnings()[0] and "management_key_env" in warnings()[0]
    assert "--api-key" in warnings()[0]
    caplog.clear()
    api._open_warning.reset()
    assert api.api_keys(Namespace(api_key=["k1"]), cfg, environ={})
    assert api.api_keys(Namespace(api_key=None), cfg, environ={"VLLM_API_KEY": "k2"})
    assert api.api_keys(Namespace(api_key=None), load_connector_config(
        {"management_key_env": "KV_M"}), environ={"KV_M": "k3"})
    assert warnings() == []


def test_a_clear_is_announced_as_removals_per_tier(tmp_path):
    """KV events follow a management clear: the workers' TierWatch sees its evicts and reports
    every cleared chunk leaving every tier (BlockRemoved for routers)."""
    import time

    import pytest

    pytest.importorskip("vllm")
    from kvplug.connector.worker.tier_watch import TierWatch

    with StorageManager(config(tmp_path)) as mgr:
        watch = TierWatch(mgr, interval_s=3600)  # rounds driven here
        try:
            ids = random.Random(3).sample(range(1000), 4)
            store(mgr, ids)
            got: list = []
            deadline = time.monotonic() + 60  # a hang guard only

            def drain(want: int) -> None:
                while len(got) < want and time.monotonic() < deadline:
                    watch.check()
                    if (news := watch.take()) is not None:
                        got.extend(news.get_all_events())
                    time.sleep(0.05)

            drain(8)
            assert sorted((e.stored, e.tier) for e in got) == \
                [(True, "disk")] * 4 + [(True, "ram")] * 4
            got.clear()
            clear_keys(mgr, [make_key(i) for i in ids[:2]], ["disk"])
            clear_tiers(mgr, ["ram"])
            drain(6)
            removed = {(e.tier, e.chunk_hash) for e in got if not e.stored}
            assert removed == {("disk", make_key(i).chunk_hash) for i in ids[:2]} | \
                {("ram", make_key(i).chunk_hash) for i in ids}
            assert not [e for e in got if e.stored]
        finally:
            watch.close()


class ClaimingTier(DictTier):
    """A tier whose evict says it freed bytes and keeps everything (the negative control)."""

    @hookimpl
    def evict(self, keys, nbytes):
        with self.lock:
            return sum(self.data[k][0].numel() for k in (keys or self.data) if k in self.data)


def test_a_tier_that_claims_a_removal_is_not_believed():
    """Results come from what the tier holds after, never from what its evict returned."""
    with StorageManager({"chunk_size": 16, "tiers": [
            {"backend": f"{__name__}:ClaimingTier", "name": "liar"}]}) as mgr:
        store(mgr, [1, 2, 3])
        keys = [make_key(i) for i in (1, 2, 3)]
        res = clear_keys(mgr, keys)["liar"]
        assert res["removed_bytes"] > 0 and res["removed"] == 0 and res["remaining"] == 3
        res = clear_tiers(mgr)["liar"]
        assert res["removed"] == 0 and res["remaining"] == 3 and res["complete"] is False


class UnreachableTier(DictTier):
    """A store whose circuit breaker opens (``trip``): as the value tiers do, it then answers "not
    held" for what it cannot reach and sends no delete."""

    tripped = False

    @hookimpl
    def contains(self, keys):
        if UnreachableTier.tripped:
            return [False] * len(keys)
        return DictTier.contains(self, keys)

    @hookimpl
    def evict(self, keys, nbytes):
        return 0 if UnreachableTier.tripped else DictTier.evict(self, keys, nbytes)

    @hookimpl
    def stats(self):
        return {**DictTier.stats(self), "breaker_open": float(UnreachableTier.tripped)}


def test_a_clear_of_an_unreachable_store_is_never_complete():
    """Found by the simulation's I8 (seed 70001378: a value store in an outage): its lookups
    answer "not held", so a clear measured by them reported chunks removed that were never
    deleted. Control: the same tier reachable is cleared, complete."""
    cfg = {"chunk_size": 16, "tiers": [{"backend": f"{__name__}:UnreachableTier",
                                        "name": "remote", "options": {}}]}
    for tripped in (True, False):
        UnreachableTier.tripped = False
        with StorageManager(cfg) as mgr:
            store(mgr, [1, 2, 3])
            UnreachableTier.tripped = tripped
            try:
                keyed = clear_keys(mgr, [make_key(1)])["remote"]
                whole = clear_tiers(mgr)["remote"]
            finally:
                UnreachableTier.tripped = False
            held = mgr.holds("remote", [make_key(i) for i in (1, 2, 3)])
        if tripped:
            assert held == [True] * 3  # nothing was deleted
            for res in (keyed, whole):
                assert res["complete"] is False and "unreachable" in res["error"], res
        else:
            assert held == [False] * 3
            assert keyed.get("complete", keyed["remaining"] == 0) and whole["complete"] is True


def test_status_reports_configured_policies_by_name_and_settings(tmp_path):
    """Policies set in the config are reported as plain data (name and options), so the
    workers' msgpack answer and ``--json`` can carry them; unset ones name the default."""
    with StorageManager(policy_config(tmp_path)) as mgr:
        status = {t["name"]: t for t in tier_status(mgr)}
        assert status["ram"]["policies"] == {"eviction": {"policy": "s3fifo"},
                                             "admission": {"policy": "always"}}
        assert status["disk"]["policies"] == {"eviction": {"policy": "lru"},
                                              "admission": {"policy": "tinylfu", "min_count": 3}}
        assert json.loads(json.dumps(tier_status(mgr))) == tier_status(mgr)
    with StorageManager(config(tmp_path)) as mgr:  # no policy set: the defaults by name
        assert {t["name"]: t["policies"] for t in tier_status(mgr)}["ram"] == {
            "eviction": {"policy": "lru"}, "admission": {"policy": "always"}}


def test_management_service_answers_an_unencodable_answer_with_an_error_at_once():
    """An answer msgpack cannot encode (a config object, as status once returned) is an error
    reply to the caller, never a dropped message it waits its whole timeout for; the service
    answers the next call as usual."""
    import tempfile
    from pathlib import Path

    import pytest

    pytest.importorskip("vllm")
    from kvplug.config import PolicyConfig
    from kvplug.connector.protocol.manage import (
        ManageClient,
        ManageLookup,
        ManageService,
        ManageStatus,
    )

    def handle(msg):
        if isinstance(msg, ManageStatus):
            return {"tiers": [{"policies": {"eviction": PolicyConfig(policy="s3fifo")}}]}
        return {"tiers": {"ram": {"held": 7, "served": 7}}}

    with tempfile.TemporaryDirectory(prefix="kvm-", dir="/tmp") as d:
        path = Path(d) / "manage.sock"
        service = ManageService(path, handle)
        try:
            client = ManageClient([path], timeout_s=10)  # a dropped answer: "no answer"
            (reply,) = client.ask(ManageStatus())
            assert not reply.ok and "could not be encoded" in reply.error, reply
            assert "PolicyConfig" in reply.error and "no answer" not in reply.error
            (again,) = client.ask(ManageLookup([b"x" * 32]))
            assert again.ok and again.body == {"tiers": {"ram": {"held": 7, "served": 7}}}
        finally:
            service.close()
