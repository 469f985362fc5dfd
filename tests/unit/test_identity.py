"""Identity: an entry is served only to an engine whose KV bytes it matches.

Each case builds two engine configurations with vLLM's own ``EngineArgs(...).create_engine_config()``
(no engine is started) that differ in one field, turns them into keys with the connector's real
identity code, stores a chunk under the first over one real posix directory and reads it back
under the second from a fresh StorageManager. A control with equal configurations does share, so
no case can pass vacuously.
"""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch
from kvplug.connector.protocol.config import ConnectorConfig
from kvplug.connector.protocol.identity import build_identity, chunk_extra_keys
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random
from kvplug.tokens import TokenDatabase

from tests.support.vllm_helpers import engine_env, prompt

CHUNK = 256
TOKENS = prompt(2 * CHUNK, seed=5)
HASHES = TokenDatabase(CHUNK).chunk_hashes(TOKENS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two copies of one random-weight model at different paths, and one with other weights."""
    from kvplug.connector.demo.model import make_model

    root = tmp_path_factory.getbasetemp() / "models"
    a = make_model("tiny", weights=True, root=root)
    copy = root / "elsewhere" / "same-model-other-path"
    shutil.copytree(a, copy)
    other = make_model("tiny", seed=99, weights=True, root=root)
    return {"a": a, "copy": copy, "other": other}


def engine_config(model, **kw):
    engine_env()
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                enforce_eager=True)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def key_of(vllm_config, chunk_hash: bytes, *, tensor_dtype: str = "bfloat16", tp_rank: int = 0,
           pp_rank: int = 0, cfg: ConnectorConfig | None = None):
    ident = build_identity(vllm_config, cfg or ConnectorConfig(), tp_rank=tp_rank, pp_rank=pp_rank)
    return ident.key(tensor_dtype, chunk_hash)


def shares(root, key_a, key_b) -> bool:
    """Store a chunk under ``key_a``; does a fresh manager over the same directory serve it
    (byte-identical) under ``key_b``?"""
    tiers = {"tiers": [{"backend": "posix", "options": {"path": str(root), "capacity": "64MiB"}}]}
    with StorageManager(tiers) as mgr:
        obj = fill_random(mgr, seed=3)
        want = obj.byte_view.clone()
        mgr.batched_put([key_a], [obj])
        assert mgr.flush(), "posix write did not finish"
        obj.ref_down()
    assert any(root.rglob("*.safetensors")), "nothing was stored: the check would be vacuous"
    with StorageManager(tiers) as mgr:
        found = mgr.lookup_prefix([key_b]).num_chunks
        got = mgr.get(key_b)
        if got is None:
            assert found == 0, "lookup promised a chunk get could not read"
            return False
        same = torch.equal(got.byte_view, want)
        got.ref_down()
        assert same and found == 1
        return True


# (name, engine args A, engine args B, key args A, key args B)
CASES = [
    ("kv_cache_dtype", dict(kv_cache_dtype="fp8_e4m3"), dict(kv_cache_dtype="fp8_e5m2"),
     dict(tensor_dtype="uint8"), dict(tensor_dtype="uint8")),
    ("kv_scale_layers", dict(kv_cache_dtype="fp8_e4m3"),
     dict(kv_cache_dtype="fp8_e4m3", kv_cache_dtype_skip_layers=["0"]),
     dict(tensor_dtype="uint8"), dict(tensor_dtype="uint8")),
    ("pp_rank", dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2),
     dict(pp_rank=0), dict(pp_rank=1)),
    ("revision", dict(revision="r1"), dict(revision="r2"), {}, {}),
    ("quantization", {}, dict(quantization="fp8"), {}, {}),
    ("rope_scaling", {}, dict(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
     {}, {}),
    # the same KV tensors (fp8: uint8) from a model served in another dtype (vLLM 0.33 refuses a
    # bfloat16 KV cache under a float16 model)
    ("served_dtype", dict(kv_cache_dtype="fp8_e4m3"),
     dict(dtype="float16", kv_cache_dtype="fp8_e4m3"), dict(tensor_dtype="uint8"),
     dict(tensor_dtype="uint8")),
]


@pytest.mark.parametrize("name,ea,eb,ka,kb", CASES, ids=[c[0] for c in CASES])
def test_configs_differing_in_one_field_never_share(tmp_path, models, name, ea, eb, ka, kb):
    a = key_of(engine_config(models["a"], **ea), HASHES[0], **ka)
    b = key_of(engine_config(models["a"], **eb), HASHES[0], **kb)
    assert not shares(tmp_path / "x", a, b), f"{name}: an engine with another {name} was served"
    # control: the same configuration, built again from scratch, does share
    a2 = key_of(engine_config(models["a"], **ea), HASHES[0], **ka)
    assert shares(tmp_path / "y", a, a2), f"{name}: the control did not share"


def test_layer_range_is_part_of_identity(tmp_path, models, monkeypatch):
    """Same PP rank, different layer split (VLLM_PP_LAYER_PARTITION): different layers."""
    vllm_config = engine_config(models["a"], pipeline_parallel_size=2)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    a = key_of(vllm_config, HASHES[0], pp_rank=0)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,2")
    b = key_of(vllm_config, HASHES[0], pp_rank=0)
    assert not shares(tmp_path / "x", a, b)
    assert shares(tmp_path / "y", b, key_of(vllm_config, HASHES[0], pp_rank=0))


def test_same_model_at_two_paths_shares(tmp_path, models):
    a = key_of(engine_config(models["a"]), HASHES[1])
    b = key_of(engine_config(models["copy"]), HASHES[1])
    assert shares(tmp_path / "x", a, b), "the namespace depends on where the weights sit"


def test_other_weights_with_the_same_config_never_share(tmp_path, models):
    a = key_of(engine_config(models["a"]), HASHES[1])
    b = key_of(engine_config(models["other"]), HASHES[1])
    assert not shares(tmp_path / "x", a, b)


def _spec(method: str, model=None) -> dict:
    if method == "ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 1}}
    return {"speculative_config": {"method": method, "model": str(model),
                                   "num_speculative_tokens": 3}}


@pytest.mark.parametrize("named", [False, True], ids=["weights", "model_name"])
def test_drafter_with_kv_layers_is_part_of_identity(tmp_path, models, named):
    """A drafter with KV layers of its own (a draft model, an EAGLE head) stores them with the
    target's: KV of one drafter is never served to an engine with another drafter, or with
    none, even under one explicit ``model_name``. n-gram drafting has no KV: it shares with the
    plain engine (control: the check can say "shares")."""
    from kvplug.connector.compat import drops_last_block
    from kvplug.connector.demo.model import make_eagle_draft

    root = models["a"].parent
    cfg = ConnectorConfig(model_name="m") if named else None
    eagle_a, eagle_b = make_eagle_draft(seed=7, root=root), make_eagle_draft(seed=8, root=root)
    vllm_configs = {name: engine_config(models["a"], **kw) for name, kw in {
        "plain": {}, "ngram": _spec("ngram"),
        "draft_a": _spec("draft_model", models["a"]),
        "draft_other": _spec("draft_model", models["other"]),
        "eagle_a": _spec("eagle", eagle_a), "eagle_b": _spec("eagle", eagle_b)}.items()}
    key = {name: key_of(vllm_config, HASHES[0], cfg=cfg) for name, vllm_config in vllm_configs.items()}
    # which drafters make kvplug recompute a hit's last block (see the scheduler's docstring)
    assert [n for n, vllm_config in vllm_configs.items() if drops_last_block(vllm_config)] == ["eagle_a", "eagle_b"]
    for a, b in [("draft_a", "draft_other"), ("eagle_a", "eagle_b"), ("plain", "draft_a"),
                 ("plain", "eagle_a"), ("draft_a", "eagle_a")]:
        assert key[a].model_digest != key[b].model_digest, (a, b)
    assert not shares(tmp_path / "x", key["eagle_a"], key["eagle_b"])
    assert shares(tmp_path / "y", key["plain"], key["ngram"])


def test_model_name_override(tmp_path, models):
    """``model_name`` names the model explicitly: equal names share, other names do not."""
    vc_a, vc_b = engine_config(models["a"]), engine_config(models["other"])
    a = key_of(vc_a, HASHES[0], cfg=ConnectorConfig(model_name="fleet/model"))
    b = key_of(vc_b, HASHES[0], cfg=ConnectorConfig(model_name="fleet/model"))
    c = key_of(vc_a, HASHES[0], cfg=ConnectorConfig(model_name="fleet/other"))
    assert shares(tmp_path / "x", a, b)
    assert not shares(tmp_path / "y", a, c)


# -- request-level identity: LoRA adapters and prompt embeddings ----------------------------------
def _request(req_id, tokens, **kw):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, **kw)


def _hashes(request):
    return TokenDatabase(CHUNK).chunk_hashes(request.all_token_ids,
                                             extra_keys=partial(chunk_extra_keys, request))


def _lora(name, path):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, 1, path)


@pytest.mark.parametrize("other,same", [(("ad", "/adapters/v2"), False), (("ad", "/adapters/v1"),
                                                                          True)],
                         ids=["other-path", "control"])
def test_lora_adapter_path_is_keyed(tmp_path, models, other, same):
    vllm_config = engine_config(models["a"])
    ra = _request("a", TOKENS, lora_request=_lora("ad", "/adapters/v1"))
    rb = _request("b", TOKENS, lora_request=_lora(*other))
    a, b = key_of(vllm_config, _hashes(ra)[0]), key_of(vllm_config, _hashes(rb)[0])
    assert shares(tmp_path / "x", a, b) is same


@pytest.mark.parametrize("same", [False, True], ids=["other-embeds", "control"])
def test_prompt_embeds_are_keyed(tmp_path, models, same):
    """A mixed prompt (token ids + embeddings): the placeholders are equal, the embeddings not."""
    vllm_config = engine_config(models["a"])
    n = len(TOKENS)
    mask = [i % 3 != 0 for i in range(n)]  # every third position comes from prompt_embeds
    emb_a = torch.randn(n, 256, generator=torch.Generator().manual_seed(1))
    emb_b = emb_a.clone() if same else torch.randn(n, 256, generator=torch.Generator().manual_seed(2))
    ra = _request("a", TOKENS, prompt_embeds=emb_a, prompt_is_token_ids=mask)
    rb = _request("b", TOKENS, prompt_embeds=emb_b, prompt_is_token_ids=mask)
    a, b = key_of(vllm_config, _hashes(ra)[0]), key_of(vllm_config, _hashes(rb)[0])
    assert shares(tmp_path / "x", a, b) is same


# -- what a chunk file records, and what `kvplug inspect` shows ----------------------------------
def test_chunk_header_records_every_identity_field_and_inspect_shows_the_digest(tmp_path, models):
    import json
    import os

    from kvplug import chunkfile as cf

    from tests.support.engine_processes import run_console_script

    vllm_config = engine_config(models["a"], pipeline_parallel_size=2, kv_cache_dtype="fp8_e5m2")
    key = key_of(vllm_config, HASHES[0], tensor_dtype="uint8", pp_rank=1)
    assert (key.pp_size, key.pp_rank, key.layers) == (2, 1, "2-4")
    assert key.model == "Qwen3ForCausalLM" and len(key.model_digest) == 16
    assert key.kv_dtype == "uint8-fp8-e5m2"
    root = tmp_path / "store"
    assert shares(root, key, key)
    (path,) = root.rglob("*.safetensors")
    fd = os.open(path, os.O_RDONLY)
    try:
        header = cf.read_header_fd(fd)[0]
    finally:
        os.close(fd)
    assert header.key == key and header.key.fields() == key.fields()
    out = run_console_script(["inspect", str(root), "--json"], dict(os.environ), None, 120)
    assert out.returncode == 0, out.stderr
    (group,) = json.loads(out.stdout)["groups"]
    assert group["model_digest"] == key.model_digest and group["pp"] == "1/2 L2-4"
    table = run_console_script(["inspect", str(root)], {**os.environ, "COLUMNS": "250"}, None,
                               120)
    assert key.model_digest in table.stdout, table.stdout
