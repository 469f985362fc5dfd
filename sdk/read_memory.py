"""What a read may allocate: sizes read from a store never choose how much memory kvplug takes.

A shared store is written by others, and every size in a stored chunk (its header's shape, a
codec frame's geometry, a value's length) is the writer's to choose. Every tier reads into memory
from ``ctx.allocate`` (:meth:`ReadMemory.allocate`), and every rule about how much a read may
take lives here, checked **before** any byte is allocated:

* **Geometry.** When the engine's chunk geometry is known (:class:`ChunkGeometry`, which the
  connector gives the StorageManager), a ``KV_PAGES`` read is ``[n <= layers, b <= pages,
  page_bytes]`` uint8 with at most a chunk's tokens, an ``ENCODED`` one ``[n <= layers, 1,
  f <= one frame's bound]``; any other shape, dtype or format is refused.
* **One object.** Without geometry (the SDK used on its own), one read is at most the largest
  pool (a chunk larger than L1 was never stored through it), or ``max_heap_fallback`` where no
  tier owns a pool.
* **Heap fallback.** When the pool has no room (a hit larger than L1 is held whole), a read goes
  to the heap, up to ``max_heap_fallback`` bytes held by such reads at once; past it, a miss.

A refused read is ``None`` (a miss: vLLM recomputes), counted (``reads_refused_geometry``,
``reads_refused_heap``) and logged once. :meth:`ReadMemory.read_limit` is the same bound for a
tier that must receive a whole stored value before it can parse it (``ctx.read_limit``), and
:meth:`ReadMemory.header_limit` the bound of a chunk's header, applied before any of it past the
first bytes is read or parsed (``ctx.header_limit``: a header of a chunk of the engine's layers,
its names and a codec's description, with a small margin).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .chunkfile.format import ALIGN, MAX_HEADER, align_up, max_header_bytes
from .codecs.frame import MAX_DESCRIPTION
from .logs import LogOnce
from .memory import MemoryFormat, MemoryObj, MemoryObjMeta

logger = logging.getLogger("kvplug.storage")

#: Default of ``max_heap_fallback``: heap bytes reads may hold when no pool has room.
DEFAULT_MAX_HEAP_FALLBACK = 1 << 30


@dataclass(frozen=True)
class ChunkGeometry:
    """The chunk objects of one engine: ``[num_layers, pages, page_bytes]`` uint8 at most.

    Attributes:
        num_layers: layers of a chunk object (the engine's KV layers on this rank).
        pages: pages (engine blocks) of a full chunk (``ceil(chunk_size / block_size)``).
        page_bytes: bytes of one page.
        tokens: tokens of a full chunk (``None``: not checked).
    """

    num_layers: int
    pages: int
    page_bytes: int
    tokens: int | None = None

    def __post_init__(self) -> None:
        if min(self.num_layers, self.pages, self.page_bytes) < 1:
            raise ValueError(f"chunk geometry {self} needs positive sizes")

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def frame_bytes(self) -> int:
        """Bound of one encoded layer (:mod:`kvplug.codecs.frame`): the raw layer, an eighth
        more for a codec that cannot compress it, the largest description, and its head."""
        return self.layer_bytes + self.layer_bytes // 8 + MAX_DESCRIPTION + ALIGN

    @property
    def header_bytes(self) -> int:
        """Bound of one stored chunk's header (:func:`~.chunkfile.format.max_header_bytes`)."""
        return max_header_bytes(self.num_layers)

    @property
    def stored_bytes(self) -> int:
        """Bound of one stored chunk (a file or a value: header, aligned layers or frames)."""
        return self.header_bytes + self.num_layers * align_up(max(self.layer_bytes, self.frame_bytes))

    def refuses(self, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat,
                num_tokens: int) -> str | None:
        """Why a read of this meta does not fit this engine's chunks (``None``: it fits)."""
        if dtype != torch.uint8 or len(shape) != 3 or any(
                not isinstance(d, int) or d < 1 for d in shape):
            return f"{dtype} {list(shape)} is not a [layers, pages, bytes] uint8 chunk"
        layers, mid, last = shape
        if layers > self.num_layers:
            return f"{layers} layers, this engine's chunks have {self.num_layers}"
        if self.tokens is not None and not 0 <= num_tokens <= self.tokens:
            return f"{num_tokens} tokens, a chunk holds at most {self.tokens}"
        if fmt is MemoryFormat.KV_PAGES:
            if mid > self.pages or last != self.page_bytes:
                return (f"{mid} pages of {last} bytes, this engine's chunks have up to "
                        f"{self.pages} pages of {self.page_bytes} bytes")
            return None
        if fmt is MemoryFormat.ENCODED:
            if mid != 1 or last > self.frame_bytes:
                return f"encoded layers of {mid} x {last} bytes exceed one frame's bound"
            return None
        return f"format {fmt.value!r} is not a chunk of this engine"


class ReadMemory:
    """``ctx.allocate`` of every tier: the rules above around the manager's own ``allocate``.

    ``allocate(shape, dtype, fmt, num_tokens)`` is the pool's (``None`` when full, or a heap
    object when no tier owns a pool); ``pools()`` the bytes of each pool. Thread-safe."""

    def __init__(self, allocate: Callable[..., MemoryObj | None],
                 pools: Callable[[], list[int]], max_heap_fallback: int,
                 geometry: ChunkGeometry | None = None) -> None:
        self._allocate = allocate
        self._pools = pools
        self._pool_bytes: int | None = None  # learned on first use (the tiers are built then)
        self.max_heap_fallback = max_heap_fallback
        self.geometry = geometry
        self._lock = threading.Lock()
        self._log_once = LogOnce(logger)
        self.heap_bytes = 0  # held now by heap-fallback reads
        self.counts = dict.fromkeys(("read_heap_fallbacks", "reads_refused_geometry",
                                     "reads_refused_heap"), 0)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    @property
    def pool_bytes(self) -> int:
        """Bytes of the largest pool (0: no tier owns one)."""
        if self._pool_bytes is None:
            self._pool_bytes = max(self._pools(), default=0)
        return self._pool_bytes

    def object_limit(self) -> int:
        """The most bytes one read may allocate."""
        g = self.geometry
        if g is not None:
            return g.num_layers * max(g.layer_bytes, g.frame_bytes)
        return self.pool_bytes or self.max_heap_fallback

    def read_limit(self) -> int:
        """The most bytes a tier may receive of one stored chunk before parsing it (a value read
        whole): one stored chunk of this engine, or, without geometry, twice the object bound
        and the largest header (layer padding)."""
        if self.geometry is not None:
            return self.geometry.stored_bytes
        return 2 * self.object_limit() + MAX_HEADER

    def header_limit(self) -> int:
        """The most bytes of a stored chunk's header a tier may read and parse: that of a chunk
        of this engine's layers, or, without geometry, ``MAX_HEADER``."""
        if self.geometry is not None:
            return self.geometry.header_bytes
        return MAX_HEADER

    def refuses(self, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat,
                num_tokens: int) -> str | None:
        """Why a read of this meta is refused before allocating (``None``: allowed)."""
        if self.geometry is not None:
            return self.geometry.refuses(tuple(shape), dtype, fmt, num_tokens)
        try:
            dims = [int(d) for d in shape]
            nbytes = math.prod(dims) * dtype.itemsize
        except (TypeError, ValueError):
            return f"shape {shape!r} is not a list of sizes"
        if (dims and min(dims) < 0) or nbytes > self.object_limit():
            return f"{nbytes} bytes exceed the {self.object_limit()} one read may take"
        return None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8,
                 fmt: MemoryFormat = MemoryFormat.KV_PAGES,
                 num_tokens: int = 0) -> MemoryObj | None:
        """Memory for a chunk a tier reads: checked, then the pool, else the heap within
        ``max_heap_fallback``; ``None`` (a miss) when refused."""
        why = self.refuses(shape, dtype, fmt, num_tokens)
        if why is not None:
            self._count("reads_refused_geometry")
            self._log_once("geometry", "a stored chunk's sizes do not fit this engine (%s); "
                           "treated as a miss before allocating (further ones are counted in "
                           "reads_refused_geometry)", why)
            return None
        obj = self._allocate(tuple(shape), dtype, fmt, num_tokens)
        if obj is not None or not self.pool_bytes:
            return obj
        return self._heap(tuple(shape), dtype, fmt, num_tokens)

    def _heap(self, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat,
              num_tokens: int) -> MemoryObj | None:
        """A heap object when the pool is full: a load holds a request's whole hit until it
        scatters it, so a hit larger than L1 must not fail for want of L1 room — within
        ``max_heap_fallback`` bytes held at once (the buffer goes with its last reference)."""
        meta = MemoryObjMeta(shape, dtype, fmt, num_tokens)
        with self._lock:
            if self.heap_bytes + meta.nbytes > self.max_heap_fallback:
                self.counts["reads_refused_heap"] += 1
                refused = True
            else:
                self.heap_bytes += meta.nbytes
                self.counts["read_heap_fallbacks"] += 1
                refused = False
        if refused:
            self._log_once("heap-cap", "L1 has no room for a read and reads already hold %d "
                           "bytes of heap (max_heap_fallback); treated as a miss (further ones "
                           "are counted in reads_refused_heap)", self.heap_bytes)
            return None
        self._log_once("read-heap", "L1 has no room for a read (full of chunks in use); reading "
                       "into heap memory instead, up to max_heap_fallback=%d bytes (counted in "
                       "read_heap_fallbacks)", self.max_heap_fallback)
        try:
            tensor = torch.empty(shape, dtype=dtype)
        except BaseException:
            self._freed_bytes(meta.nbytes)
            raise
        return MemoryObj(tensor, meta, release=lambda _o, n=meta.nbytes: self._freed_bytes(n))

    def _freed_bytes(self, nbytes: int) -> None:
        with self._lock:
            self.heap_bytes -= nbytes

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**{k: float(v) for k, v in self.counts.items()},
                    "read_heap_bytes": float(self.heap_bytes)}
