"""A noisy neighbour on a real vLLM engine (issue 34): tenant B floods the disk tier, tenant A's
hits hold when B has a quota; without quotas (the negative control) B's flood evicts A's chunks.

Tenants are named in ``kv_transfer_params`` (``{"tenant": ...}``; a ``cache_salt`` works the
same way, tests/test_quotas.py). One posix tier of 16 MiB; a tiny-model chunk of 256 tokens is a
~0.5 MiB file; A stores 4 chunks, then B sends 10 prompts of 4 chunks (~21 MiB), then A asks again.
"""

from __future__ import annotations

import pytest
from vllm_helpers import prompt, run_scenario, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)

A = prompt(1024, 901)
FLOOD = [prompt(1024, 950 + i) for i in range(10)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


def _serve(model, root, quotas):
    tier = {"backend": "posix", "options": {"path": str(root), "capacity": "16MiB"}}
    if quotas:
        tier["quotas"] = quotas
    kv = transfer_config("kvplug", {"tiers": [tier], "async_save": False})
    a, b = {"tenant": "team-a"}, {"tenant": "team-b"}
    return run_scenario(model, kv, [("gen", A, a), *[("gen", p, b) for p in FLOOD], ("gen", A, a)])


@pytest.mark.parametrize("quotas", [None, {"default": "3MiB", "tenants": {"team-a": "3MiB"}}])
def test_a_flooding_tenant_leaves_the_other_tenants_hits(model, tmp_path, quotas):
    from kvplug.policies.tenants import tenant_id, tenant_of_name

    root = tmp_path / "chunks"
    out = _serve(model, root, quotas)
    cold, warm = out[0], out[-1]
    assert warm["tokens"] == cold["tokens"]  # a hit never changes what the model generates
    hit = (warm["kvplug"] or {}).get("promised_tokens", 0)
    files = [p for p in root.rglob("*.safetensors")]
    by_tenant: dict[str, int] = {}
    for f in files:
        t = tenant_of_name(f.name)
        by_tenant[t] = by_tenant.get(t, 0) + f.stat().st_size
    a, b = tenant_id("team-a"), tenant_id("team-b")
    assert set(by_tenant) <= {a, b}, by_tenant  # every chunk is named for its tenant
    assert not any("team" in f.name for f in files)
    if quotas is None:
        assert hit == 0, f"without quotas B's flood should evict A's chunks (hit {hit})"
    else:
        assert hit >= 768, f"A's hit should hold through B's flood (hit {hit}, use {by_tenant})"
        assert by_tenant[b] <= 3 << 20, by_tenant
