"""KV cache groups (vLLM's hybrid KV cache manager, ``SupportsHMA``): what kvplug stores per group.

With the hybrid manager on, vLLM gives each *KV cache group* (layers of one attention type) its
own block table, and the groups' layers overlay one another in the same KV tensors: block ``b``
belongs to one group at a time, so the pages of block ``b`` across every registered tensor are
that group's KV. kvplug therefore moves the same ``[layers, pages, page_bytes]`` chunk objects as
with one group, once per group, each gathered through that group's block table and stored under
its own key (:func:`group_hash`).

* **full attention** groups are stored and loaded like the single group of a plain model;
* **sliding-window** groups: vLLM frees blocks that fall out of the window and puts the null
  block (id 0) in their place. A chunk's pages are stored only while every block of the chunk is
  live; a load fills only the live blocks (those inside the window of the hit's end), and a hit
  ends only where every chunk overlapping that window is stored (:func:`lookup`);
* any other group (recurrent/Mamba state, chunked-local, cross attention...) cannot be restored
  exactly from token chunks: kvplug then neither loads nor stores for the model, so every hit
  stops at vLLM's own prefix cache (:attr:`GroupLayout.servable`).

A model with one group (and every model with the hybrid manager off) keeps the keys and objects
of before: this module only changes anything when ``len(groups) > 1``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplug.gpu import blocks_for_tokens, num_pages, pages_for_tokens
from kvplug.keys import CacheKey

NULL_BLOCK = 0  # vLLM's null block: the placeholder of a sliding-window block out of the window

FULL, SLIDING, UNSUPPORTED = "full", "sliding", "unsupported"


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group as kvplug sees it."""

    index: int
    kind: str  # FULL, SLIDING or UNSUPPORTED
    spec: str  # vLLM's spec class name (for messages)
    window: int = 0  # sliding window in tokens (SLIDING only)
    num_layers: int = 0


@dataclass
class GroupLayout:
    """The KV cache groups of one engine (from vLLM's ``KVCacheConfig``)."""

    groups: list[GroupInfo] = field(default_factory=lambda: [GroupInfo(0, FULL, "single")])
    block_size: int = 0  # vLLM's block size in tokens (every group's)
    #: vLLM zeroes newly allocated blocks (mixed-precision caches, Mamba: its
    #: ``needs_kv_cache_zeroing``); its V2 model runner does so *before* ``handle_preemptions``,
    #: so a block a preemption freed can be rewritten before kvplug's wait (see ..worker.store)
    zeroes_new_blocks: bool = False
    #: KV bytes of one block on one worker, every group's layers (0: unknown)
    block_bytes: int = 0
    #: the engine's KV blocks (``KVCacheConfig.num_blocks``; 0: unknown)
    num_blocks: int = 0

    @property
    def multi(self) -> bool:
        """More than one group: per-group keys, block tables and loads (else as before)."""
        return len(self.groups) > 1

    @property
    def servable(self) -> bool:
        """Every group can be restored exactly from stored chunks."""
        return all(g.kind != UNSUPPORTED for g in self.groups)

    @property
    def full(self) -> list[GroupInfo]:
        return [g for g in self.groups if g.kind == FULL]

    @property
    def sliding(self) -> list[GroupInfo]:
        return [g for g in self.groups if g.kind == SLIDING]

    def describe(self) -> str:
        return ", ".join(f"{g.index}:{g.kind}" + (f"(window {g.window})" if g.window else "")
                         + f"[{g.num_layers} layers]" for g in self.groups)

    def unsupported_message(self) -> str:
        bad = [g for g in self.groups if g.kind == UNSUPPORTED]
        return ("kvplug cannot restore KV cache group(s) "
                + ", ".join(f"{g.index} ({g.spec})" for g in bad)
                + " from stored token chunks (recurrent/Mamba state, chunked-local or cross "
                "attention): kvplug neither loads nor stores for this model, so every hit stops "
                "at vLLM's own prefix cache. Remove kvplug's --kv-transfer-config for this model, "
                "or serve a model whose layers are full or sliding-window attention.")


def classify(spec: Any) -> tuple[str, int]:
    """``(kind, window)`` of one vLLM ``KVCacheSpec``. Exact classes only: a subclass may change
    which blocks hold what (RSWA evicts a middle gap, sink attention keeps extra tokens...)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return FULL, 0
    if type(spec) is SlidingWindowSpec and not getattr(spec, "extra_retained_tokens", 0):
        return SLIDING, int(spec.sliding_window)
    return UNSUPPORTED, 0


def layout_of(kv_cache_config: Any, block_size: int) -> GroupLayout:
    """The group layout of vLLM's ``KVCacheConfig`` (one full group when it is missing). Groups
    whose block size is not ``block_size`` are unsupported (kvplug's chunks count one size)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    zeroes = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
    nbytes = sum(int(getattr(g.kv_cache_spec, "page_size_bytes", 0) or 0) * len(g.layer_names)
                 for g in groups)
    blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    if len(groups) <= 1:
        n = len(groups[0].layer_names) if groups else 0
        return GroupLayout([GroupInfo(0, FULL, "single", num_layers=n)], block_size, zeroes,
                           nbytes, blocks)
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind, window = classify(spec)
        if getattr(spec, "block_size", block_size) != block_size:
            kind = UNSUPPORTED
        out.append(GroupInfo(i, kind, type(spec).__name__, window, len(g.layer_names)))
    return GroupLayout(out, block_size, zeroes, nbytes, blocks)


def group_hash(chunk_hash: bytes, group: GroupInfo) -> bytes:
    """The hash a group's part of a chunk is stored under (multi-group engines only): distinct
    per group index, kind and window, never equal to a single-group chunk's hash."""
    tag = f"kvplug-hma|{group.index}|{group.kind}|{group.window}|".encode()
    return hashlib.sha256(tag + chunk_hash).digest()[: len(chunk_hash) or 32]


def first_live_token(group: GroupInfo, end: int) -> int:
    """The first token whose KV a sliding-window group keeps once ``end`` tokens are computed
    (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``); 0 for a full group."""
    if group.kind != SLIDING:
        return 0
    return max(0, end - group.window + 1)


# -- store -----------------------------------------------------------------------------------------
def store_targets(layout: GroupLayout, tables: Sequence[Sequence[int]], chunk_hash: bytes,
                  start: int, end: int, block_size: int) -> list[tuple[bytes, list[int]]] | None:
    """What to store of the chunk ``[start, end)``: ``(hash, block ids)`` per group. A sliding
    group whose blocks are not all live (some fell out of its window) is left out; None when a
    full group's table does not reach ``end`` yet."""
    out = []
    for g in layout.groups:
        try:
            ids = blocks_for_tokens(tables[g.index] if g.index < len(tables) else [], start, end,
                                    block_size)
        except ValueError:
            if g.kind == FULL:
                return None
            continue
        if NULL_BLOCK in ids:
            continue  # out of the window (sliding) or not allocated: not stored
        out.append((group_hash(chunk_hash, g), ids))
    return out


# -- load ------------------------------------------------------------------------------------------
@dataclass
class GroupChunk:
    """One group's part of one chunk of a load."""

    hash: bytes
    start: int
    end: int
    num_pages: int
    pages: slice
    block_ids: list[int]
    counts: bool  # counts the chunk's tokens (the first group of the chunk)


def load_parts(layout: GroupLayout, tables: Sequence[Sequence[int]], chunk_hash: bytes,
               start: int, end: int, load_start: int, block_size: int,
               write_end: int | None = None) -> list[GroupChunk]:
    """The parts of the stored chunk ``[start, end)`` to write, per group: full groups every block
    from ``load_start`` (what vLLM already holds is skipped) to ``write_end`` (default ``end``),
    sliding groups only their live blocks (the null blocks before the window stay null). Raises
    ``ValueError`` when a table is too short."""
    first = max(start, load_start)
    stop = end if write_end is None else min(end, write_end)
    out: list[GroupChunk] = []
    for g in layout.groups:
        ids = blocks_for_tokens(tables[g.index] if g.index < len(tables) else [], first, stop, block_size)
        skip = 0
        while skip < len(ids) and ids[skip] == NULL_BLOCK:
            skip += 1
        if g.kind == FULL and skip:
            raise ValueError(f"null block in full-attention group {g.index} at token {first}")
        if skip == len(ids):
            continue  # wholly out of the window: nothing to write
        s = first + skip * block_size
        out.append(GroupChunk(group_hash(chunk_hash, g), start, end, num_pages(end - start, block_size),
                              pages_for_tokens(s, stop, block_size, chunk_start=start), ids[skip:],
                              counts=not out))
    return out


# -- lookup (worker side, on the lookup service's thread) ----------------------------------------
Contains = Callable[[list[CacheKey]], tuple[int, list[str]]]  # pinned prefix: (count, tiers)


@dataclass
class GroupHit:
    """A lookup's answer: the tokens every group can restore exactly, what was pinned, and
    which chunk indices have a part only in a tier that may block."""

    tokens: int
    pinned: list[CacheKey] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    chunk_of: list[int] = field(default_factory=list)  # chunk index of each pinned key


def lookup_groups(layout: GroupLayout, key: Callable[[bytes], CacheKey], contains: Contains,
                  hashes: list[bytes], tails: list[tuple[int, bytes]], chunk_size: int,
                  block_size: int) -> GroupHit:
    """The longest prefix every group can restore: the full groups' leading chunks (then the
    longest stored tail partial chunk, as for one group), shortened until every sliding group
    holds each chunk overlapping its window at the hit's end. What is found is pinned
    (``contains`` pins the leading run it finds); the caller releases every key in ``pinned``."""
    hit = GroupHit(0)

    def have(keys: list[CacheKey], chunk: list[int]) -> bool:
        n, tiers = contains(keys)
        hit.pinned.extend(keys[:n])
        hit.tiers.extend(tiers)
        hit.chunk_of.extend(chunk[:n])
        return n == len(keys)

    full = layout.full
    keys = [key(group_hash(h, g)) for h in hashes for g in full]
    n_full = len(hashes)
    if full:
        n, tiers = contains(keys)
        hit.pinned.extend(keys[:n])
        hit.tiers.extend(tiers)
        hit.chunk_of.extend(i // len(full) for i in range(n))
        n_full = n // len(full)

    def window_ok(end: int, tail: bytes | None) -> bool:
        last = -(-end // chunk_size)  # chunks [0, last) make up the hit
        for g in layout.sliding:
            lo = first_live_token(g, end) // block_size * block_size // chunk_size
            need = [(c, tail if tail is not None and c == last - 1 else hashes[c])
                    for c in range(lo, last)]
            if not have([key(group_hash(h, g)) for _, h in need], [c for c, _ in need]):
                return False
        return True

    if n_full == len(hashes):
        for end, h in tails:
            c = end // chunk_size
            tail_keys = [key(group_hash(h, g)) for g in full]
            if have(tail_keys, [c] * len(tail_keys)) and window_ok(end, h):
                hit.tokens = end
                return hit
    for n in range(n_full, 0, -1):
        if window_ok(n * chunk_size, None):
            hit.tokens = n * chunk_size
            return hit
    return hit
