"""A host memory pool: one preallocated buffer, first-fit allocation, coalescing free.

The buffer is allocated once (pinned when CUDA is present so device copies can be asynchronous,
plain on CPU) and never grows. Allocations are aligned to 4 KiB so O_DIRECT and GPUDirect reads
can land in them. ``allocate`` returns ``None`` when no free extent is large enough; callers
evict and retry or skip — it never blocks.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from .errors import ConfigError
from .memory import MemoryFormat, MemoryObj, MemoryObjMeta
from .runtime import THREADS, Runtime

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
#: How far the backed part of the pool runs ahead of the highest allocation (see ``_Frontier``).
PREFAULT_AHEAD = 256 << 20


def _madvise():  # noqa: ANN202 - a ctypes function
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def populate_pages(buf: torch.Tensor, start: int = 0, end: int | None = None) -> bool:
    """Back the pages of ``buf[start:end]`` now (``MADV_POPULATE_WRITE`` in 4 MiB steps, GIL
    released), leaving their contents alone. False where the kernel lacks the advice (pages are
    then faulted in on first use)."""
    try:
        madvise = _madvise()
        base, size = buf.data_ptr(), buf.numel() * buf.element_size()
        end = size if end is None else min(end, size)
        for off in range(start, end, _PREFAULT_STEP):
            if madvise(base + off, min(_PREFAULT_STEP, end - off), MADV_POPULATE_WRITE):
                return False
        return True
    except (OSError, AttributeError):
        return False


class _Frontier:
    """Backs the pool from its start, only as far as ``PREFAULT_AHEAD`` past the highest
    allocation, on one background thread (the runtime's ticker: a simulation orders it).

    An untouched page costs a page fault on first write: 4,416 faults and 38-80 ms for one
    3001-token store, paid inside vLLM's step (benchmarks/RESULTS.md). Backing the whole pool at
    startup instead (up to 1.7 s per GiB of one core here) ran during the engine's first requests
    and slowed them 2-4x: the advice holds the process's mmap lock for each step, so the forward
    pass's allocations (``munmap``) and page faults queued behind it (RESULTS.md, "Disk hits
    right after start"). First-fit allocation fills the pool from its start, so backing a margin
    ahead of the highest allocation keeps every allocation on backed pages while startup backs
    only the margin, and later work grows with what is stored. ``done`` is set once the whole
    pool is backed (or the kernel lacks the advice); the ticker then stops."""

    def __init__(self, buf: torch.Tensor, done: threading.Event, runtime: Runtime = THREADS
                 ) -> None:
        self._buf = buf
        self._size = buf.numel()
        self.done = done
        self._lock = threading.Lock()
        self._want = min(self._size, PREFAULT_AHEAD)  # back up to here
        self.backed = 0  # backed up to here
        self._closed = False
        self._ticker = runtime.ticker(self._advance, 3600.0, "kvplug-pool-prefault")
        self._ticker.wake()

    def reach(self, end: int) -> None:
        """An allocation ends at ``end``: once fewer than ``PREFAULT_AHEAD / 2`` backed bytes
        lie beyond it, back up to ``PREFAULT_AHEAD`` beyond it. Extending in half-margin steps,
        not on every allocation that reaches further, keeps the backing work off an engine's
        first requests (a few MiB of faults each, on a core their copies need) and wakes the
        ticker once per ``PREFAULT_AHEAD / 2`` stored."""
        if end + PREFAULT_AHEAD // 2 <= self._want or self._want >= self._size:
            return
        with self._lock:
            self._want = max(self._want, min(self._size, end + PREFAULT_AHEAD))
        self._ticker.wake()

    def _advance(self) -> None:
        """Back the pool up to what allocations want (one call of the ticker)."""
        while not self.done.is_set() and not self._closed:
            with self._lock:
                want = self._want
            if want <= self.backed:
                return
            if not populate_pages(self._buf, self.backed, want):
                self._stop()
                return
            self.backed = want
            if self.backed >= self._size:
                self._stop()

    def _stop(self) -> None:
        self.done.set()
        self._ticker.close(timeout=0)

    def close(self, timeout: float) -> None:
        """Stop backing (the pool's owner closed): the thread ends after the step in progress
        (waited for up to ``timeout``), and with it its reference to the buffer."""
        self._closed = True
        self._ticker.close(timeout=timeout)


class HostMemoryPool:
    """First-fit allocator over one host buffer; thread-safe."""

    def __init__(self, capacity: int, *, pin_memory: bool | None = None,
                 prefault: bool = True, runtime: Runtime = THREADS) -> None:
        if capacity < ALIGN:
            raise ConfigError(f"pool capacity={capacity} bytes is below the minimum of {ALIGN}")
        capacity = capacity // ALIGN * ALIGN
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        # Over-allocate one page so the usable region starts 4 KiB-aligned in virtual memory.
        raw = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
        skew = (-raw.data_ptr()) % ALIGN
        self._buffer = raw[skew : skew + capacity]
        #: Set once every page of the buffer is backed (see :class:`_Frontier`).
        self.populated = threading.Event()
        self._frontier: _Frontier | None = None
        if pin_memory or not prefault:  # pinned memory is backed and locked when allocated
            self.populated.set()
        else:
            self._frontier = _Frontier(self._buffer, self.populated, runtime)
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
        if self._frontier is not None:
            self._frontier.reach(start + size)
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

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background backing (:class:`_Frontier`), so a closed tier leaves no thread
        behind holding its buffer; memory still referenced by live objects stays valid."""
        if self._frontier is not None:
            self._frontier.close(timeout)

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool (for registering it once with a DMA engine, e.g. cuFile)."""
        return self._buffer
