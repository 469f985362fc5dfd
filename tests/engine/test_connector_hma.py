"""vLLM's hybrid KV cache manager on (kvplug is ``SupportsHMA``), on a real vLLM engine (CPU).

Model: a tiny Llama-style config whose layers alternate sliding-window (100 tokens) and full
attention (connector/demo/model.py ``make_sliding_model``; random weights, initializer_range
0.08, so outputs depend on the context): vLLM gives it two KV cache groups. kvplug stores each
group's part of a chunk under its own key, the sliding-window part only while every block of the
chunk is inside the window.

Like with like (see test_connector_engine.py): every engine computes 128 tokens (one block) per
prefill step, so a warm request computes exactly what the cold one computed after the hit. With
512-token chunks and a 100-token window, a full chunk's first blocks have left the window before
the chunk is stored: only the full-attention parts of full chunks are stored, plus both parts of
the partial chunk at the prompt's reuse point. A hit there needs only that window.
"""

from __future__ import annotations

import json

import pytest

from tests.support.vllm_helpers import (
    kvplug_config,
    prompt,
    run_scenario,
    same_output,
    stored_chunks,
    transfer_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)

CHUNK = 512
STEP = {"max_num_batched_tokens": 128}
P = prompt(1700, 1)  # 3 full chunks (1536) + a partial one up to 1664, where vLLM reuses
P_CHANGED = [P[0] + 1, *P[1:]]
Q = P[:1536] + prompt(164, 9)  # shares P's full chunks, not their window
NO_CACHE = {"kvplug_load": False, "kvplug_save": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_sliding_model

    return make_sliding_model("tiny", window=100, root=tmp_path_factory.getbasetemp() / "models")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvplug-hma-store")


@pytest.fixture(scope="module")
def swa(model, store_dir):
    kv = transfer_config("kvplug", kvplug_config(store_dir, chunk_size=CHUNK))
    steps = [("gen", P, None), ("gen", P, None), ("gen", P_CHANGED, None), ("gen", Q, NO_CACHE),
             ("gen", Q, None)]
    names = ["cold", "warm", "changed", "q_ref", "q"]
    return dict(zip(names, run_scenario(model, kv, steps, STEP), strict=True))


def test_model_has_sliding_and_full_layers(model):
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert cfg["sliding_window"] == 100


def test_warm_hit_with_only_the_window_is_bit_identical(swa):
    warm = swa["warm"]["kvplug"]
    assert warm["loaded_tokens"] == 1664 and swa["warm"]["cached"] == 1664
    assert warm["async_load"] is True  # several groups: every load is asynchronous
    assert same_output(swa["warm"], swa["cold"])


def test_control_changed_token_changes_output(swa):
    assert swa["changed"]["kvplug"]["loaded_tokens"] == 0
    assert not same_output(swa["changed"], swa["cold"])


def test_hit_stops_where_the_window_is_missing(swa):
    """Q shares P's three full chunks, but their sliding-window parts were never stored: a load
    of the full-attention parts alone would be wrong, so there is no hit; Q is computed."""
    assert swa["q"]["kvplug"]["lookup_hit_tokens"] == 0
    assert swa["q"]["kvplug"]["loaded_tokens"] == 0
    assert same_output(swa["q"], swa["q_ref"])
    assert not same_output(swa["q"], swa["cold"])


def test_groups_stored_apart_with_hma_on(swa, store_dir):
    """Every file holds 2 distinct KV tensors (the hybrid manager overlays the groups' 4 layers;
    with it off there would be 4): P's 3 full-attention chunks and both groups' partial chunk."""
    files = stored_chunks(store_dir)
    assert files and {f["num_layers"] for f in files} == {2}
    assert sorted(f["num_tokens"] for f in files).count(128) == 6  # P, P_CHANGED, Q: 2 each
    assert sorted(f["num_tokens"] for f in files).count(512) == 6  # P's and P_CHANGED's chunks


def test_fresh_process_hits_disk_and_recomputes_corrupt_chunks(model, store_dir, swa):
    """A new engine with only the disk tier: exact hit; corrupt files: the failed load is
    reported as a failed request (several groups) and vLLM recomputes it exactly."""
    kv = transfer_config("kvplug", kvplug_config(store_dir, local_cpu=False, chunk_size=CHUNK))
    warm, n, again = run_scenario(model, kv, [("gen", P, None), ("corrupt", str(store_dir)),
                                              ("gen", P_CHANGED, None)], STEP)
    assert warm["kvplug"]["tiers"] == {"posix": 1664}
    assert same_output(warm, swa["cold"])
    assert n > 0
    assert again["kvplug"]["failed_blocks"] > 0 and again["kvplug"]["loaded_tokens"] == 0
    assert same_output(again, swa["changed"])


def test_control_without_the_window_output_changes(model, tmp_path, swa):
    """Control: a connector that loads only the full-attention groups (tests/support/hma_no_window.py)
    gets the same hit but not the same output, so the exactness check above can fail."""
    kv = {**transfer_config("kvplug", kvplug_config(tmp_path, posix=False, chunk_size=CHUNK)),
          "kv_connector_module_path": "tests.support.hma_no_window"}
    cold, warm = run_scenario(model, kv, [("gen", P, None), ("gen", P, None)], STEP)
    assert same_output(cold, swa["cold"])
    assert warm["kvplug"]["loaded_tokens"] == 1664
    assert not same_output(warm, swa["cold"])


def _granite_hybrid(root) -> str:
    """A tiny GraniteMoeHybrid config (Mamba2 + attention layers; weights: vLLM's dummy load)."""
    from transformers import GraniteMoeHybridConfig

    cfg = GraniteMoeHybridConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
        vocab_size=4096, max_position_embeddings=4096, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2,
        num_local_experts=0, shared_intermediate_size=512)
    cfg.save_pretrained(root)
    data = json.loads((root / "config.json").read_text())
    data.update(architectures=["GraniteMoeHybridForCausalLM"], torch_dtype="bfloat16",
                dtype="bfloat16")
    (root / "config.json").write_text(json.dumps(data))
    return str(root)


def test_hybrid_ssm_model_runs_and_kvplug_stands_aside(tmp_path):
    """A Mamba hybrid needs the hybrid manager (with it off, as vLLM set it for kvplug before,
    it does not start). Now it runs; kvplug cannot restore Mamba state from token chunks, so it
    neither loads nor stores: no hit, nothing on disk."""
    model = _granite_hybrid(tmp_path / "granite-hybrid")
    store = tmp_path / "store"
    kv = transfer_config("kvplug", kvplug_config(store))
    short = prompt(600, 5)
    first, second = run_scenario(model, kv, [("gen", short, None), ("gen", short, None)],
                                 {"load_format": "dummy", "max_model_len": 2048})
    assert len(first["tokens"]) == len(second["tokens"]) == 8
    for out in (first, second):
        assert out["kvplug"]["lookup_hit_tokens"] == 0 and out["kvplug"]["loaded_tokens"] == 0
        assert out["kvplug"]["stored_tokens"] == 0 and out["cached"] == 0
    assert stored_chunks(store) == []
