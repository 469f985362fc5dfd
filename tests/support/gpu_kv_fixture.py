"""The KV caches gpu/ tests run on, built as vLLM 0.32 builds them, and their byte-level
reference (computed from the layout's known offsets, never through kvplug's views)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from kvplug.pool import HostMemoryPool
from torch.overrides import TorchFunctionMode

LAYOUTS = ["LBHNC", "LBNHC", "MLA"]
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]
POISON = 0xA5
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


#: block-major ("cross-layer") orders: one block's pages of every layer are adjacent
CROSS_LAYER = ("BLHNC", "BLNHC")


def vllm_kv_views(
    buf: torch.Tensor, layout: str, dtype: torch.dtype, *, L: int, B: int, H: int, N: int, C: int
) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer ``[B, H, N, C]`` views (MLA: H = 1) in ``dtype`` over the int8
    ``buf`` of ``L * B * H * N * C`` elements, laid out physically in ``layout``: LBHNC (CPU,
    FlashInfer), LBNHC (FlashAttention: physical ``[B, N, H, C]``), MLA, or a cross-layer order
    (BLHNC, BLNHC: block outermost, so a layer's block stride is ``L`` pages)."""
    if layout not in (*LAYOUTS, *CROSS_LAYER):
        raise ValueError(f"unknown layout {layout!r}")
    nh = layout.endswith("NHC")  # physically [.., N, H, C]: the logical view permutes H and N
    inner = (N, H, C) if nh else (H, N, C)
    typed = buf.view(dtype)
    if layout in CROSS_LAYER:
        per_layer = [typed.view(B, L, *inner)[:, layer] for layer in range(L)]
    else:
        per_layer = list(typed.view(L, B, *inner).unbind(0))
    return {
        f"model.layers.{layer}.self_attn.attn": t.permute(0, 2, 1, 3) if nh else t
        for layer, t in enumerate(per_layer)
    }


class KVFixture:
    """A vLLM-like KV cache: ``L`` layers over one int8 buffer in a given physical layout."""

    def __init__(
        self,
        layout: str,
        dtype: torch.dtype,
        *,
        L: int = 3,
        B: int = 16,
        H: int = 2,
        N: int = 4,
        C: int = 8,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        if layout == "MLA":
            H = 1
        self.layout, self.dtype, self.L, self.B = layout, dtype, L, B
        esize = torch.empty(0, dtype=dtype).element_size()
        self.page = H * N * C * esize
        g = torch.Generator().manual_seed(seed)
        self.buf = torch.randint(-128, 128, (L * B * self.page,), dtype=torch.int8, generator=g)
        self.buf = self.buf.to(device)
        self.caches = vllm_kv_views(self.buf, layout, dtype, L=L, B=B, H=H, N=N, C=C)
        self.tensors = list(self.caches.values())

    def offset(self, layer: int, block: int) -> int:
        """Byte offset of page (layer, block) in the buffer, from the layout alone."""
        if self.layout in CROSS_LAYER:
            return (block * self.L + layer) * self.page
        return (layer * self.B + block) * self.page

    def ref_page(self, layer: int, block: int) -> torch.Tensor:
        o = self.offset(layer, block)
        return self.buf[o : o + self.page].view(torch.uint8).cpu().clone()

    def ref_obj(self, ids: list[int]) -> torch.Tensor:
        return torch.stack(
            [torch.stack([self.ref_page(lay, b) for b in ids]) for lay in range(self.L)]
        )

    def logical(self, layer: int, block: int) -> torch.Tensor:
        """Block ``block`` of layer ``layer`` read through the 4-D tensor, as bytes."""
        return self.tensors[layer][block].contiguous().view(torch.uint8).flatten().cpu()

    def poison(self, ids: list[int]) -> None:
        for layer in range(self.L):
            for b in ids:
                o = self.offset(layer, b)
                self.buf[o : o + self.page].view(torch.uint8).fill_(POISON)


def poisoned(shape: tuple[int, ...], device: str = "cpu", pin: bool = False) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
    return t.fill_(POISON) if device == "cpu" else t.fill_(POISON).to(device)


def assert_obj_matches(obj: torch.Tensor, ref: torch.Tensor) -> None:
    if not torch.equal(obj.cpu(), ref):
        bad = (obj.cpu() != ref).any(dim=2).nonzero().tolist()
        raise AssertionError(f"memory object differs from the reference at [layer, page] {bad[:8]}")


def assert_loaded(
    fx: KVFixture, snapshot: KVFixture, src_ids: list[int], dst_ids: list[int]
) -> None:
    """dst pages hold src's old bytes (physically and logically); every other page unchanged."""
    named = set(dst_ids)
    for layer in range(fx.L):
        for s, d in zip(src_ids, dst_ids, strict=True):
            if not torch.equal(fx.ref_page(layer, d), snapshot.ref_page(layer, s)):
                raise AssertionError(f"layer {layer} block {d}: bytes of block {s} not in place")
            if not torch.equal(fx.logical(layer, d), snapshot.logical(layer, s)):
                raise AssertionError(f"layer {layer} block {d}: logical values differ")
        for b in range(fx.B):
            unchanged = torch.equal(fx.ref_page(layer, b), snapshot.ref_page(layer, b))
            if b not in named and not unchanged:
                raise AssertionError(f"layer {layer} block {b} was not named but changed")


def snapshot_of(fx: KVFixture) -> KVFixture:
    snap = object.__new__(KVFixture)
    snap.__dict__.update(fx.__dict__)
    snap.buf = fx.buf.clone()
    snap.tensors = [
        torch.as_strided(
            snap.buf.view(fx.dtype), t.shape, t.stride(), t.storage_offset()
        )
        for t in fx.tensors
    ]
    return snap


def id_patterns(rng: random.Random, B: int) -> dict[str, tuple[list[int], list[int]]]:
    """(source ids, destination ids) pairs: out of order, repeated sources, runs, singletons."""
    rand_src = [rng.randrange(1, B) for _ in range(6)]  # may repeat
    rand_dst = rng.sample(range(1, B), 6)
    return {
        "random": (rand_src, rand_dst),
        "runs": ([3, 4, 5, 9, 10, 1], [12, 13, 14, 15, 6, 7]),
        "reversed": ([8, 7, 6, 5], [2, 1, 15, 14]),
    }


class TorchCalls(TorchFunctionMode):
    """Counts the calls into torch made inside it (functions, tensor methods and attributes:
    the host's work of a transfer, one count per call however many bytes or tensors it moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def chunk_objects(route: str, L: int, sizes: list[int], page: int, *, device: str = "cpu",
                  pin: bool = False, offset: int = 0) -> list[torch.Tensor]:
    """Poisoned memory objects ``[L, n, page]``, one per size, as a copy plan's routes take them:
    ``"pool"``: from one real ``HostMemoryPool`` (as L1 allocates them: the rows route on CPU,
    the staged one for a CUDA cache; ``pin`` pins it); ``"arena"``: carved from one buffer on
    ``device`` at ``offset`` bytes (rows, whatever the alignment); ``"apart"``: each its own
    tensor, its pages two pages apart (staged, even for one job alone)."""
    if route == "pool":
        pool = HostMemoryPool(sum(L * n * page + 4096 for n in sizes) + 4096, pin_memory=pin,
                              prefault=False)
        objs = [pool.allocate((L, n, page)).tensor for n in sizes]  # type: ignore[union-attr]
        for o in objs:
            o.fill_(POISON)
        return objs
    if route == "arena":
        arena = poisoned((offset + sum(L * n * page for n in sizes),), device=device)
        objs, at = [], offset
        for n in sizes:
            objs.append(arena[at: at + L * n * page].view(L, n, page))
            at += L * n * page
        return objs
    return [poisoned((L, 2 * n, page), device=device, pin=pin)[:, ::2] for n in sizes]
