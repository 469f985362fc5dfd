"""Shared pieces of the codec tests (tests/test_codecs*.py): KV-like chunks, keys, posix tier
configs, a manager over them and what it wrote to disk.
"""

from __future__ import annotations

import torch
from kvplug import chunkfile as cf
from kvplug.keys import CacheKey
from kvplug.memory import heap_memory_obj
from kvplug.storage_manager import StorageManager

LAYERS, BLOCKS, HEADS, BS, HEAD_DIM = 4, 2, 2, 16, 64
PAGE = HEADS * BS * 2 * HEAD_DIM * 2  # [H, N, C=2*head_dim] bf16: LBHNC, block size 16


def kv_obj(seed: int, layers: int = LAYERS, tokens: int = 32):
    """A KV_PAGES chunk of bf16 values like KV (normal, a few large heads), as raw bytes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, BLOCKS, HEADS, BS, 2 * HEAD_DIM, generator=g)
    x[:, :, 1] *= 8.0  # one head with a larger range: per-head scales matter for fp8
    obj = heap_memory_obj((layers, BLOCKS, PAGE), num_tokens=tokens)
    obj.tensor.copy_(x.to(torch.bfloat16).view(torch.uint8).reshape(layers, BLOCKS, PAGE))
    return obj


def random_obj(seed: int):
    g = torch.Generator().manual_seed(seed)
    obj = heap_memory_obj((LAYERS, BLOCKS, PAGE), num_tokens=32)
    obj.tensor.copy_(torch.randint(0, 256, (LAYERS, BLOCKS, PAGE), dtype=torch.uint8, generator=g))
    return obj


def posix(path, codec: str | None = None, options: dict | None = None, name: str = "disk"):
    tier = {"backend": "posix", "name": name, "options": {"path": str(path), "capacity": "1GiB"}}
    if codec:
        tier["codec"] = codec
    if options:
        tier["codec_options"] = options
    return tier


def manager(*tiers) -> StorageManager:
    return StorageManager({"chunk_size": 32, "tiers": list(tiers)})


def stored(mgr: StorageManager, k: CacheKey, obj) -> None:
    mgr.batched_put([k], [obj])
    assert mgr.flush(60)


def files(root) -> list:
    return sorted(p for p in root.rglob("*") if p.is_file() and cf.is_chunk_file(p.name))


def header_of(path) -> cf.ChunkHeader:
    with open(path, "rb") as f:
        return cf.read_header_fd(f.fileno())[0]
