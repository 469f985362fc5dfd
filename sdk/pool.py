"""A host memory pool: one preallocated buffer, first-fit allocation, coalescing free.

The buffer is allocated once (pinned when CUDA is present so device copies can be asynchronous,
plain on CPU) and never grows. Allocations are aligned to 4 KiB so O_DIRECT and GPUDirect reads
can land in them. ``allocate`` returns ``None`` when no free extent is large enough; callers
evict and retry or skip — it never blocks.
"""

from __future__ import annotations

import bisect
import os
import threading
from dataclasses import dataclass

import torch

from .errors import ConfigError
from .memory import MemoryFormat, MemoryObj, MemoryObjMeta

ALIGN = 4096


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class PoolStats:
    capacity: int
    used: int
    free: int
    largest_free: int
    num_allocations: int

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free / free``: 0 when all free space is one extent."""
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free


#: Linux ``madvise`` advice that backs pages as if written, leaving their contents alone (5.14+).
MADV_POPULATE_WRITE = 23
_PREFAULT_STEP = 4 << 20  # short steps: mmap_lock is held for one step at a time


def populate_pages(buf: torch.Tensor, done: threading.Event | None = None) -> bool:
    """Back every page of ``buf`` now (``MADV_POPULATE_WRITE``, in 4 MiB steps, GIL released, at the
    lowest CPU priority).

    An untouched buffer costs one page fault per 4 KiB on first write: measured 4,416 faults and
    38-80 ms for one 3001-token store on the benchmark VM, paid inside vLLM's step. Run once per
    pool on a background thread, so startup does not wait; the advice never changes contents, so
    allocations made meanwhile are safe. False where the kernel lacks the advice (then pages are
    faulted in on first use, as before)."""
    import ctypes

    try:  # the engine's threads first: this one only gets what they leave (Linux: per thread)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start, size = buf.data_ptr(), buf.numel() * buf.element_size()
        for off in range(0, size, _PREFAULT_STEP):
            if libc.madvise(start + off, min(_PREFAULT_STEP, size - off), MADV_POPULATE_WRITE):
                return False
        return True
    except (OSError, AttributeError):
        return False
    finally:
        if done is not None:
            done.set()


class HostMemoryPool:
    """First-fit allocator over one host buffer; thread-safe."""

    def __init__(self, capacity: int, *, pin_memory: bool | None = None,
                 prefault: bool = True) -> None:
        if capacity < ALIGN:
            raise ConfigError(f"pool capacity={capacity} bytes is below the minimum of {ALIGN}")
        capacity = capacity // ALIGN * ALIGN
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        # Over-allocate one page so the usable region starts 4 KiB-aligned in virtual memory.
        raw = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
        skew = (-raw.data_ptr()) % ALIGN
        self._buffer = raw[skew : skew + capacity]
        #: Set once every page of the buffer is backed (see :func:`populate_pages`).
        self.populated = threading.Event()
        if pin_memory or not prefault:  # pinned memory is backed and locked when allocated
            self.populated.set()
        else:
            threading.Thread(target=populate_pages, args=(self._buffer, self.populated),
                             name="kvplug-pool-prefault", daemon=True).start()
        self.capacity = capacity
        self.pinned = pin_memory
        self._lock = threading.Lock()
        self._free_starts: list[int] = [0]  # sorted starts of free extents
        self._free_sizes: dict[int, int] = {0: capacity}
        self._live: dict[int, int] = {}  # start -> size of live allocations
        self._used = 0

    def allocate(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.uint8,
        fmt: MemoryFormat = MemoryFormat.KV_PAGES,
        num_tokens: int = 0,
    ) -> MemoryObj | None:
        """A memory object of ``shape``/``dtype`` from the pool, or ``None`` if it does not fit."""
        meta = MemoryObjMeta(tuple(int(d) for d in shape), dtype, fmt, num_tokens)
        size = _align(max(meta.nbytes, 1))
        with self._lock:
            start = next(
                (s for s in self._free_starts if self._free_sizes[s] >= size), None
            )
            if start is None:
                return None
            extent = self._free_sizes.pop(start)
            idx = bisect.bisect_left(self._free_starts, start)
            del self._free_starts[idx]
            if extent > size:
                rest = start + size
                self._free_sizes[rest] = extent - size
                self._free_starts.insert(idx, rest)
            self._live[start] = size
            self._used += size
        view = self._buffer[start : start + meta.nbytes].view(dtype).view(meta.shape)
        return MemoryObj(view, meta, release=self._release, address=start)

    def _release(self, obj: MemoryObj) -> None:
        start = obj.address
        with self._lock:
            size = self._live.pop(start, None)
            if size is None:
                raise RuntimeError(f"double free of pool extent at {start}")
            self._used -= size
            idx = bisect.bisect_left(self._free_starts, start)
            # coalesce with the next extent
            if idx < len(self._free_starts) and self._free_starts[idx] == start + size:
                nxt = self._free_starts.pop(idx)
                size += self._free_sizes.pop(nxt)
            # coalesce with the previous extent
            if idx > 0:
                prev = self._free_starts[idx - 1]
                if prev + self._free_sizes[prev] == start:
                    self._free_sizes[prev] += size
                    return
            self._free_starts.insert(idx, start)
            self._free_sizes[start] = size

    def stats(self) -> PoolStats:
        with self._lock:
            free = self.capacity - self._used
            largest = max(self._free_sizes.values(), default=0)
            return PoolStats(self.capacity, self._used, free, largest, len(self._live))

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool (for registering it once with a DMA engine, e.g. cuFile)."""
        return self._buffer
