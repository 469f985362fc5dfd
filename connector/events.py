"""KV events for KV-aware routers: ``BlockStored``/``BlockRemoved`` for what enters and leaves
kvplug's tiers, published through vLLM's own event publisher (``--kv-events-config``).

Two halves, one per side of the connector:

* worker: :class:`TierWatch` learns which chunks each tier took and lost. A pluggy wrapper on every
  tier sees the chunks handed to it (stores and promotions into L1) and explicit evictions; a
  background thread (never vLLM's step) asks the tier whether it holds them
  (:meth:`StorageManager.holds`): a chunk present is *stored*; a tier whose removal counters
  (evictions, corrupt, failed or dropped writes...) grew is swept, and a chunk no longer there is
  *removed*. Each step's news goes to vLLM in a :class:`KVPlugKVEvents`
  (``get_kv_connector_kv_cache_events``); vLLM concatenates the workers' lists.
* scheduler: :class:`TierEventBook` knows, for every chunk the scheduler named for a save or a
  load, its vLLM blocks (vLLM's own block hashes, tokens, LoRA, extra keys). It counts the ranks
  (TP x PP) holding each (tier, chunk): a chunk is announced once *every* rank holds it and
  withdrawn when the first rank loses it (a kvplug hit needs every rank). It turns them into vLLM's
  events in ``take_events``.

Chunk -> blocks: a kvplug chunk spans ``chunk_size / block_size`` vLLM blocks; its events carry
the hashes of those blocks exactly as vLLM's own ``BlockStored`` for the GPU does (the request's
block hashes, ``maybe_convert_block_hash``, parent = the block before the chunk), with
``medium`` = the tier's name in the kvplug config. Chunks overlap (a block-aligned partial chunk
and the full chunk that later covers the same blocks), so the book counts references per
(tier, block): ``BlockStored`` only for blocks new to the tier (one event per contiguous run, with
its parent) and ``BlockRemoved`` only for blocks no chunk in the tier covers any more. A router
that matches vLLM's block hashes can use them as they are.

Bounded: each tier tracks at most ``kv_events_max_chunks`` chunks (past it the oldest is announced
as removed and forgotten: a router loses a possible hit, never gains a false one); the book keeps
the blocks of at most that many chunks it has not announced.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvplug.hookspecs import hookimpl
from kvplug.keys import CacheKey
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

if TYPE_CHECKING:
    from kvplug.storage_manager import StorageManager
    from vllm.v1.request import Request

logger = logging.getLogger("kvplug.connector")

#: Tier counters (``StorageManager.stats()``) whose growth means chunks may have left the tier.
REMOVAL_COUNTERS = ("evictions", "evicted", "corrupt", "vanished", "other_version", "failed_puts",
                    "dropped_puts", "skipped_puts", "faults")
#: How long a chunk handed to a tier that may block is re-checked before it counts as dropped.
PENDING_S = 120.0
#: Keys per ``contains`` call while sweeping a tier.
SWEEP_BATCH = 4096


def events_enabled(vllm_config: Any, kv_events: bool) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``) and kvplug's switch is on."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(kv_events and cfg is not None and cfg.enable_kv_cache_events)


class TierEvent(NamedTuple):
    """One worker's news: chunk ``chunk_hash`` entered (``stored``) or left tier ``tier``."""

    stored: bool
    tier: str
    chunk_hash: bytes


class KVPlugKVEvents(KVConnectorKVEvents):
    """A step's :class:`TierEvent` list from the workers (vLLM concatenates them across workers;
    the scheduler's :class:`TierEventBook` counts ranks itself, across steps)."""

    def __init__(self, events: Iterable[TierEvent] = (), num_workers: int = 1) -> None:
        self.events: list[Any] = list(events)
        self.num_workers = num_workers

    def add_events(self, events: list[Any]) -> None:
        self.events.extend(events)

    def aggregate(self) -> KVPlugKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events.clear()

    def __repr__(self) -> str:
        return f"<KVPlugKVEvents {len(self.events)} events from {self.num_workers} workers>"


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
                 interval_s: float = 0.2) -> None:
        self.storage = storage
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
        self._wake = threading.Event()
        self._closed = False
        for tier in storage.tier_names:
            storage.add_wrapper(_TierSpy(self, tier), tiers=[tier])
        self._thread = threading.Thread(target=self._run, name="kvplug-events", daemon=True)
        self._thread.start()

    # called from the tiers' hooks (any thread)
    def submitted(self, tier: str, keys: Sequence[CacheKey]) -> None:
        now = time.monotonic()
        with self._lock:
            pending = self._pending[tier]
            for k in keys:
                pending.setdefault(k, now)
        self._wake.set()

    def dirty(self, tier: str) -> None:
        with self._lock:
            self._dirty.add(tier)
        self._wake.set()

    def forget(self) -> None:
        """A new weights epoch: the chunks watched so far are keyed under the old one (the
        scheduler's book withdrew them); news about them is dropped."""
        with self._lock:
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
        self._wake.set()
        self._thread.join(timeout=5)

    # the background thread
    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
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
        stats = self.storage.stats()
        now = time.monotonic()
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
                self._confirm(tier, pending)
            if held:
                self._sweep(tier, held)

    def _confirm(self, tier: str, pending: list[tuple[CacheKey, float]]) -> None:
        keys = [k for k, _ in pending]
        found = self.storage.holds(tier, keys)
        if found is None:
            self._no_answer(tier)
            return
        self._backoff.pop(tier, None)
        now = time.monotonic()
        wait = self.storage.may_block(tier)
        with self._lock:
            held, todo = self._held[tier], self._pending[tier]
            for (key, since), hit in zip(pending, found, strict=True):
                if hit:
                    todo.pop(key, None)
                    if key not in held:
                        held[key] = None
                        self._out.append(TierEvent(True, tier, key.chunk_hash))
                    else:
                        held.move_to_end(key)
                elif not wait or now - since > PENDING_S:
                    todo.pop(key, None)  # refused (full) or dropped: never stored
            while len(held) > self.max_chunks:  # forget the oldest: announce it gone
                key, _ = held.popitem(last=False)
                self._out.append(TierEvent(False, tier, key.chunk_hash))

    def _no_answer(self, tier: str) -> None:
        """A tier that faults or times out is asked again after a growing delay (up to 30 s)."""
        delay = min(30.0, max(self.interval_s, 2 * self._backoff.get(tier, (0.0, 0.0))[1]))
        self._backoff[tier] = (time.monotonic() + delay, delay)

    def _sweep(self, tier: str, keys: list[CacheKey]) -> None:
        for i in range(0, len(keys), SWEEP_BATCH):
            part = keys[i:i + SWEEP_BATCH]
            found = self.storage.holds(tier, part)
            if found is None:
                with self._lock:
                    self._dirty.add(tier)  # unknown: sweep again later
                self._no_answer(tier)
                return
            with self._lock:
                held = self._held[tier]
                for key, hit in zip(part, found, strict=True):
                    if not hit and key in held and key not in self._pending[tier]:
                        del held[key]
                        self._out.append(TierEvent(False, tier, key.chunk_hash))


# -- scheduler side ------------------------------------------------------------------------------
@dataclass
class ChunkBlocks:
    """The vLLM blocks of one chunk, as vLLM's own ``BlockStored`` describes them."""

    hashes: list[Any]  # vLLM's block hashes (bytes, or ints with VLLM_KV_EVENTS_USE_INT_...)
    parent: Any | None  # the block hash before the chunk (None for the first chunk)
    tokens: array  # token ids of the chunk's blocks (compact)
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None


def chunk_blocks(request: Request, start: int, end: int, block_size: int) -> ChunkBlocks | None:
    """The blocks covering tokens ``[start, end)`` (block aligned) of ``request``; None when
    vLLM has not hashed them (only full blocks have hashes)."""
    first, last = start // block_size, end // block_size
    hashes = request.block_hashes
    if last <= first or len(hashes) < last:
        return None
    extra: list[tuple[Any, ...] | None] = []
    mm_idx = 0
    for b in range(first, last):
        keys, mm_idx = generate_block_hash_extra_keys(request, b * block_size,
                                                      (b + 1) * block_size, mm_idx)
        extra.append(keys)
    lora = getattr(request, "lora_request", None)
    return ChunkBlocks(
        hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
        parent=maybe_convert_block_hash(hashes[first - 1]) if first else None,
        tokens=array("q", request.all_token_ids[first * block_size:last * block_size]),
        lora_id=lora.adapter_id if lora is not None else None,
        lora_name=lora.name if lora is not None else None,
        extra_keys=to_event_extra_keys(extra) if any(e is not None for e in extra) else None,
    )


class TierEventBook:
    """Scheduler side: worker news -> vLLM ``BlockStored``/``BlockRemoved`` (module docstring)."""

    def __init__(self, block_size: int, chunk_size: int, num_workers: int,
                 max_chunks: int = 16384, groups: Sequence[dict[str, Any]] = ()) -> None:
        self.bs, self.cs = block_size, chunk_size
        #: per KV cache group holding every block of a stored chunk, the fields saying which
        #: group and what kind of KV (``compat.event_group_fields``): one event per group
        self.groups = list(groups) or [{"group_idx": 0}]
        self.num_workers = num_workers
        self.max_chunks = max_chunks
        self._named: OrderedDict[bytes, ChunkBlocks] = OrderedDict()  # not announced anywhere
        self._live: dict[bytes, ChunkBlocks] = {}  # announced in some tier
        self._ranks: Counter[tuple[str, bytes]] = Counter()  # ranks holding (tier, chunk)
        self._announced: set[tuple[str, bytes]] = set()
        self._refs: dict[str, Counter[Any]] = {}  # tier -> block hash -> chunks covering it
        self._events: list[KVCacheEvent] = []
        self.unnamed = 0  # news about chunks the scheduler never named (or forgot): dropped

    def record(self, request: Request, start: int, end: int, hashes: Sequence[bytes]) -> None:
        """Remember the blocks of the chunks covering ``[start, end)`` (``start`` chunk aligned;
        chunk ``i`` is named ``hashes[i]``): a save or a load the scheduler just planned."""
        for i, h in enumerate(hashes):
            if h in self._live or h in self._named:
                continue
            s = start + i * self.cs
            e = min(s + self.cs, end) // self.bs * self.bs
            blocks = chunk_blocks(request, s, e, self.bs)
            if blocks is None:
                continue
            self._named[h] = blocks
            while len(self._named) > self.max_chunks:
                self._named.popitem(last=False)

    def add(self, news: Any) -> None:
        """Fold a step's worker news (``KVConnectorOutput.kv_cache_events``)."""
        if not isinstance(news, KVPlugKVEvents):
            return
        for ev in news.get_all_events():
            if not isinstance(ev, TierEvent):
                continue
            slot = (ev.tier, ev.chunk_hash)
            before = self._ranks[slot]
            now = min(self.num_workers, before + 1) if ev.stored else max(0, before - 1)
            if now:
                self._ranks[slot] = now
            else:
                self._ranks.pop(slot, None)
            if ev.stored and now == self.num_workers and slot not in self._announced:
                self._announce(slot)
            elif not ev.stored and slot in self._announced:
                self._withdraw(slot)

    def _blocks(self, chunk_hash: bytes) -> ChunkBlocks | None:
        blocks = self._live.get(chunk_hash)
        if blocks is None:
            blocks = self._named.pop(chunk_hash, None)
            if blocks is not None:
                self._live[chunk_hash] = blocks
        return blocks

    def _announce(self, slot: tuple[str, bytes]) -> None:
        tier, chunk = slot
        b = self._blocks(chunk)
        if b is None:
            self.unnamed += 1
            return
        self._announced.add(slot)
        refs = self._refs.setdefault(tier, Counter())
        run: list[int] = []
        for i, h in enumerate(b.hashes):
            refs[h] += 1
            if refs[h] == 1:
                if run and run[-1] != i - 1:
                    self._stored(tier, b, run)
                    run = []
                run.append(i)
        if run:
            self._stored(tier, b, run)

    def _stored(self, tier: str, b: ChunkBlocks, idx: list[int]) -> None:
        lo, hi = idx[0], idx[-1] + 1
        self._events.extend(BlockStored(
            block_hashes=b.hashes[lo:hi],
            parent_block_hash=b.hashes[lo - 1] if lo else b.parent,
            token_ids=b.tokens[lo * self.bs:hi * self.bs].tolist(),
            block_size=self.bs,
            lora_id=b.lora_id,
            medium=tier,
            lora_name=b.lora_name,
            extra_keys=b.extra_keys[lo:hi] if b.extra_keys is not None else None,
            **group,
        ) for group in self.groups)

    def _withdraw(self, slot: tuple[str, bytes]) -> None:
        tier, chunk = slot
        self._announced.discard(slot)
        b = self._live.get(chunk)
        if b is None:
            return
        refs = self._refs.get(tier, Counter())
        gone = []
        for h in b.hashes:
            refs[h] -= 1
            if refs[h] <= 0:
                del refs[h]
                gone.append(h)
        if gone:
            self._removed(gone, tier)
        if not any((t, chunk) in self._announced for t in self._refs):
            self._named[chunk] = self._live.pop(chunk)  # may be announced again; bounded there
            while len(self._named) > self.max_chunks:
                self._named.popitem(last=False)

    def _removed(self, hashes: list[Any], tier: str) -> None:
        self._events.extend(BlockRemoved(block_hashes=hashes, medium=tier,
                                         group_idx=g.get("group_idx", 0)) for g in self.groups)

    def reset(self) -> None:
        """A new weights epoch: nothing in the tiers is servable to this engine any more, so
        every block announced is withdrawn (``BlockRemoved`` per tier) and the book starts over."""
        for tier, refs in self._refs.items():
            if refs:
                self._removed(list(refs), tier)
        self._named.clear()
        self._live.clear()
        self._ranks.clear()
        self._announced.clear()
        self._refs.clear()

    def take(self) -> list[KVCacheEvent]:
        """vLLM's ``take_events``: the events since the last call, in order."""
        out, self._events = self._events, []
        return out
