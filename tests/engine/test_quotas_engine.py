"""A noisy neighbour on a real vLLM engine: tenant B floods the disk tier, tenant A's
hits hold when B has a quota; a tenant C without one (the negative control, same engine) floods
the same way and evicts A's chunks.

A request's tenant is its ``cache_salt`` (never a name in ``kv_transfer_params``:
tests/unit/test_quotas.py). One posix tier of 16 MiB; a tiny-model chunk of 256 tokens is a
~0.5 MiB file; A stores 4 chunks, then B sends 10 prompts of 4 chunks (~21 MiB), then A asks again.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import prompt, run_scenario, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)

A = prompt(1024, 901)
FLOOD = [prompt(1024, 950 + i) for i in range(10)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


def test_a_flooding_tenant_leaves_the_other_tenants_hits(model, tmp_path):
    """One engine: B (quota 3 MiB) floods, A's hit holds; then C (no quota) floods the same way
    and A's hit is gone (the negative control, in the same engine and tier)."""
    from kvplug.policies.tenants import tenant_id, tenant_of_name

    root = tmp_path / "chunks"
    tier = {"backend": "posix", "options": {"path": str(root), "capacity": "16MiB"},
            "quotas": {"tenants": {"team-b": "3MiB"}}}
    kv = transfer_config("kvplug", {"tiers": [tier], "async_save": False})
    a, b, c = {"cache_salt": "team-a"}, {"cache_salt": "team-b"}, {"cache_salt": "team-c"}
    flood_c = [prompt(1024, 980 + i) for i in range(10)]
    out = run_scenario(model, kv, [("gen", A, a), *[("gen", p, b) for p in FLOOD], ("gen", A, a),
                                   *[("gen", p, c) for p in flood_c], ("gen", A, a)])
    cold, after_b, after_c = out[0], out[len(FLOOD) + 1], out[-1]
    for warm in (after_b, after_c):
        assert warm["tokens"] == cold["tokens"]  # a hit never changes what the model generates
    hit_b = (after_b["kvplug"] or {}).get("promised_tokens", 0)
    hit_c = (after_c["kvplug"] or {}).get("promised_tokens", 0)
    files = [p for p in root.rglob("*.safetensors")]
    by_tenant: dict[str, int] = {}
    for f in files:
        t = tenant_of_name(f.name)
        by_tenant[t] = by_tenant.get(t, 0) + f.stat().st_size
    ids = {tenant_id(t) for t in ("team-a", "team-b", "team-c")}
    assert set(by_tenant) <= ids, by_tenant  # every chunk is named for its tenant
    assert not any("team" in f.name for f in files)
    assert hit_b >= 768, f"A's hit should hold through B's flood under B's quota (hit {hit_b})"
    assert by_tenant.get(tenant_id("team-b"), 0) <= 3 << 20, by_tenant
    assert hit_c == 0, f"C has no quota: its flood should evict A's chunks (hit {hit_c})"
