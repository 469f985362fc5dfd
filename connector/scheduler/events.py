"""KV events for KV-aware routers: ``BlockStored``/``BlockRemoved`` for what enters and leaves
kvplug's tiers, published through vLLM's own event publisher (``--kv-events-config``).

Two halves, one per side of the connector:

* worker (:mod:`..worker.tier_watch`): :class:`~..worker.tier_watch.TierWatch` learns which
  chunks each tier took and lost, off vLLM's step, and hands each step's news to vLLM in a
  :class:`~..protocol.metadata.KVPlugKVEvents` (``get_kv_connector_kv_cache_events``).
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

Tenants: a request with a ``cache_salt`` asked to be kept apart, and anyone who can subscribe to
the event endpoint reads what the events carry. For such a request the salt and its multimodal
identifiers (content hashes, which confirm a guessed image) are replaced by a keyed hash,
``kvplug-hmac:<hex>`` (BLAKE2b keyed by :func:`event_key`: the same salt gives the same value
across a deployment that shares ``auth_key_env``, a value per process otherwise), and its token
ids are left out (an empty list; ``kv_events_salted_tokens: true`` keeps them). vLLM's block
hashes are unchanged, so a router matches blocks as before. A request without a salt is
described as vLLM's own events describe it: it shares with every other salt-less request anyway.
vLLM's own events for the GPU (``medium`` GPU) are vLLM's and still carry bare salts and token
ids: bind ``--kv-events-config``'s endpoint to loopback (README, multi-tenant section).

Bounded: each tier tracks at most ``kv_events_max_chunks`` chunks (past it the oldest is announced
as removed and forgotten: a router loses a possible hit, never gains a false one); the book keeps
the blocks of at most that many chunks it has not announced.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvplug.chunkfile.auth import decode_secret, subkey
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ..protocol.metadata import KVPlugKVEvents, TierEvent

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("kvplug.connector")


def events_enabled(vllm_config: Any, kv_events: bool) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``) and kvplug's switch is on."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(kv_events and cfg is not None and cfg.enable_kv_cache_events)


@dataclass
class ChunkBlocks:
    """The vLLM blocks of one chunk, as vLLM's own ``BlockStored`` describes them."""

    hashes: list[Any]  # vLLM's block hashes (bytes, or ints with VLLM_KV_EVENTS_USE_INT_...)
    parent: Any | None  # the block hash before the chunk (None for the first chunk)
    tokens: array  # token ids of the chunk's blocks (compact)
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None


def event_key(cfg: Any = None) -> bytes:
    """The key of the salts' hashes in events: derived from the deployment secret named by
    ``auth_key_env`` when the config has one (every engine of the deployment agrees; an unset or
    short secret already stopped the engine at start-up), else drawn per process."""
    name = getattr(cfg, "auth_key_env", None)
    if name and os.environ.get(name):
        return subkey(decode_secret(name), b"kvplug-events")
    return os.urandom(32)


def _veil(keys: tuple[Any, ...] | None, key: bytes) -> tuple[Any, ...] | None:
    """vLLM's tagged extra keys of a salted request's block, its salt and multimodal
    identifiers replaced by keyed hashes (module docstring)."""
    if keys is None:
        return None

    def digest(value: Any) -> str:
        mac = hashlib.blake2b(str(value).encode(), key=key, digest_size=16)
        return "kvplug-hmac:" + mac.hexdigest()

    out: list[Any] = []
    for k in keys:
        if k[0] == "cache_salt":
            k = (k[0], digest(k[1]))
        elif k[0] == "mm":
            k = (k[0], digest(k[1]), *k[2:])
        out.append(k)
    return tuple(out)


def chunk_blocks(request: Request, start: int, end: int, block_size: int,
                 salt_key: bytes | None = None, salted_tokens: bool = False
                 ) -> ChunkBlocks | None:
    """The blocks covering tokens ``[start, end)`` (block aligned) of ``request``; None when
    vLLM has not hashed them (only full blocks have hashes). A salted request's salt and
    multimodal ids are hashed with ``salt_key`` (a fresh key when None) and its token ids left
    out unless ``salted_tokens`` (module docstring)."""
    first, last = start // block_size, end // block_size
    hashes = request.block_hashes
    if last <= first or len(hashes) < last:
        return None
    salted = bool(getattr(request, "cache_salt", None))
    key = (salt_key or os.urandom(32)) if salted else b""
    extra: list[tuple[Any, ...] | None] = []
    mm_idx = 0
    for b in range(first, last):
        keys, mm_idx = generate_block_hash_extra_keys(request, b * block_size,
                                                      (b + 1) * block_size, mm_idx)
        extra.append(_veil(keys, key) if salted else keys)
    lora = getattr(request, "lora_request", None)
    shown = not salted or salted_tokens
    return ChunkBlocks(
        hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
        parent=maybe_convert_block_hash(hashes[first - 1]) if first else None,
        tokens=array("q", request.all_token_ids[first * block_size:last * block_size]
                     if shown else ()),
        lora_id=lora.adapter_id if lora is not None else None,
        lora_name=lora.name if lora is not None else None,
        extra_keys=to_event_extra_keys(extra) if any(e is not None for e in extra) else None,
    )


class TierEventBook:
    """Scheduler side: worker news -> vLLM ``BlockStored``/``BlockRemoved`` (module docstring)."""

    def __init__(self, block_size: int, chunk_size: int, num_workers: int,
                 max_chunks: int = 16384, groups: Sequence[dict[str, Any]] = (),
                 salt_key: bytes | None = None, salted_tokens: bool = False) -> None:
        self.block_size, self.chunk_size = block_size, chunk_size
        #: the key of salted requests' hashed salts and multimodal ids (:func:`event_key`)
        self.salt_key = salt_key or event_key()
        self.salted_tokens = salted_tokens  # a salted request's token ids in its events
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
        self.stale = 0  # news about keys of another weights epoch than the scheduler's: dropped

    def record(self, request: Request, start: int, end: int, hashes: Sequence[bytes]) -> None:
        """Remember the blocks of the chunks covering ``[start, end)`` (``start`` chunk aligned;
        chunk ``i`` is named ``hashes[i]``): a save or a load the scheduler just planned."""
        for i, h in enumerate(hashes):
            if h in self._live or h in self._named:
                continue
            s = start + i * self.chunk_size
            e = min(s + self.chunk_size, end) // self.block_size * self.block_size
            blocks = chunk_blocks(request, s, e, self.block_size, self.salt_key, self.salted_tokens)
            if blocks is None:
                continue
            self._named[h] = blocks
            while len(self._named) > self.max_chunks:
                self._named.popitem(last=False)

    def add(self, news: Any, epoch: str = "") -> None:
        """Fold a step's worker news (``KVConnectorOutput.kv_cache_events``) while the scheduler
        is on weights ``epoch``. News about another epoch's keys is dropped: a step's news can
        reach the book after :meth:`reset` (asynchronous scheduling hands vLLM a step's output
        after the next step ran), and counted there, a rank's news about its old key and then
        about its new one (same chunk hash) would stand for two ranks."""
        if not isinstance(news, KVPlugKVEvents):
            return
        for ev in news.get_all_events():
            if not isinstance(ev, TierEvent):
                continue
            if ev.epoch != epoch:
                self.stale += 1
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
            token_ids=b.tokens[lo * self.block_size:hi * self.block_size].tolist(),  # empty: a salted request
            block_size=self.block_size,
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
