"""Tiny local models for tests, the demo and benchmarks: a config plus random weights, no download.

Weights come from transformers' own initialisation with a fixed seed and ``initializer_range``
0.08, so outputs depend on the context (vLLM's ``load_format="dummy"`` makes every logit equal,
which would let any output comparison pass). Presets with ``weights=False`` write only the config
(for timing with ``load_format="dummy"``). Every model gets a small BPE tokenizer trained locally
(:mod:`.tokenizer`), so vLLM can take text. A model is written once per cache directory and reused
(one written before models had a tokenizer gets it added).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvplug.config import default_cache_dir

from . import tokenizer

#: Seed of the tokenizer's training corpus (the same tokenizer for every model of one vocab size).
TOKENIZER_SEED = 1234

PRESETS: dict[str, dict[str, Any]] = {
    # tests: 4 layers, ~3M parameters; one engine starts in ~15 s on 2 cores
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=768, vocab_size=4096),
    # the demo: prefill of a few thousand tokens takes a visible fraction of a second
    "small": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, intermediate_size=1536, vocab_size=6000),
    # benchmarks: ~100M parameters (timing only: use load_format="dummy")
    "bench100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, head_dim=64, intermediate_size=2560,
                      vocab_size=32000),
}


def model_dir(preset: str = "tiny", seed: int = 1234, weights: bool = True,
              root: str | os.PathLike[str] | None = None) -> Path:
    """Where a preset lives: ``<root or kvplug cache>/models/<preset>-seed<seed>[-config]``."""
    base = Path(root) if root is not None else default_cache_dir() / "models"
    return base / (f"{preset}-seed{seed}" + ("" if weights else "-config"))


def make_model(preset: str = "tiny", seed: int = 1234, weights: bool = True,
               root: str | os.PathLike[str] | None = None, max_len: int = 8192) -> Path:
    """Write (once) and return a local Qwen3-style model directory vLLM can load."""
    out = model_dir(preset, seed, weights, root)
    if (out / "config.json").is_file():
        _add_tokenizer(out, PRESETS[preset]["vocab_size"], max_len)
        return out
    from transformers import Qwen3Config

    cfg = Qwen3Config(**PRESETS[preset], max_position_embeddings=max_len,
                      initializer_range=0.08, tie_word_embeddings=False, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        if weights:
            import torch
            from transformers import Qwen3ForCausalLM

            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
            model.save_pretrained(tmp)
        else:
            cfg.save_pretrained(tmp)
        # a config saved alone has no architectures: vLLM would then guess a pooling model
        _publish(tmp, out, {"architectures": ["Qwen3ForCausalLM"]},
                 PRESETS[preset]["vocab_size"], max_len)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _publish(tmp: Path, out: Path, config: dict, vocab_size: int, max_len: int) -> None:
    """Finish a model written into ``tmp`` (bf16 + ``config`` in its config.json, the local
    tokenizer) and rename it to ``out``; a directory another process published first is kept."""
    data = json.loads((tmp / "config.json").read_text())
    data.update(torch_dtype="bfloat16", dtype="bfloat16", **config)
    (tmp / "config.json").write_text(json.dumps(data, indent=2))
    tokenizer.save(tmp, vocab_size, max_len, TOKENIZER_SEED)
    try:
        os.rename(tmp, out)
    except OSError:  # another process wrote it first
        if not (out / "config.json").is_file():
            raise


def _add_tokenizer(out: Path, vocab_size: int, max_len: int) -> None:
    """Give a model directory written before models had a tokenizer one (written aside, renamed)."""
    if (out / "tokenizer_config.json").is_file():
        return
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=out))
    try:
        tokenizer.save(tmp, vocab_size, max_len, TOKENIZER_SEED)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the config last: it marks done
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_sliding_model(preset: str = "tiny", window: int = 100, seed: int = 1234,
                       root: str | os.PathLike[str] | None = None, max_len: int = 8192) -> Path:
    """Write (once) and return a Llama-style model whose layers alternate sliding-window
    (``window`` tokens) and full attention: vLLM's hybrid KV cache manager gives it two KV cache
    groups. Random weights as :func:`make_model` (outputs depend on the context; vLLM's Qwen3
    refuses mixed sliding-window layers, Llama takes ``layer_types``)."""
    base = Path(root) if root is not None else default_cache_dir() / "models"
    out = base / f"{preset}-swa{window}-seed{seed}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    params = PRESETS[preset]
    layer_types = ["sliding_attention", "full_attention"] * (params["num_hidden_layers"] // 2)
    cfg = LlamaConfig(**params, max_position_embeddings=max_len, initializer_range=0.08,
                      tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1,
                      eos_token_id=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
        _publish(tmp, out, {"architectures": ["LlamaForCausalLM"], "layer_types": layer_types,
                            "sliding_window": window}, params["vocab_size"], max_len)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_eagle_draft(preset: str = "tiny", seed: int = 7,
                     root: str | os.PathLike[str] | None = None, max_len: int = 8192) -> Path:
    """Write (once) and return a one-layer EAGLE draft head for a :func:`make_model` target of
    the same preset, with random weights: vLLM's Llama-EAGLE layout (``fc`` joining the token
    embedding and the target's hidden state, one decoder layer without input norm; embedding
    and LM head shared with the target). For tests of speculative decoding: it drafts (badly),
    and it has KV layers of its own in the engine's KV cache."""
    base = Path(root) if root is not None else default_cache_dir() / "models"
    out = base / f"{preset}-eagle-seed{seed}"
    if (out / "config.json").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    p = PRESETS[preset]
    h, heads, kv_heads, hd, inter = (p["hidden_size"], p["num_attention_heads"],
                                     p["num_key_value_heads"], p["head_dim"],
                                     p["intermediate_size"])
    cfg = LlamaConfig(**{**p, "num_hidden_layers": 1}, max_position_embeddings=max_len,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.08).to(torch.bfloat16)

    weights = {"fc.weight": rand(h, 2 * h),
               "layers.0.self_attn.q_proj.weight": rand(heads * hd, h),
               "layers.0.self_attn.k_proj.weight": rand(kv_heads * hd, h),
               "layers.0.self_attn.v_proj.weight": rand(kv_heads * hd, h),
               "layers.0.self_attn.o_proj.weight": rand(h, heads * hd),
               "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h),
               "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        cfg.save_pretrained(tmp)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _publish(tmp, out, {"architectures": ["LlamaForCausalLM"]}, p["vocab_size"], max_len)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
