"""The reference admission policies: ``always`` (every chunk is written, as before policies) and
``tinylfu`` (a chunk is written once it has been used ``min_count`` times).

``tinylfu`` counts uses in a count-min sketch (TinyLFU's frequency sketch: ``depth`` rows of
4-bit-range counters, an estimate is the minimum over rows, so it may over-count, never
under-count) and ages it: after ``sample_size`` recorded uses every counter is halved, so a chunk
hot last week does not stay admitted forever and the sketch never saturates. A prompt seen once
(a one-off question, a scan) is never written to the tier; the second use writes it. Its memory
is ``depth x width`` bytes, whatever the traffic.

It admits by a bar rather than TinyLFU's duel with the would-be victim: the victim is chosen by
the tier, under its own lock, often in another process (a shared directory or store), so the
StorageManager cannot know it when it decides.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import numpy as np
import xxhash
from pydantic import Field

from ..config import BaseOptions
from ..policyspecs import PolicyContext, policyimpl


def stable_hash(key: Hashable) -> int:
    """A 64-bit hash of ``key`` that is the same in every process (a ``CacheKey`` by its chunk
    hash and namespace; bytes, str and int by value; anything else by its ``repr``)."""
    if hasattr(key, "chunk_hash") and hasattr(key, "namespace"):
        return xxhash.xxh3_64_intdigest(key.chunk_hash, seed=xxhash.xxh3_64_intdigest(key.namespace.encode()))
    if isinstance(key, bytes):
        return xxhash.xxh3_64_intdigest(key)
    if isinstance(key, int):
        return xxhash.xxh3_64_intdigest(key.to_bytes(max(1, (key.bit_length() + 8) // 8), "little",
                                                     signed=True))
    return xxhash.xxh3_64_intdigest((key if isinstance(key, str) else repr(key)).encode())


class AlwaysAdmit:
    """Every chunk is admitted (what every tier did before policies)."""

    kind = "admission"

    def __init__(self, ctx: PolicyContext) -> None:
        pass

    @policyimpl
    def record_use(self, keys: Sequence[Hashable]) -> None:
        pass

    @policyimpl
    def admit(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> list[bool]:
        return [True] * len(keys)


class TinyLFUAdmission:
    """Admit a chunk once a count-min sketch (with aging) has seen ``min_count`` uses of it."""

    kind = "admission"

    class Options(BaseOptions):
        min_count: int = Field(default=2, ge=1, le=15, description="uses before a chunk is "
                               "written to the tier (2: 'seen twice')")
        sample_size: int = Field(default=100_000, ge=16, description="recorded uses between two "
                                 "agings (every counter halved)")
        depth: int = Field(default=4, ge=1, le=8, description="rows of the sketch (hashes per key)")
        width: int | None = Field(default=None, ge=16, description="counters per row, rounded "
                                  "up to a power of two (default: sample_size)")
        on_load: bool = Field(default=False, description="also write a chunk refused earlier "
                              "when a later use loads it from another tier (L1) and it now has "
                              "min_count uses; off: it is written when it is computed again")

    #: counters saturate here (4 bits, as TinyLFU's)
    MAX_COUNT = 15

    def __init__(self, ctx: PolicyContext) -> None:
        opts = ctx.options if isinstance(ctx.options, TinyLFUAdmission.Options) \
            else TinyLFUAdmission.Options.model_validate(ctx.options or {})
        self.min_count = opts.min_count
        self.on_load = opts.on_load
        self.sample_size = opts.sample_size
        width = 1 << max(4, (opts.width or opts.sample_size) - 1).bit_length()
        self._mask = width - 1
        self._rows = np.arange(opts.depth)
        self._table = np.zeros((opts.depth, width), dtype=np.uint8)
        self._recorded = 0
        self._lock = threading.Lock()
        self.counts = {"admitted": 0, "rejected": 0, "agings": 0}

    def _slots(self, key: Hashable) -> np.ndarray:
        h = stable_hash(key)
        lo, hi = h & 0xFFFFFFFF, h >> 32
        # Kirsch-Mitzenmacher: row i's slot from two halves of one 64-bit hash
        return (lo + self._rows * (hi | 1)) & self._mask

    def estimate(self, key: Hashable) -> int:
        """How many uses of ``key`` the sketch has seen (since agings halved them)."""
        with self._lock:
            return int(self._table[self._rows, self._slots(key)].min())

    @policyimpl
    def record_use(self, keys: Sequence[Hashable]) -> None:
        with self._lock:
            for key in keys:
                slots = self._slots(key)
                cells = self._table[self._rows, slots]
                low = cells.min()
                if low < self.MAX_COUNT:  # conservative update: only the smallest counters grow
                    self._table[self._rows, slots] = np.where(cells == low, low + 1, cells)
                self._recorded += 1
                if self._recorded >= self.sample_size:
                    self._table >>= 1
                    self._recorded = 0
                    self.counts["agings"] += 1

    @policyimpl
    def admit(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> list[bool]:
        with self._lock:
            out = [int(self._table[self._rows, self._slots(k)].min()) >= self.min_count
                   for k in keys]
            n = sum(out)
            self.counts["admitted"] += n
            self.counts["rejected"] += len(out) - n
            return out

    @policyimpl
    def admit_loaded(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> list[bool]:
        if not self.on_load:
            return [False] * len(keys)
        return self.admit(keys=keys, sizes=sizes)

    @policyimpl
    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counts)
