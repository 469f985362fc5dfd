"""The simulation draws the tiers' policies from the policy registry (entry-point group
``kvplug.policies``): a policy a package registers is drawn by some seed, and with kvplug's own
policies installed every seed draws what it drew when the choices were written out."""

from __future__ import annotations

import random
import textwrap

import pytest
from kvplug.connector.sim.engine import SimConfig
from kvplug.connector.sim.schedule import config_for, policy_choices
from kvplug.policies import registry

#: kvplug's own policies (what its package registers)
OWN = "lru,s3fifo,always,tinylfu"


def _old_draw(seed: int) -> tuple[str, str, bool, bool]:
    """The policy draw as it was written before it read the registry."""
    pol = random.Random(seed * 104729 + 11)
    base = SimConfig(hybrid=False)
    if pol.random() < 0.5:
        return (pol.choice(("lru", "s3fifo", "s3fifo")), pol.choice(("always", "tinylfu")),
                pol.random() < 0.6, pol.random() < 0.5)
    return base.eviction, base.admission, base.small_tiers, base.tenants


@pytest.fixture(autouse=True)
def _read_the_registry_again():
    policy_choices.cache_clear()
    yield
    policy_choices.cache_clear()


def test_kvplugs_own_policies_draw_as_before(monkeypatch):
    monkeypatch.setenv("KVPLUG_LOAD_POLICIES", OWN)
    assert policy_choices("eviction") == ("lru", "s3fifo", "s3fifo")
    assert policy_choices("admission") == ("always", "tinylfu")
    for seed in [*range(400), *range(1_000_000, 1_000_100), 7003276, 91015041]:
        cfg = config_for(seed)
        assert (cfg.eviction, cfg.admission, cfg.small_tiers, cfg.tenants) == _old_draw(seed), seed


def test_a_registered_policy_is_drawn(tmp_path, monkeypatch):
    """A package that registers an eviction policy under a new name (an entry point, as any
    third party does) has it drawn by some seed, after kvplug's own in the choices."""
    (tmp_path / "kvplug_simtest_policy.py").write_text(textwrap.dedent('''
        from kvplug.policies.eviction import LRUEviction

        class SimTestEviction(LRUEviction):
            """LRU under another name."""
    '''))
    info = tmp_path / "kvplug_simtest_policy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplug-simtest-policy\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[kvplug.policies]\nsimtest = kvplug_simtest_policy:SimTestEviction\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVPLUG_LOAD_POLICIES", OWN + ",simtest")
    monkeypatch.setattr(registry, "_cache", {})
    assert policy_choices("eviction") == ("lru", "s3fifo", "s3fifo", "simtest")
    assert policy_choices("admission") == ("always", "tinylfu")
    seed = next((s for s in range(200) if config_for(s).eviction == "simtest"), None)
    assert seed is not None, "no seed of 200 drew the registered policy"
    pytest.importorskip("vllm")
    from kvplug.connector.sim.schedule import run_seed

    out = run_seed(seed)  # its tiers evict with it, and every invariant holds
    assert out.violation is None, out.violation
    assert out.counts["config posix tier"] or out.counts["config values tier"]
