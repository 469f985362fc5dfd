"""What besides the tokens identifies a chunk of a request: multimodal inputs, LoRA adapter,
prompt embeddings and cache salt (mixed into the chunk hash by :class:`kvplug.tokens.TokenDatabase`).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.v1.request import Request


def _embeds_digest(request: Request, start: int, end: int) -> bytes | None:
    """sha256 of the prompt embeddings of tokens ``[start, end)`` (None past them or without)."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None or start >= len(embeds):
        return None
    part = embeds[start:end].detach().contiguous().cpu()
    head = f"{part.dtype}{tuple(part.shape)}".encode()
    return hashlib.sha256(head + part.view(-1).view(torch.uint8).numpy().tobytes()).digest()


def chunk_extra_keys(request: Request, start: int, end: int) -> tuple | None:
    """What besides the tokens identifies tokens ``[start, end)``: the multimodal inputs
    overlapping them (so two images behind the same placeholder tokens never share an entry), the
    LoRA adapter (name and path, as vLLM's own block hash), the prompt embeddings (their
    positions hold placeholder ids), and the cache salt (first chunk only)."""
    keys: list[tuple] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    if (embeds := _embeds_digest(request, start, end)) is not None:
        keys.append(("prompt_embeds", embeds))
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        if pos.offset < end and pos.offset + pos.length > start:
            keys.append(("mm", f.identifier, pos.offset - start))
    salt = getattr(request, "cache_salt", None)
    if start == 0 and salt:
        keys.append(("salt", salt))
    return tuple(keys) or None
