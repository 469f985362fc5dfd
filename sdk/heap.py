"""Heap memory for a StorageManager whose tiers own no pool: buffers kept for the next object.

Without an L1 pool (a tier alone, e.g. posix as the only tier, or ``kvplug bench``), every read
and every store's copy needs memory from the heap. A fresh buffer is paid for page by page on
first touch: 64 page faults for 256 KiB, ~190 µs on this project's VM, more than reading the same
chunk from the page cache (~20 µs). So a freed object's buffer is kept, by size, for the next
object of the same size, the way the pool keeps its memory: up to :data:`KEEP_BYTES` in all,
buffers of the least recently wanted size dropped first when another size needs room.

Objects behave as pool objects do: the buffer is reused once the last reference is dropped
(:meth:`~kvplug.memory.MemoryObj.ref_down`), so nothing may use an object's tensor after that —
the rule every pool-backed object already follows. Buffers are 4 KiB-aligned (O_DIRECT reads can
land in them). Each buffer keeps a flat byte ``memoryview`` of itself, made once with it and
handed to every object it backs (:attr:`~kvplug.memory.MemoryObj.flat_bytes`): a file read lands
there without a numpy array and a view made per read.
"""

from __future__ import annotations

import threading

import torch

from .memory import MemoryFormat, MemoryObj, MemoryObjMeta

#: Bytes of freed buffers kept for reuse at most (a batch of 96 values of 1 MiB is 96 MiB).
KEEP_BYTES = 256 << 20
ALIGN = 4096
_METAS = 64  # metas of distinct shapes kept for reuse


class HeapBuffers:
    """Heap memory objects whose buffers are reused after their last reference (thread-safe)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        #: buffer bytes -> ``(flat uint8 buffer, memoryview of its bytes)`` kept for reuse
        self._free: dict[int, list[tuple[torch.Tensor, memoryview]]] = {}
        self._wanted: dict[int, int] = {}  # buffer bytes -> tick of the last request
        self._tick = 0
        self.kept = 0  # bytes in ``_free``
        self.counts = {"heap_reused": 0, "heap_fresh": 0}
        self._metas: dict[tuple, MemoryObjMeta] = {}

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8,
                 fmt: MemoryFormat = MemoryFormat.KV_PAGES, num_tokens: int = 0) -> MemoryObj:
        """An object of ``shape``/``dtype``: a kept buffer of its size, else a fresh one."""
        meta = self._meta(shape, dtype, fmt, num_tokens)
        nbytes = meta.nbytes
        with self._lock:
            self._tick += 1
            self._wanted[nbytes] = self._tick
            stack = self._free.get(nbytes)
            kept = stack.pop() if stack else None
            if kept is not None:
                self.kept -= nbytes
                self.counts["heap_reused"] += 1
            else:
                self.counts["heap_fresh"] += 1
                self._make_room(nbytes)
        if kept is None:
            # a normal tensor even when asked for inside inference mode (vLLM's step): a buffer
            # made there would be an inference tensor, which a later reuse outside inference
            # mode (a background load's thread) could not write into; its memoryview is made
            # here too, once, from that normal tensor
            with torch.inference_mode(False):
                raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
                skew = (-raw.data_ptr()) % ALIGN
                buf = raw[skew : skew + nbytes]
                kept = (buf, memoryview(buf.numpy()))
        buf, flat = kept
        if not nbytes:
            return MemoryObj(torch.empty(meta.shape, dtype=dtype), meta)
        view = (buf if dtype == torch.uint8 else buf.view(dtype)).view(meta.shape)
        return MemoryObj(view, meta, release=lambda _obj, k=kept: self._give_back(k),
                         flat_bytes=flat)

    def _meta(self, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat,
              num_tokens: int) -> MemoryObjMeta:
        """The (immutable) meta of an object of this shape: one made before for the same
        arguments (every chunk of an engine has one shape; a frozen dataclass costs ~1 µs to
        make), else a new one; at most ``_METAS`` kept."""
        key = (tuple(shape), dtype, fmt, num_tokens)
        meta = self._metas.get(key)
        if meta is None:
            meta = MemoryObjMeta(tuple([int(d) for d in shape]), dtype, fmt, num_tokens)
            if len(self._metas) >= _METAS:
                self._metas.clear()
            self._metas[key] = meta
        return meta

    def _make_room(self, nbytes: int) -> None:
        """Under the lock: drop kept buffers of the least recently wanted other sizes until
        ``nbytes`` more could be kept."""
        while self.kept + nbytes > self.keep_bytes:
            sizes = [n for n, stack in self._free.items() if stack and n != nbytes]
            if not sizes:
                return
            oldest = min(sizes, key=self._wanted.__getitem__)
            self._free[oldest].pop()
            self.kept -= oldest

    def _give_back(self, kept: tuple[torch.Tensor, memoryview]) -> None:
        nbytes = kept[0].numel()
        if not nbytes:
            return
        with self._lock:
            if self.kept + nbytes <= self.keep_bytes:
                self._free.setdefault(nbytes, []).append(kept)
                self.kept += nbytes

    def clear(self) -> None:
        """Drop every kept buffer (the memory goes back to the allocator)."""
        with self._lock:
            self._free.clear()
            self.kept = 0

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**{k: float(v) for k, v in self.counts.items()},
                    "heap_kept_bytes": float(self.kept)}
