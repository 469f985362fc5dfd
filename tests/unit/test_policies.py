"""Eviction and admission policies: discovery, config, the reference policies, and real tiers
(L1 and posix) evicting and admitting by them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from kvplug.config import load_config
from kvplug.errors import BackendValidationError, ConfigError
from kvplug.memory import MemoryFormat
from kvplug.policies import LRUEviction, S3FIFOEviction, TinyLFUAdmission
from kvplug.policies.registry import validate_policy_class
from kvplug.policyspecs import PolicyContext, policyimpl
from kvplug.storage_manager import StorageManager
from kvplug.testing import BackendConformance, PolicyConformance, make_key

from tests.backends.test_posix_conformance import _flip_layer_byte

CHUNK = (2, 2, 4096)  # 16 KiB
NB = 2 * 2 * 4096


# -- the kit against the reference policies ---------------------------------------------------------
class TestLRUConformance(PolicyConformance):
    policy = "lru"


class TestS3FIFOConformance(PolicyConformance):
    policy = "s3fifo"


class TestS3FIFOSmallQueueConformance(PolicyConformance):
    policy = "s3fifo"
    options = {"small_fraction": 0.5, "max_freq": 1, "ghost_entries": 3}


class TestAlwaysConformance(PolicyConformance):
    policy = "always"


class TestTinyLFUConformance(PolicyConformance):
    policy = "tinylfu"
    options = {"min_count": 3, "sample_size": 64}


# -- the backend kit with the scan-resistant policy on the tiers that take one -------------------------
class TestL1OverPosixS3FIFOConformance(BackendConformance):
    persistent = True

    @pytest.fixture
    def make_tiers(self, tmp_path):
        return lambda capacity: [
            {"backend": "local_cpu", "options": {"capacity": capacity}, "eviction": "s3fifo"},
            {"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": capacity},
             "eviction": "s3fifo", "admission": {"policy": "tinylfu", "min_count": 1}},
        ]

    @pytest.fixture
    def corrupt_entry(self, tmp_path):
        return _flip_layer_byte(tmp_path / "c")


# -- discovery and config ------------------------------------------------------------------------------
def test_reference_policies_are_declared_as_entry_points():
    """kvplug's own policies come through the same entry-point group a third party uses."""
    declared = {ep.name: ep.value for ep in entry_points(group="kvplug.policies")}
    assert declared == {
        "lru": "kvplug.policies.eviction:LRUEviction",
        "s3fifo": "kvplug.policies.eviction:S3FIFOEviction",
        "always": "kvplug.policies.admission:AlwaysAdmit",
        "tinylfu": "kvplug.policies.admission:TinyLFUAdmission",
    }


@pytest.mark.parametrize("tier, needle", [
    ({"backend": "local_cpu", "eviction": "clock"},
     ["'clock'", "choices: lru, s3fifo"]),
    ({"backend": "local_cpu", "admission": {"policy": "bloom"}},
     ["'bloom'", "choices: always, tinylfu"]),
    ({"backend": "local_cpu", "eviction": {"policy": "tinylfu"}},
     ["'tinylfu' is an admission policy", "eviction policies: lru, s3fifo"]),
    ({"backend": "local_cpu", "admission": "s3fifo"},
     ["'s3fifo' is an eviction policy", "admission policies: always, tinylfu"]),
])
def test_a_bad_policy_name_names_the_value_and_the_choices(tier, needle, tmp_path):
    """Where tiers are built (the config's schema loads no entry points), and by ``kvplug config
    check`` before anything starts."""
    from kvplug.cli.config import check_config

    assert load_config({"tiers": [tier]}).tiers[0].backend == "local_cpu"
    with pytest.raises(ConfigError) as err:
        StorageManager({"tiers": [tier]})
    for part in needle:
        assert part in str(err.value), str(err.value)
    path = tmp_path / "k.yaml"
    path.write_text(json.dumps({"tiers": [tier]}))
    _, _, problems = check_config(path)
    assert len(problems) == 1 and all(part in problems[0] for part in needle), problems


def test_bad_policy_options_name_the_option_and_the_allowed_ones(tmp_path):
    cfg = {"tiers": [{"backend": "local_cpu", "options": {"capacity": "1MiB"},
                      "admission": {"policy": "tinylfu", "min_cout": 2}}]}
    with pytest.raises(ConfigError) as err:
        StorageManager(cfg)
    msg = str(err.value)
    assert "min_cout" in msg and "min_count" in msg and "'local_cpu'" in msg, msg
    cfg["tiers"][0]["admission"] = {"policy": "tinylfu", "min_count": 0}
    with pytest.raises(ConfigError, match="min_count"):
        StorageManager(cfg)
    cfg["tiers"][0]["admission"] = {"policy": "always", "min_count": 2}
    with pytest.raises(ConfigError, match="takes no options"):
        StorageManager(cfg)


def test_eviction_on_a_tier_that_picks_its_own_victims_is_refused():
    """A value store evicts by itself: an eviction setting there would be silently ignored."""
    cfg = {"tiers": [{"backend": "resp", "options": {"url": "redis://127.0.0.1:1"},
                      "eviction": "s3fifo"}]}
    with pytest.raises(ConfigError, match="picks its own victims"):
        StorageManager(cfg)


class WrongArgs:
    kind = "eviction"

    def __init__(self, ctx):
        pass

    @policyimpl
    def insert(self, key, size):  # the spec says nbytes
        pass


class NoKind:
    def __init__(self, ctx):
        pass


def test_a_policy_breaking_the_spec_fails_at_load_with_its_name():
    with pytest.raises(BackendValidationError, match="(?s)'wrongargs'.*size"):
        validate_policy_class(WrongArgs, "wrongargs", "thirdparty")
    with pytest.raises(BackendValidationError, match="kind"):
        validate_policy_class(NoKind, "nokind")


class NoVictims:
    kind = "eviction"

    def __init__(self, ctx):
        pass

    @policyimpl
    def insert(self, key, nbytes):
        pass

    @policyimpl
    def access(self, key):
        pass

    @policyimpl
    def remove(self, key):
        pass


def test_each_policy_hook_says_at_its_declaration_whether_it_is_required():
    """The required hooks of each kind are those declared ``@required`` (every hook is marked one
    way), and a policy without one is refused naming it; the optional ``stats`` is not needed."""
    from kvplug.hookspecs import hook_needs
    from kvplug.policyspecs import REQUIRED_HOOKS, SPECS

    assert REQUIRED_HOOKS == {"eviction": ("insert", "access", "remove", "victims"),
                              "admission": ("record_use", "admit")}
    for kind, spec in SPECS.items():
        needs = hook_needs(spec)
        assert tuple(h for h, need in needs.items() if need.always) == REQUIRED_HOOKS[kind]
        assert {h for h, need in needs.items() if not need.always} == (
            {"stats"} if kind == "eviction" else {"stats", "admit_loaded"})
    with pytest.raises(BackendValidationError, match=r"'novictims'.*required hook\(s\) victims;"):
        validate_policy_class(NoVictims, "novictims", "thirdparty")


def test_a_policy_named_by_path_is_loaded_like_a_backend(tmp_path):
    path = "kvplug.policies.eviction:S3FIFOEviction"
    with StorageManager({"tiers": [{"backend": "local_cpu", "options": {"capacity": "1MiB"},
                                    "eviction": path}]}) as mgr:
        assert isinstance(mgr.backend(0)._policy, S3FIFOEviction)


# -- the policies on their own -----------------------------------------------------------------------
def _scan_after_hot(policy, capacity_entries: int = 100):
    """Fill a 100-entry cache with a hot set of 50 used often, then scan 500 one-offs through it;
    the hot entries still held."""
    held: set[int] = set()

    def put(k: int) -> None:
        if k in held:
            policy.access(key=k)
            return
        if len(held) >= capacity_entries:
            for v in policy.victims(nbytes=1, evictable=lambda _: True):
                held.discard(v)
        policy.insert(key=k, nbytes=1)
        held.add(k)

    for _ in range(4):
        for k in range(50):
            put(k)
    for k in range(1000, 1500):
        put(k)
    return len(held & set(range(50)))


def test_s3fifo_keeps_the_hot_set_through_a_scan_lru_does_not():
    ctx = PolicyContext("t", {})
    assert _scan_after_hot(LRUEviction(ctx)) == 0  # the negative control
    assert _scan_after_hot(S3FIFOEviction(PolicyContext("t", S3FIFOEviction.Options()))) == 50


def test_tinylfu_admits_on_the_second_use_and_ages():
    policy = TinyLFUAdmission(PolicyContext("t", TinyLFUAdmission.Options(sample_size=1000)))
    keys = [make_key(i) for i in range(200)]
    policy.record_use(keys=keys)
    assert policy.admit(keys=keys, sizes=[1] * 200) == [False] * 200
    policy.record_use(keys=keys[:10])
    assert policy.admit(keys=keys[:10], sizes=[1] * 10) == [True] * 10
    # aging: after sample_size uses every count halves, so 2 uses become 1
    policy.record_use(keys=[make_key(10_000 + i) for i in range(800)])
    assert policy.counts["agings"] == 1
    assert policy.admit(keys=keys[:10], sizes=[1] * 10) == [False] * 10


def test_tinylfu_answers_the_same_in_another_process():
    """Its sketch hashes keys stably: another process (another PYTHONHASHSEED) agrees."""
    code = ("from kvplug.policies import TinyLFUAdmission as T; from kvplug.policyspecs import "
            "PolicyContext as C; p = T(C('t', T.Options(width=64, depth=2)));"
            "ks = [f'k{i}' for i in range(300)]; p.record_use(keys=ks); p.record_use(keys=ks[:150]);"
            "print(''.join('1' if a else '0' for a in p.admit(keys=ks, sizes=[1]*300)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in (1, 2)}
    assert len(outs) == 1, outs


# -- real tiers ------------------------------------------------------------------------------------------
def _put(mgr: StorageManager, i: int) -> None:
    obj = mgr.allocate(CHUNK, torch.uint8, MemoryFormat.KV_PAGES, 16)
    obj.byte_view.fill_(i % 251)
    mgr.batched_put([make_key(i)], [obj])
    obj.ref_down()


def _disk_written(mgr: StorageManager) -> float:
    """Chunk files the posix tier has written."""
    assert mgr.flush(30)
    return mgr.stats()["posix"]["writes"]


@pytest.mark.parametrize("admission, first, second", [
    (None, 1, 1),  # always (the negative control): every store is written
    ({"policy": "tinylfu"}, 0, 0),  # seen once: not written; a use served by L1 writes nothing
    ({"policy": "tinylfu", "on_load": True}, 0, 1),  # ... unless on_load: written from L1's copy
])
def test_admission_writes_a_chunk_to_disk_on_its_second_use(tmp_path, admission, first, second):
    disk = {"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": "8MiB"}}
    if admission:
        disk["admission"] = admission
    with StorageManager({"tiers": [{"backend": "local_cpu", "options": {"capacity": "4MiB"}}, disk],
                         "chunk_size": 16}) as mgr:
        _put(mgr, 1)
        assert _disk_written(mgr) == first
        assert mgr.lookup_prefix([make_key(1)]).tiers == ["local_cpu"]
        (obj,) = mgr.batched_get([make_key(1)])  # the second use, served by L1
        obj.ref_down()
        assert _disk_written(mgr) == second
        stats = mgr.stats()["posix"]
        if admission:
            assert stats["admission_rejected"] == 1 and stats["admission_rejected_bytes"] == NB
            assert stats["admission_late"] == second
        (obj,) = mgr.batched_get([make_key(1)])  # a third use writes nothing more
        obj.ref_down()
        assert _disk_written(mgr) == second
        # L1 loses it; the next request computes it again: its store is a use too, and admitted
        mgr.evict([make_key(1)], tiers=["local_cpu"])
        _put(mgr, 1)
        assert _disk_written(mgr) == 1
        assert mgr.holds("posix", [make_key(1)]) == [True]


def test_a_failing_admission_policy_is_a_fault_and_the_store_goes_on(tmp_path):
    disk = {"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": "8MiB"},
            "admission": "tinylfu"}
    with StorageManager({"tiers": [disk], "chunk_size": 16}) as mgr:
        gate = mgr._tiers[0].admission

        def broken(keys, sizes):
            raise RuntimeError("policy bug")

        gate.policy.admit = broken
        _put(mgr, 2)
        assert _disk_written(mgr) == 1
        assert mgr.stats()["posix"]["faults"] == 1


@pytest.mark.parametrize("tier", ["local_cpu", "posix"])
def test_s3fifo_tier_keeps_its_hot_set_and_pins_through_a_scan(tmp_path, tier):
    """A 32-chunk tier, 16 chunks used four times, one pinned; 200 one-offs stream through: with
    s3fifo the hot ones stay, and the pinned one stays with either policy; the tier never holds
    more than its capacity."""
    held = {}
    for policy in ("lru", "s3fifo"):
        opts = {"capacity": 32 * NB}
        if tier == "posix":
            opts["path"] = str(tmp_path / policy)
        tiers = [{"backend": tier, "options": opts, "eviction": policy}]
        with StorageManager({"tiers": tiers, "chunk_size": 16}) as mgr:
            be = mgr.backend(0)
            if tier == "posix":
                assert be.wait_indexed(30)
            for _ in range(4):
                for i in range(16):
                    if tier == "posix" or mgr.lookup_prefix([make_key(i)]).num_chunks == 0:
                        _put(mgr, i)
                    got = mgr.get(make_key(i))
                    assert got is not None
                    got.ref_down()
                mgr.flush(30)
            assert mgr.lookup_prefix([make_key(99_999)]).num_chunks == 0
            _put(mgr, 15)
            mgr.flush(30)
            assert mgr.lookup_prefix([make_key(15)], pin=True).num_chunks == 1
            for i in range(1000, 1200):
                _put(mgr, i)
                if tier == "posix" and i % 16 == 0:
                    mgr.flush(30)
                st = mgr.stats()[tier]
                assert st["bytes"] <= 32 * NB, st
            mgr.flush(30)
            assert mgr.stats()[tier]["bytes"] <= 32 * NB
            found = mgr.backend(0)
            kept = [mgr.holds(tier, [make_key(i)]) == [True] for i in range(16)]
            assert kept[15], f"{policy}: the pinned chunk was evicted"
            mgr.unpin([make_key(15)], [tier])
            held[policy] = sum(kept[:15])
            del found
    assert held["lru"] == 0, held  # the negative control: a scan flushes an LRU
    assert held["s3fifo"] == 15, held
