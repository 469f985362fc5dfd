"""The reference eviction policies: ``lru`` (what every tier did before policies) and ``s3fifo``.

Both keep entries in insertion-ordered dicts (O(1) per insert, access and removal) and are
called under their tier's lock (:mod:`kvplug.policyspecs`), so they hold no lock of their own.

S3-FIFO (Yang et al., SOSP 2023) was chosen over ARC by measurement (benchmarks/bench_policies.py,
RESULTS.md "Policies"): a new entry goes to a small FIFO (``small_fraction`` of the bytes); one
used again before it leaves moves to the main FIFO, one that was not leaves (its key remembered
in a ghost list, so an entry that comes back soon goes straight to main). Entries leaving main get
a second chance per use (up to 3). A scan of one-off prompts passes through the small queue and
never pushes the hot set out of main, which LRU cannot promise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from pydantic import Field

from ..config import BaseOptions
from ..policyspecs import PolicyContext, policyimpl


class LRUEviction:
    """Least recently used first. Pinned or in-use entries are skipped, left in place."""

    kind = "eviction"

    def __init__(self, ctx: PolicyContext) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()
        self._evicted = 0

    @policyimpl
    def insert(self, key: Hashable, nbytes: int) -> None:
        self._order.pop(key, None)
        self._order[key] = nbytes

    @policyimpl
    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    @policyimpl
    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    @policyimpl
    def victims(self, nbytes: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        out: list[Hashable] = []
        freed = 0
        for key, size in self._order.items():
            if freed >= nbytes:
                break
            if evictable(key):
                out.append(key)
                freed += size
        for key in out:
            del self._order[key]
        self._evicted += len(out)
        return out

    @policyimpl
    def stats(self) -> dict[str, float]:
        return {"entries": len(self._order), "evicted": self._evicted}


class S3FIFOEviction:
    """S3-FIFO: a small probationary FIFO, a main FIFO with second chances, a ghost list."""

    kind = "eviction"

    class Options(BaseOptions):
        small_fraction: float = Field(
            default=0.1, gt=0, lt=1, description="share of the tier's bytes kept for entries "
            "seen once (the probationary queue); the rest is the main queue")
        max_freq: int = Field(default=3, ge=1, le=15, description="second chances an entry in "
                              "main can earn by use")
        ghost_entries: int | None = Field(
            default=None, ge=0, description="keys of evicted entries remembered (default: as "
            "many as the main queue holds)")

    def __init__(self, ctx: PolicyContext) -> None:
        opts = ctx.options if isinstance(ctx.options, S3FIFOEviction.Options) \
            else S3FIFOEviction.Options.model_validate(ctx.options or {})
        self.small_fraction = opts.small_fraction
        self.max_freq = opts.max_freq
        self.ghost_limit = opts.ghost_entries
        self._small: OrderedDict[Hashable, int] = OrderedDict()
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self.counts = {"promoted": 0, "ghost_hits": 0, "evicted_small": 0, "evicted_main": 0}

    # -- bookkeeping ------------------------------------------------------------------------------
    def _forget(self, key: Hashable) -> int | None:
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
        else:
            size = self._main.pop(key, None)
            if size is not None:
                self._main_bytes -= size
        self._freq.pop(key, None)
        return size

    def _remember_ghost(self, key: Hashable) -> None:
        self._ghost[key] = None
        limit = len(self._main) + 1 if self.ghost_limit is None else self.ghost_limit
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def _to_main(self, key: Hashable, size: int) -> None:
        self._main[key] = size
        self._main_bytes += size

    # -- hooks --------------------------------------------------------------------------------------
    @policyimpl
    def insert(self, key: Hashable, nbytes: int) -> None:
        for queue, attr in ((self._small, "_small_bytes"), (self._main, "_main_bytes")):
            old = queue.get(key)
            if old is not None:  # known: a new size, and a use
                queue[key] = nbytes
                setattr(self, attr, getattr(self, attr) + nbytes - old)
                self.access(key)
                return
        self._freq[key] = 0
        if key in self._ghost:  # came back soon after it left: it is wanted
            del self._ghost[key]
            self.counts["ghost_hits"] += 1
            self._to_main(key, nbytes)
        else:
            self._add_small(key, nbytes)

    def _add_small(self, key: Hashable, nbytes: int) -> None:
        self._small[key] = nbytes
        self._small_bytes += nbytes

    @policyimpl
    def access(self, key: Hashable) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < self.max_freq:
            self._freq[key] = freq + 1

    @policyimpl
    def remove(self, key: Hashable) -> None:
        self._forget(key)

    @policyimpl
    def victims(self, nbytes: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        out: list[Hashable] = []
        freed = 0
        # Every entry is looked at most max_freq + 2 times (a second chance costs one use; an
        # entry kept for the tier is passed over), so the loop ends even when all are pinned.
        budget = (self.max_freq + 2) * (len(self._small) + len(self._main)) + 1
        kept_small = kept_main = 0  # entries passed over in a row because the tier keeps them
        while freed < nbytes and budget > 0:
            budget -= 1
            small_ok = bool(self._small) and kept_small < len(self._small)
            main_ok = bool(self._main) and kept_main < len(self._main)
            total = self._small_bytes + self._main_bytes
            if small_ok and (self._small_bytes > self.small_fraction * total or not main_ok):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if not evictable(key):  # in use: stays on probation, at the back
                    kept_small += 1
                    self._add_small(key, size)
                    continue
                kept_small = 0
                if self._freq.get(key, 0) > 0:  # used while on probation: main
                    self._freq[key] = 0
                    self._to_main(key, size)
                    self.counts["promoted"] += 1
                    continue
                self.counts["evicted_small"] += 1
            elif main_ok:
                key, size = self._main.popitem(last=False)
                self._main_bytes -= size
                freq = self._freq.get(key, 0)
                if not evictable(key):
                    kept_main += 1
                    self._to_main(key, size)
                    continue
                kept_main = 0
                if freq > 0:  # a second chance per use
                    self._freq[key] = freq - 1
                    self._to_main(key, size)
                    continue
                self.counts["evicted_main"] += 1
            else:
                break
            del self._freq[key]
            self._remember_ghost(key)
            out.append(key)
            freed += size
        return out

    @policyimpl
    def stats(self) -> dict[str, float]:
        return {"entries": len(self._small) + len(self._main), "small_entries": len(self._small),
                "main_entries": len(self._main), "ghost_entries": len(self._ghost), **self.counts}
