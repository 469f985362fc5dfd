"""Zero-copy ``(num_blocks, page_bytes)`` byte views over an engine's per-layer KV tensors.

vLLM 0.32 hands the connector one view per layer (``[B, H, N, C]`` in the KV dtype, MLA
``[B, 1, N, C]``) over one shared int8 buffer; the physical order depends on the attention
backend (LBHNC on CPU, LBNHC for FlashAttention, ...). Whatever the order, what kvplug moves is a
*page*: all bytes of one block of one layer. This module checks, once at registration, that every
page is one dense run of bytes and builds a byte view whose row ``b`` is block ``b``'s page, so
transfers never look at heads, tokens or dtypes again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from kvplug.errors import KVPlugError

__all__ = ["KVLayoutError", "PagedKV", "page_view", "word_size", "words"]

#: The integer dtype of each word size index kernels may move pages in.
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class KVLayoutError(KVPlugError, ValueError):
    """A KV tensor cannot be treated as pages (a block is not one dense run of bytes, ...)."""


def _describe(name: str, t: torch.Tensor) -> str:
    return (
        f"layer {name!r} (shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
        f"dtype {t.dtype}, storage offset {t.storage_offset()})"
    )


def _page_elems(name: str, t: torch.Tensor) -> int:
    """Elements of one block's page, after checking they form one dense run."""
    dims = sorted(
        ((t.stride(d), t.size(d)) for d in range(1, t.dim()) if t.size(d) != 1),
        key=lambda sd: sd[0],
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise KVLayoutError(
                f"{_describe(name, t)}: one block is not one dense run of bytes (a dimension "
                f"of size {size} has stride {stride}, a dense page needs {expected}); kvplug "
                "moves whole blocks as byte pages and cannot use this layout"
            )
        expected *= size
    return expected


def page_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """``(num_blocks, page_bytes)`` uint8 view of ``t`` sharing its storage (no copy).

    Dimension 0 of ``t`` must be the block dimension; the remaining dimensions of one block must
    cover one dense run of memory in some order. Raises ``KVLayoutError`` naming the layer.
    """
    if t.dim() < 2:
        raise KVLayoutError(f"{_describe(name, t)}: expected [blocks, ...], at least 2-D")
    if t.numel() == 0:
        raise KVLayoutError(f"{_describe(name, t)}: empty KV tensor")
    esize = t.element_size()
    elems = _page_elems(name, t)
    if elems != math.prod(t.shape[1:]):  # pragma: no cover - guaranteed by _page_elems
        raise KVLayoutError(f"{_describe(name, t)}: inconsistent page size")
    num_blocks = t.size(0)
    block_stride = t.stride(0) if num_blocks > 1 else elems
    if block_stride < elems:
        raise KVLayoutError(
            f"{_describe(name, t)}: block stride {block_stride} is smaller than one page of "
            f"{elems} elements, so blocks overlap (is dimension 0 really the block dimension?)"
        )
    page_bytes = elems * esize
    start = t.storage_offset() * esize
    end = start + (num_blocks - 1) * block_stride * esize + page_bytes
    storage = t.untyped_storage()
    if end > storage.nbytes():
        raise KVLayoutError(
            f"{_describe(name, t)}: pages reach byte {end}, the storage has {storage.nbytes()}"
        )
    view = torch.empty(0, dtype=torch.uint8, device=t.device)
    view.set_(storage, start, (num_blocks, page_bytes), (block_stride * esize, 1))
    return view


def word_size(*values: int) -> int:
    """The largest word (8, 4, 2 or 1 bytes) dividing every value (byte sizes, strides, addresses).

    Index kernels move one element per thread: in bytes they ran ~20% slower than one memcpy of
    the same size on an H100, and a CPU ``index_copy_`` of 256-byte pages ~6x slower than in
    8-byte words."""
    word = 8
    for v in values:
        while v % word:
            word //= 2
    return word


def words(t: torch.Tensor, word: int) -> torch.Tensor:
    """``t`` (uint8 ``[rows, page_bytes]``, rows of ``word``-aligned bytes) as ``word``-byte
    integers, sharing its storage: the same rows, ``page_bytes / word`` elements each."""
    return t if word == 1 else t.view(WORD_DTYPES[word])


def _stack(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``(layers, blocks, page_bytes)`` view when the layers are evenly spaced in one storage.

    vLLM lays layers out this way (one buffer, layer major), so a run of blocks of *all* layers
    moves with one strided ``copy_``; None when the layers are not evenly spaced.
    """
    first = views[0]
    storage = first.untyped_storage()
    starts = [v.storage_offset() for v in views]
    step = starts[1] - starts[0] if len(views) > 1 else first.size(0) * first.stride(0)
    if step <= 0:
        return None
    for i, v in enumerate(views):
        if (
            v.untyped_storage().data_ptr() != storage.data_ptr()
            or v.stride(0) != first.stride(0)
            or starts[i] != starts[0] + i * step
        ):
            return None
    stacked = torch.empty(0, dtype=torch.uint8, device=first.device)
    shape = (len(views), first.size(0), first.size(1))
    return stacked.set_(storage, starts[0], shape, (step, first.stride(0), 1))


class PagedKV:
    """The engine's KV cache seen as ``num_layers`` arrays of ``num_blocks`` byte pages.

    Built once at registration with :meth:`from_kv_caches`. ``views[i]`` is the distinct layer
    ``i``'s ``(num_blocks, page_bytes)`` uint8 view; layer names that alias one tensor (vLLM's
    KV sharing) map to one distinct layer, so its pages are moved once. ``stacked`` is the
    ``(num_layers, num_blocks, page_bytes)`` view over all of them when they are evenly spaced in
    one buffer (as vLLM allocates them), else None.
    """

    def __init__(
        self,
        layer_names: list[str],
        views: list[torch.Tensor],
        aliases: dict[str, int],
        kv_dtype: torch.dtype,
        layer_shape: tuple[int, ...],
    ) -> None:
        if not views:
            raise KVLayoutError("no KV layers given")
        self.layer_names = layer_names
        self.views = views
        self._index = aliases
        self.kv_dtype = kv_dtype
        self.layer_shape = layer_shape
        self.num_layers = len(views)
        self.num_blocks = views[0].size(0)
        self.page_bytes = views[0].size(1)
        self.device = views[0].device
        self.stacked = _stack(views)
        #: the largest word every layer's pages can be moved in (see :func:`word_size`)
        self.word = word_size(*(x for v in views
                                for x in (v.size(1), v.stride(0), v.storage_offset(), v.data_ptr())))
        self._words: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._streams: dict[str, object] = {}

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor],
                       num_blocks: int | None = None) -> PagedKV:
        """Page views for vLLM's ``register_kv_caches`` argument (layer name -> KV tensor).

        All distinct layers must share device, dtype, block count and page size. Aliases (two
        names, one tensor: same storage, offset and geometry) are kept once, in first-seen order.
        ``num_blocks``: the engine's block count (vLLM's ``KVCacheConfig``); a tensor whose
        dimension 0 is not it (a layout with K/V first, ``[2, num_blocks, ...]``) is refused.
        """
        if num_blocks:
            for name, t in kv_caches.items():
                if t.dim() and t.size(0) != num_blocks:
                    raise KVLayoutError(
                        f"{_describe(name, t)}: dimension 0 has {t.size(0)} entries but the "
                        f"engine has {num_blocks} KV blocks; kvplug needs the block dimension "
                        "first ([num_blocks, ...] per layer, as vLLM 0.32+ lays it out). A "
                        "tensor with K and V first ([2, num_blocks, ...]) is an older vLLM "
                        "layout: use vLLM >= 0.32"
                    )
        names: list[str] = []
        views: list[torch.Tensor] = []
        aliases: dict[str, int] = {}
        seen: dict[tuple[object, ...], int] = {}
        first: tuple[str, torch.Tensor] | None = None
        for name, t in kv_caches.items():
            view = page_view(name, t)
            if first is None:
                first = (name, t)
            else:
                fname, ft = first
                mismatch = [
                    what
                    for what, a, b in (
                        ("device", t.device, ft.device),
                        ("dtype", t.dtype, ft.dtype),
                        ("block count", t.size(0), ft.size(0)),
                        ("page bytes", view.size(1), views[0].size(1)),
                    )
                    if a != b
                ]
                if mismatch:
                    raise KVLayoutError(
                        f"{_describe(name, t)} differs from {_describe(fname, ft)} in "
                        f"{', '.join(mismatch)}; all layers must share them"
                    )
            key = (view.device, view.data_ptr(), view.stride(0), view.size(0), view.size(1))
            start = (view.device, view.data_ptr())
            if key in seen:
                aliases[name] = seen[key]
                continue
            clash = [k for k in seen if k[:2] == start]
            if clash:
                raise KVLayoutError(
                    f"{_describe(name, t)} starts at the same address as layer "
                    f"{names[seen[clash[0]]]!r} with a different geometry"
                )
            seen[key] = len(views)
            aliases[name] = len(views)
            names.append(name)
            views.append(view)
        if first is None:
            raise KVLayoutError("no KV layers given")
        return cls(names, views, aliases, first[1].dtype, tuple(first[1].shape))

    def index_of(self, layer_name: str) -> int:
        """Distinct layer index of any registered name (aliases included); KeyError otherwise."""
        try:
            return self._index[layer_name]
        except KeyError:
            raise KeyError(f"unknown KV layer {layer_name!r}") from None

    def word_views(self, word: int) -> list[torch.Tensor]:
        """``views`` as ``word``-byte integers (a divisor of :attr:`word`), built once per
        inference mode: a view made in inference mode is an inference tensor, which only
        inference mode may write (vLLM's thread runs in it; tests and other threads may not)."""
        key = (word, torch.is_inference_mode_enabled())
        got = self._words.get(key)
        if got is None:
            got = self._words[key] = [words(v, word) for v in self.views]
        return got

    def stream(self, role: str) -> torch.cuda.Stream:
        """The dedicated CUDA stream for ``role`` ("store", "load", and their host-copy streams
        "store-copy" and "load-copy"), created on first use."""
        s = self._streams.get(role)
        if s is None:
            s = torch.cuda.Stream(device=self.device)
            self._streams[role] = s
        return s  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (
            f"PagedKV(layers={self.num_layers}, blocks={self.num_blocks}, "
            f"page_bytes={self.page_bytes}, dtype={self.kv_dtype}, device={self.device})"
        )
