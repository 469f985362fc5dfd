"""``fp8``: bf16/fp16/fp32 KV stored as float8 e4m3 with one scale per layer and KV head — LOSSY.

Each layer of a chunk is stored as fp8 e4m3 (``torch.float8_e4m3fn``) plus one float32 scale per
KV head (``amax(head) / 448``), and decoded back to the engine's dtype: half the bytes of bf16 at
about 2^-4 relative error per element. Heads are found from the key's ``kv_layout`` (vLLM's
``LBHNC``/``LBNHC``... names with the block size) and ``codec_options.num_kv_heads`` (the model's
KV heads per tensor-parallel rank). A cache that is already fp8 is stored raw.

It changes the KV the model attends to, so outputs may change: opt-in per tier, logged at start-up
(see ``benchmarks/bench_codecs.py`` for token agreement and logprob drift on a test model).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ConfigDict, Field

from ..config import BaseOptions
from ..errors import CodecError
from .base import Codec, LayerSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
_SOURCE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class FP8Options(BaseOptions):
    """``codec_options`` of the ``fp8`` codec."""

    model_config = ConfigDict(extra="forbid")
    num_kv_heads: int = Field(ge=1, description="KV heads per TP rank (per-head scales)")


def _geometry(spec: LayerSpec, heads: int, dtype: torch.dtype) -> tuple[list[int], int]:
    """The page as dims (``[blocks, H, N, C]`` or ``[blocks, N, H, C]``...) and the head axis."""
    order = spec.page_order
    if order is None:
        raise CodecError(f"kv_layout {spec.key.kv_layout!r} does not name the page order")
    dims, block_size = order
    elems, rem = divmod(spec.page_bytes, dtype.itemsize)
    chans, rem2 = divmod(elems, heads * block_size) if not rem else (0, 1)
    if rem or rem2 or chans == 0:
        raise CodecError(f"a page of {spec.page_bytes} bytes is not {heads} heads x {block_size} "
                         f"tokens of {dtype}; check codec_options.num_kv_heads")
    sizes = {"H": heads, "N": block_size, "C": chans}
    return [spec.num_blocks, *(sizes[d] for d in dims)], 1 + dims.index("H")


class FP8Codec(Codec):
    """Lossy: fp8 e4m3 pages with per-(layer, head) float32 scales."""

    lossy = True
    Options = FP8Options

    def encode_layer(self, pages: torch.Tensor, spec: LayerSpec) -> tuple[Any, dict[str, Any]]:
        dtype = spec.element_dtype
        if dtype not in _SOURCE.values():
            raise CodecError(f"fp8 stores bfloat16/float16/float32 KV, this cache is "
                             f"{spec.key.kv_dtype!r}")
        heads = self.options.num_kv_heads
        shape, axis = _geometry(spec, heads, dtype)
        x = pages.contiguous().view(dtype).reshape(shape).float()
        other = [d for d in range(len(shape)) if d != axis]
        amax = x.abs().amax(dim=other)
        if not torch.isfinite(amax).all():
            raise CodecError("the layer holds inf/nan values")
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
        bshape = [1] * len(shape)
        bshape[axis] = heads
        q = (x / scales.reshape(bshape)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        payload = scales.numpy().tobytes() + q.view(torch.uint8).reshape(-1).numpy().tobytes()
        name = next(k for k, v in _SOURCE.items() if v == dtype)
        return payload, {"dtype": name, "heads": heads, "shape": shape, "head_axis": axis}

    @classmethod
    def decode_layer(cls, payload: memoryview, params: dict[str, Any], out: torch.Tensor,
                     spec: LayerSpec) -> None:
        dtype = _SOURCE.get(params.get("dtype"))  # type: ignore[arg-type]
        shape, axis, heads = params.get("shape"), params.get("head_axis"), params.get("heads")
        if dtype is None or not isinstance(shape, list) or not all(
                isinstance(d, int) and d > 0 for d in shape) or not isinstance(axis, int) \
                or not 0 < axis < len(shape) or shape[axis] != heads:
            raise CodecError(f"fp8 frame parameters {params!r} are malformed")
        n = 1
        for d in shape:
            n *= d
        if n * dtype.itemsize != out.numel() or shape[0] != spec.num_blocks:
            raise CodecError(f"fp8 frame of shape {shape} ({dtype}) does not fill the layer's "
                             f"{out.numel()} bytes")
        if len(payload) != 4 * heads + n:
            raise CodecError(f"fp8 payload of {len(payload)} bytes, expected {4 * heads + n}")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        scales = raw[: 4 * heads].view(torch.float32)
        if not torch.isfinite(scales).all() or (scales <= 0).any():
            raise CodecError("fp8 scales are not positive finite numbers")
        bshape = [1] * len(shape)
        bshape[axis] = heads
        x = raw[4 * heads :].view(FP8).reshape(shape).float() * scales.reshape(bshape)
        out.view(torch.uint8).reshape(-1).copy_(x.to(dtype).reshape(-1).view(torch.uint8))
