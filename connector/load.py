"""One step's loads, as data: the plan of each request's load and the layer-by-layer reads.

The worker (:mod:`.worker`) runs a load in four steps: **plan** (:func:`plan_load`: which pages of
which chunk go to which blocks, by :mod:`kvplug.gpu.blocks`' arithmetic), **fetch and validate**
(every chunk is checked before any of its bytes reach a block), **scatter** (bulk, or layer by
layer; a chunk that lookup found in a tier that reads layer ranges is then read layer by layer,
:class:`LayerReads`), **report** (load errors, stats, the per-request result:
:mod:`.load_report`). A chunk that fails
makes it and everything after it in its request a load error, so vLLM recomputes those blocks.

A load that needs a tier that may block runs in the background (:class:`BackgroundLoads`, vLLM's
asynchronous protocol): only its fetch moves off the engine step; its validation and scatter run
on the worker's thread when the fetch is over, so no block is written once vLLM may free it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from kvplug.gpu import blocks_for_tokens, num_pages, pages_for_tokens
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.runtime import THREADS, Runtime
from kvplug.storage_manager import StorageManager

from .metadata import KVPlugMetadata, LoadSpec, ReqMeta


@dataclass(eq=False)
class ChunkLoad:
    """One chunk of a request's load: its tokens ``[start, end)`` and where its pages go."""

    key: CacheKey
    start: int
    end: int
    num_pages: int  # pages of the stored chunk
    pages: slice  # of those, the pages to write (vLLM's own prefix hit is skipped)
    block_ids: list[int]  # where they go
    tier: str  # where lookup found it
    by_layer: bool = False  # read layer by layer (layer-wise mode, a tier that reads ranges)
    job: int | None = None  # index of its transfer job, once it has one
    counts: bool = True  # its tokens count as loaded (one part per chunk: see .groups)


@dataclass(eq=False)
class RequestLoad:
    """One request's load through the four steps."""

    req: ReqMeta
    spec: LoadSpec
    block_size: int
    chunks: list[ChunkLoad] = field(default_factory=list)
    fail_at: int | None = None  # first token of the first chunk that failed
    seconds: float = 0.0

    def fail(self, token: int) -> list[int]:
        """Mark the chunk at ``token`` and every later one failed; their jobs to leave out."""
        self.fail_at = token if self.fail_at is None else min(self.fail_at, token)
        return [c.job for c in self.chunks if c.start >= self.fail_at and c.job is not None]

    def ok(self, chunk: ChunkLoad) -> bool:
        return self.fail_at is None or chunk.start < self.fail_at

    def error_blocks(self) -> list[int]:
        """The blocks vLLM must recompute: from the failed chunk (or vLLM's hit) to the end."""
        if self.fail_at is None:
            return []
        bs = self.block_size
        return self.req.block_ids[max(self.fail_at, self.spec.start) // bs:
                                  num_pages(self.spec.end, bs)]

    def loaded(self) -> list[ChunkLoad]:
        """The chunks whose pages reached blocks."""
        return [c for c in self.chunks if c.block_ids and self.ok(c)]


TierOf = Callable[[CacheKey], "str | None"]  # the tier holding a key (None: no tier does)


def plan_load(md: KVPlugMetadata, r: ReqMeta, key: Callable[[bytes], CacheKey],
              tier_of: TierOf) -> RequestLoad:
    """Step 1: the chunks of ``r``'s load and their blocks. A chunk the block table cannot hold,
    or that no tier holds (``tier_of``: where lookup pinned it, else where it is now; with TP>1 a
    rank may be sent a key it never pinned), fails with everything after it."""
    assert r.load is not None
    spec, bs = r.load, md.block_size
    ld = RequestLoad(r, spec, bs)
    for i, h in enumerate(spec.hashes):
        s, e = md.chunk_range(spec, i)
        first = max(s, spec.start)  # blocks before it vLLM already holds
        try:
            ids = blocks_for_tokens(r.block_ids, first, e, bs)
            pages = pages_for_tokens(first, e, bs, chunk_start=s)
        except ValueError:
            ld.fail(s)
            break
        k = key(h)
        tier = tier_of(k)
        if tier is None:
            ld.fail(s)
            break
        ld.chunks.append(ChunkLoad(k, s, e, num_pages(e - s, bs), pages, ids, tier))
    return ld


def valid_pages(obj: MemoryObj | None, shape: tuple[int, int, int], num_tokens: int) -> bool:
    """Pages may reach blocks only if they are exactly what this engine would have stored."""
    if obj is None:
        return False
    t = obj.tensor
    return (obj.meta.fmt == MemoryFormat.KV_PAGES and t.dtype == torch.uint8
            and tuple(t.shape) == shape and obj.num_tokens == num_tokens)


class LayerReads:
    """Chunks of a layer-wise load that are read one layer at a time, just before that layer is
    copied to the blocks (``layerwise_load``'s ``before``), from the tier lookup found them in.

    Each is staged in memory from ``allocate``; once whole, a chunk from a lower tier is promoted
    into L1 (as a whole-chunk ``get`` does).
    """

    def __init__(self, storage: StorageManager, num_layers: int) -> None:
        self.storage = storage
        self.num_layers = num_layers
        self.items: list[tuple[RequestLoad, ChunkLoad, MemoryObj]] = []

    def add(self, ld: RequestLoad, chunk: ChunkLoad, staging: MemoryObj) -> None:
        self.items.append((ld, chunk, staging))

    def before(self, layer: int) -> list[int]:
        """Read layer ``layer`` of every chunk still good; returns the jobs to leave out."""
        drop: list[int] = []
        for ld, c, staging in self.items:
            if not ld.ok(c):
                continue
            t0 = time.perf_counter()
            part = self.storage.get_layers(c.key, layer, 1, tier=c.tier)
            good = valid_pages(part, (1, c.num_pages, staging.tensor.shape[2]), c.end - c.start)
            if good:
                staging.tensor[layer].copy_(part.tensor[0])  # type: ignore[union-attr]
            if part is not None:
                part.ref_down()
            if not good:
                drop += ld.fail(c.start)
            elif layer == self.num_layers - 1 and c.tier != self.storage.tier_names[0]:
                self.storage.promote(c.key, staging)
            ld.seconds += time.perf_counter() - t0
        return drop


Fetch = Callable[[Sequence[CacheKey]], list[MemoryObj | None]]


def _drop(fut: Future) -> None:
    """Release what a fetch nobody will use brought (a cancelled load's, when it arrives)."""
    if fut.cancelled() or fut.exception() is not None:
        return
    for obj in fut.result():
        if obj is not None:
            obj.ref_down()


class BackgroundLoads:
    """Loads vLLM waits for in ``WAITING_FOR_REMOTE_KVS``: each request's chunks are fetched on a
    worker-owned pool (``fetch``: :meth:`StorageManager.batched_get`, which bounds every tier call
    by the tier's ``timeout_s`` and promotes into L1). The caller takes finished fetches on its own
    thread (:meth:`take_done`) and writes the blocks there; a cancelled load's objects are dropped
    when its fetch ends, never written."""

    def __init__(self, fetch: Fetch, threads: int = 4, runtime: Runtime = THREADS) -> None:
        self._fetch = fetch
        self._pool = runtime.executor(threads, "kvplug-load")
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[RequestLoad, Future]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._inflight)

    def submit(self, ld: RequestLoad) -> None:
        """Start fetching every chunk of ``ld`` (in chunk order)."""
        def run() -> list[MemoryObj | None]:
            t0 = time.perf_counter()
            try:
                return self._fetch([c.key for c in ld.chunks])
            finally:
                ld.seconds += time.perf_counter() - t0

        with self._lock:
            self._inflight[ld.req.req_id] = (ld, self._pool.submit(run))

    def cancel(self, req_ids: set[str]) -> set[str]:
        """vLLM finished these requests (aborted while loading): their loads are over now; what
        their fetches still bring is dropped on arrival. Returns the ids that had a load."""
        with self._lock:
            gone = [self._inflight.pop(r) for r in req_ids if r in self._inflight]
        for _, fut in gone:
            fut.add_done_callback(_drop)  # runs at once if the fetch is over
        return {ld.req.req_id for ld, _ in gone}

    def take_done(self) -> list[tuple[RequestLoad, list[MemoryObj | None]]]:
        """The loads whose fetch is over, with the objects (``None``: missing or failed); the
        caller owns one reference to each object."""
        with self._lock:
            done = [(r, v) for r, v in self._inflight.items() if v[1].done()]
            for r, _ in done:
                del self._inflight[r]
        out = []
        for _, (ld, fut) in done:
            try:
                objs = fut.result()
            except Exception:  # noqa: BLE001 - a fetch that raised is a load error
                objs = []
            out.append((ld, list(objs) + [None] * (len(ld.chunks) - len(objs))))
        return out

    def close(self) -> None:
        """Drop every load (their objects on arrival) and stop the pool without waiting."""
        self.cancel(set(self._inflight))
        self._pool.shutdown(wait=False, cancel_futures=True)
