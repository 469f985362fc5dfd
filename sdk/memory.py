"""Memory objects: a tensor plus what it holds, with a reference count.

Ownership rule used everywhere in kvplug: whoever receives a ``MemoryObj`` from ``allocate`` or
``get`` owns exactly one reference and must call :meth:`MemoryObj.ref_down` when done. Anyone that
keeps an object beyond a call (a tier caching it, a writer queueing it) calls :meth:`ref_up` first.
The backing memory returns to its allocator when the last reference is gone; any later access
raises :class:`~kvplug.errors.MemoryObjFreedError` instead of reading freed bytes.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import MemoryObjFreedError


class MemoryFormat(str, enum.Enum):
    """What the tensor of a memory object means."""

    #: ``[layers, blocks, page_bytes]`` uint8: one engine page per (layer, block), layer major, so
    #: one layer of one chunk is one contiguous slice.
    KV_PAGES = "kv_pages"
    #: Opaque bytes, 1-D uint8.
    BINARY = "binary"
    #: ``[layers, 1, frame_bytes]`` uint8: one codec frame per layer of a ``KV_PAGES`` chunk
    #: (:mod:`kvplug.codecs`), zero padded to the longest; what a tier configured with a codec
    #: stores. Only the codec wrapper decodes it; it never reaches KV blocks.
    ENCODED = "encoded"


@dataclass(frozen=True, slots=True)
class MemoryObjMeta:
    """Shape, dtype, format and how many tokens of the sequence the bytes cover; for an
    ``ENCODED`` object written by the codec wrapper, ``codec`` describes the codec (canonical
    JSON: name, package, version, params) so a chunk file's header records it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    num_tokens: int
    codec: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class MemoryObj:
    """A view of allocator memory with a reference count (thread-safe). Tiers protect entries
    from eviction with their own pin counts (:class:`kvplug.pins.PinCounts`), not here."""

    __slots__ = ("_tensor", "meta", "_refs", "_release", "_lock", "address", "flat_bytes")

    def __init__(
        self,
        tensor: torch.Tensor,
        meta: MemoryObjMeta,
        release: Callable[[MemoryObj], None] | None = None,
        address: int = -1,
        flat_bytes: memoryview | None = None,
    ) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.meta = meta
        self._refs = 1
        self._release = release
        self._lock = threading.Lock()
        #: Offset in the allocator's buffer (-1 for heap objects); for diagnostics and tests.
        self.address = address
        #: The object's bytes as a flat, writable ``memoryview`` where its allocator keeps one
        #: with the buffer (:mod:`kvplug.heap`: file reads land in it without a view made per
        #: read), else ``None``; ``None`` once the last reference is dropped.
        self.flat_bytes = flat_bytes

    # -- data ---------------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        t = self._tensor
        if t is None:
            raise MemoryObjFreedError(
                f"memory object {self!r} was used after its last reference was dropped"
            )
        return t

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    @property
    def byte_view(self) -> torch.Tensor:
        """The same memory as a flat uint8 tensor (no copy)."""
        return self.tensor.view(-1).view(torch.uint8)

    @property
    def is_freed(self) -> bool:
        return self._tensor is None

    # -- counts -------------------------------------------------------------------------------
    @property
    def ref_count(self) -> int:
        return self._refs

    def ref_up(self) -> MemoryObj:
        with self._lock:
            if self._tensor is None:
                raise MemoryObjFreedError(f"ref_up on freed memory object {self!r}")
            self._refs += 1
        return self

    def ref_down(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise MemoryObjFreedError(f"ref_down on memory object {self!r} with no reference")
            self._refs -= 1
            free = self._refs == 0
        if free:
            self._free()

    def _free(self) -> None:
        self._tensor = None
        self.flat_bytes = None
        if self._release is not None:
            self._release(self)

    def __repr__(self) -> str:
        state = "freed" if self._tensor is None else f"refs={self._refs}"
        return (
            f"MemoryObj(shape={self.meta.shape}, fmt={self.meta.fmt.value}, "
            f"tokens={self.meta.num_tokens}, {state})"
        )


def heap_memory_obj(
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.uint8,
    fmt: MemoryFormat = MemoryFormat.KV_PAGES,
    num_tokens: int = 0,
    device: str | torch.device = "cpu",
) -> MemoryObj:
    """A memory object on the ordinary heap (when no tier owns a pool, and for tests)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    return MemoryObj(tensor, MemoryObjMeta(tuple(shape), dtype, fmt, num_tokens))
