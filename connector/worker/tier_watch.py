"""The worker half of kvplug's KV events (:mod:`..scheduler.events` says what they are for):
which chunks each tier took and lost.

:class:`TierWatch` puts a pluggy wrapper on every tier that sees the chunks handed to it (stores
and promotions into L1) and explicit evictions; a background thread (never vLLM's step) asks the
tier whether it holds them (:meth:`StorageManager.holds`): a chunk present is *stored*; a tier
whose removal counters (evictions, corrupt, failed or dropped writes...) grew is swept, and a
chunk no longer there is *removed*. Each step's news goes to vLLM in a
:class:`..protocol.metadata.KVPlugKVEvents` (``get_kv_connector_kv_cache_events``); vLLM
concatenates the workers' lists.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvplug.hookspecs import hookimpl
from kvplug.keys import CacheKey

from ..protocol.metadata import KVPlugKVEvents, TierEvent

if TYPE_CHECKING:
    from kvplug.storage_manager import StorageManager

    from .side import WorkerSide

logger = logging.getLogger("kvplug.connector")

#: Tier counters (``StorageManager.stats()``) whose growth means chunks may have left the tier.
REMOVAL_COUNTERS = ("evictions", "evicted", "corrupt", "auth_failures", "vanished", "other_version", "failed_puts",
                    "dropped_puts", "skipped_puts", "faults")
#: How long a chunk handed to a tier that may block is re-checked before it counts as dropped.
PENDING_S = 120.0
#: Keys per ``contains`` call while sweeping a tier.
SWEEP_BATCH = 4096


# -- worker side ---------------------------------------------------------------------------------
class _TierSpy:
    """A pluggy wrapper on one tier: the chunks handed to it, and explicit evictions."""

    def __init__(self, watch: TierWatch, tier: str) -> None:
        self.watch, self.tier = watch, tier

    @hookimpl(wrapper=True)
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[Any]):  # noqa: ANN201
        result = yield
        self.watch.submitted(self.tier, keys)
        return result

    @hookimpl(wrapper=True)
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int):  # noqa: ANN201
        result = yield
        self.watch.dirty(self.tier)
        return result


class TierWatch:
    """Worker side: which chunks entered and left each tier (see the module docstring)."""

    def __init__(self, storage: StorageManager, max_chunks: int = 16384,
                 interval_s: float = 0.2,
                 current: Callable[[CacheKey], bool] | None = None, epoch: str = "") -> None:
        self.storage = storage
        #: whether a key is of this engine's weights epoch: news only about those (a chunk
        #: stored under an earlier epoch, landing after a reset, shares its chunk hash with the
        #: new epoch's key, and the scheduler's book counts ranks by chunk hash)
        self.current = current or (lambda key: True)
        #: the weights epoch of the keys watched, stamped on every piece of news (see forget)
        self.epoch = epoch
        self._forgets = 0  # forget() calls so far: a round that began before one reports nothing
        self._rt = storage.runtime  # its ticker and clock (kvplug.runtime; a simulation's)
        self.max_chunks = max_chunks
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._round = threading.Lock()  # one check() at a time (see check)
        self._pending: dict[str, dict[CacheKey, float]] = {t: {} for t in storage.tier_names}
        self._held: dict[str, OrderedDict[CacheKey, None]] = {
            t: OrderedDict() for t in storage.tier_names}
        self._dirty: set[str] = set()
        self._marks: dict[str, float] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # tier -> (retry at, delay): no answer
        self._out: list[TierEvent] = []
        self._closed = False
        for tier in storage.tier_names:
            storage.add_wrapper(_TierSpy(self, tier), tiers=[tier])
        self._ticker = self._rt.ticker(self._tick, interval_s, "kvplug-events")

    # called from the tiers' hooks (any thread)
    def submitted(self, tier: str, keys: Sequence[CacheKey]) -> None:
        now = self._rt.monotonic()
        with self._lock:
            pending = self._pending[tier]
            for k in keys:
                if self.current(k):
                    pending.setdefault(k, now)
        self._ticker.wake()

    def dirty(self, tier: str) -> None:
        with self._lock:
            self._dirty.add(tier)
        self._ticker.wake()

    def forget(self, epoch: str = "") -> None:
        """A new weights epoch, ``epoch``: the chunks watched so far are keyed under the old one
        (the scheduler's book withdrew them); news about them is dropped here, and news already
        taken, which may reach the book after its reset (asynchronous scheduling hands it a
        step's output one step late), carries the old epoch, which the book drops. A round
        that began before is dropped too (its keys are the old epoch's)."""
        with self._lock:
            self.epoch = epoch
            self._forgets += 1
            for tier in self._pending:
                self._pending[tier].clear()
                self._held[tier].clear()
            self._out = []

    def take(self) -> KVPlugKVEvents | None:
        """The news since the last call (vLLM's ``get_kv_connector_kv_cache_events``)."""
        with self._lock:
            out, self._out = self._out, []
        return KVPlugKVEvents(out) if out else None

    def close(self) -> None:
        self._closed = True
        self._ticker.close(timeout=5)

    # the background thread (the runtime's ticker: every interval_s, and when woken)
    def _tick(self) -> None:
        if self._closed:
            return
        try:
            self.check()
        except Exception:  # noqa: BLE001 - events are best effort; serving goes on
            logger.exception("kvplug: KV events check failed; trying again")

    def check(self) -> None:
        """One round: confirm the chunks handed to each tier, sweep tiers that lost some.

        Rounds never overlap (the background thread's and a caller's): two rounds reading the
        same pending chunks would each announce them, and the second, finding one the first had
        already forgotten past ``max_chunks``, would announce it stored again."""
        with self._round:
            self._check()

    def _check(self) -> None:
        with self._lock:
            if not any(self._pending.values()) and not any(self._held.values()):
                return  # nothing handed to any tier yet: nothing to ask
            era = self._forgets  # the round's keys are of the epoch as of this many forgets
        stats = self.storage.stats()
        now = self._rt.monotonic()
        for tier in self.storage.tier_names:
            if self._backoff.get(tier, (0.0, 0.0))[0] > now:
                continue  # the tier did not answer lately: ask again later, not every round
            mark = sum(stats.get(tier, {}).get(n, 0) for n in REMOVAL_COUNTERS)
            with self._lock:
                if mark != self._marks.get(tier, 0):
                    self._dirty.add(tier)
                self._marks[tier] = mark
                sweep = tier in self._dirty
                self._dirty.discard(tier)
                pending = list(self._pending[tier].items())
                held = list(self._held[tier]) if sweep else []
            if pending:
                self._confirm(tier, pending, era)
            if held:
                self._sweep(tier, held, era)

    def _confirm(self, tier: str, pending: list[tuple[CacheKey, float]],
                 era: int) -> None:
        keys = [k for k, _ in pending]
        found = self.storage.holds(tier, keys)
        if found is None:
            self._no_answer(tier)
            return
        self._backoff.pop(tier, None)
        now = self._rt.monotonic()
        wait = not self.storage.never_blocks(tier)
        with self._lock:
            if era != self._forgets:
                return  # the epoch changed while the tier was asked: these keys are forgotten
            epoch = self.epoch
            held, todo = self._held[tier], self._pending[tier]
            for (key, since), hit in zip(pending, found, strict=True):
                if hit:
                    todo.pop(key, None)
                    if key not in held:
                        held[key] = None
                        self._out.append(TierEvent(True, tier, key.chunk_hash, epoch))
                    else:
                        held.move_to_end(key)
                elif not wait or now - since > PENDING_S:
                    todo.pop(key, None)  # refused (full) or dropped: never stored
            while len(held) > self.max_chunks:  # forget the oldest: announce it gone
                key, _ = held.popitem(last=False)
                self._out.append(TierEvent(False, tier, key.chunk_hash, epoch))

    def _no_answer(self, tier: str) -> None:
        """A tier that faults or times out is asked again after a growing delay (up to 30 s)."""
        delay = min(30.0, max(self.interval_s, 2 * self._backoff.get(tier, (0.0, 0.0))[1]))
        self._backoff[tier] = (self._rt.monotonic() + delay, delay)

    def _sweep(self, tier: str, keys: list[CacheKey], era: int) -> None:
        for i in range(0, len(keys), SWEEP_BATCH):
            part = keys[i:i + SWEEP_BATCH]
            found = self.storage.holds(tier, part)
            if found is None:
                with self._lock:
                    self._dirty.add(tier)  # unknown: sweep again later
                self._no_answer(tier)
                return
            with self._lock:
                if era != self._forgets:
                    return  # the epoch changed while the tier was asked: forgotten
                held = self._held[tier]
                for key, hit in zip(part, found, strict=True):
                    if not hit and key in held and key not in self._pending[tier]:
                        del held[key]
                        self._out.append(TierEvent(False, tier, key.chunk_hash, self.epoch))


def watch_tiers(worker: WorkerSide, max_chunks: int) -> TierWatch:
    """A :class:`TierWatch` on ``worker``'s tiers that follows its weights epochs: news only
    about the current epoch's keys, and nothing watched so far once the epoch changes."""
    assert worker.storage is not None
    watch = TierWatch(worker.storage, max_chunks, current=worker.of_current_epoch,
                      epoch=worker.epoch)
    worker.on_epoch = lambda: watch.forget(worker.epoch)
    return watch


# -- scheduler side ------------------------------------------------------------------------------
