"""Scheduler-side decisions: what is stored (lookup), what to load, what to store, per request.

Runs in vLLM's engine-core process. It never touches KV bytes: it hashes token chunks, asks the
workers' lookup services how many leading tokens are stored, and turns vLLM's scheduling decisions
into per-step :class:`~kvplug.connector.metadata.ReqMeta` (load and save specs) for the workers.

Save policy: chunks known to be stored (the lookup hit) are skipped; a prompt's last, partial chunk
is stored only with ``save_partial_chunk`` (or the producer role), block aligned; KV produced while
decoding only with ``save_decode``; a request opts out with ``kv_transfer_params={"kvplug_save":
False}`` (and ``"kvplug_load": False`` skips the lookup). Roles: ``kv_consumer`` never stores,
``kv_producer`` never loads and stores everything it computes.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from kvplug.tokens import TokenDatabase

from .config import ConnectorConfig
from .metadata import KVPlugMetadata, KVPlugWorkerMeta, LoadSpec, ReqMeta, SaveSpec
from .stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvplug.connector")


class LookupFn(Protocol):
    def lookup(self, req_id: str, hashes: list[bytes], tails: list[tuple[int, bytes]]
               ) -> int | None: ...  # None: not answered yet, ask again

    def release(self, req_ids: list[str]) -> None: ...


def _embeds_digest(request: Request, start: int, end: int) -> bytes | None:
    """sha256 of the prompt embeddings of tokens ``[start, end)`` (None past them or without)."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None or start >= len(embeds):
        return None
    part = embeds[start:end].detach().contiguous().cpu()
    head = f"{part.dtype}{tuple(part.shape)}".encode()
    return hashlib.sha256(head + part.view(-1).view(torch.uint8).numpy().tobytes()).digest()


def chunk_extra_keys(request: Request, start: int, end: int) -> tuple | None:
    """What besides the tokens identifies tokens ``[start, end)``: the multimodal inputs
    overlapping them (so two images behind the same placeholder tokens never share an entry), the
    LoRA adapter (name and path, as vLLM's own block hash), the prompt embeddings (their
    positions hold placeholder ids), and the cache salt (first chunk only)."""
    keys: list[tuple] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    if (embeds := _embeds_digest(request, start, end)) is not None:
        keys.append(("prompt_embeds", embeds))
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        if pos.offset < end and pos.offset + pos.length > start:
            keys.append(("mm", f.identifier, pos.offset - start))
    salt = getattr(request, "cache_salt", None)
    if start == 0 and salt:
        keys.append(("salt", salt))
    return tuple(keys) or None


@dataclass
class RequestTracker:
    """What the scheduler side remembers about one live request."""

    request: Request
    prompt_len: int
    can_load: bool
    can_save: bool
    hashes: list[bytes] = field(default_factory=list)  # full-chunk hashes computed so far
    lookup_tokens: int = 0  # last lookup's hit (tokens stored, counted from 0)
    stored_tokens: int = 0  # [0, stored_tokens) is in storage or being stored (chunk aligned)
    partial_saved: bool = False
    pending_load: LoadSpec | None = None
    asking: bool = False  # a lookup is in flight (answered None)
    block_ids: list[int] = field(default_factory=list)  # fallback when vLLM gives no block state
    report: dict[str, Any] = field(default_factory=dict)  # returned in kv_transfer_params


class SchedulerSide:
    """The scheduler half of :class:`~kvplug.connector.KVPlugConnector`."""

    def __init__(
        self, config: ConnectorConfig, block_size: int, role: str, lookup: LookupFn
    ) -> None:
        if config.chunk_size % block_size:
            raise ValueError(f"kvplug chunk_size={config.chunk_size} must be a multiple of vLLM's "
                             f"block_size={block_size}")
        self.cfg = config
        self.cs = config.chunk_size
        self.db = TokenDatabase(config.chunk_size)
        self.bs = block_size
        self.role = role
        self.lookup = lookup
        self.stats = StatsRecorder()
        self.trackers: dict[str, RequestTracker] = {}

    # -- hashing (kvplug.tokens.TokenDatabase: vLLM's sha256_cbor block hash over chunks) --------
    def _full_hashes(self, t: RequestTracker, num_chunks: int) -> list[bytes]:
        """The chained hashes of the first ``num_chunks`` full chunks (cached per request)."""
        return self.db.extend_hashes(t.request.all_token_ids, t.hashes, num_chunks,
                                     extra_keys=partial(chunk_extra_keys, t.request))

    def _partial_hash(self, t: RequestTracker, end: int) -> bytes:
        """The hash of the partial chunk ending at ``end`` (not chunk aligned)."""
        return self.db.partial_hash(t.request.all_token_ids, end, t.hashes,
                                    extra_keys=partial(chunk_extra_keys, t.request))

    def _hashes_for(self, t: RequestTracker, start: int, end: int) -> list[bytes]:
        """Hashes of the chunks covering ``[start, end)``; a last chunk ending early is partial."""
        full = self._full_hashes(t, end // self.cs)[start // self.cs:]
        if end % self.cs:
            full = [*full, self._partial_hash(t, end)]
        return full

    # -- vLLM hooks ----------------------------------------------------------------------------
    def _track(self, request: Request) -> RequestTracker:
        t = self.trackers.get(request.request_id)
        if t is None:
            params: dict[str, Any] = request.kv_transfer_params or {}
            keyed = request.prompt_token_ids is not None  # prompt embeddings are not cached
            t = RequestTracker(
                request=request,
                prompt_len=request.num_prompt_tokens,
                can_load=keyed and self.role != "kv_producer"
                and bool(params.get("kvplug_load", True)),
                can_save=keyed and self.role != "kv_consumer"
                and bool(params.get("kvplug_save", True)),
            )
            self.trackers[request.request_id] = t
        return t

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Stored leading tokens beyond ``num_computed_tokens``; loads are synchronous.
        ``(None, False)`` while the workers have not answered: vLLM skips the request this step
        and asks again, and the lookup goes on meanwhile (the scheduler never waits on a tier).

        The hit is capped so at least one token is left to compute (vLLM needs a token to run)
        and stays chunk aligned (block aligned for a stored partial chunk). Repeated calls repeat
        the lookup, replacing the request's pins; nothing accumulates.
        """
        t = self._track(request)
        t.lookup_tokens = 0
        t.pending_load = None
        if not t.can_load:
            return 0, False
        cap = (request.num_tokens - 1) // self.bs * self.bs
        if cap <= num_computed_tokens and not t.can_save:
            return 0, False  # vLLM holds it all; a lookup would only say what not to store again
        full = cap // self.cs
        hashes = self._full_hashes(t, full)
        tails = [(full * self.cs + m * self.bs, b"")
                 for m in range((cap - full * self.cs) // self.bs, 0, -1)]
        tails = [(end, self._partial_hash(t, end)) for end, _ in tails]
        timeouts = getattr(self.lookup, "timeouts", 0)
        found = self.lookup.lookup(request.request_id, hashes, tails)
        if (late := getattr(self.lookup, "timeouts", 0) - timeouts) > 0:
            self.stats.add("lookup_timeouts", late)
        if found is None and cap <= num_computed_tokens:
            # vLLM's own cache holds the prompt: this lookup only spares a second copy, and never
            # holds the request back (its pins are dropped; the chunks may be stored again).
            self.lookup.release([request.request_id])
            return 0, False
        t.asking = found is None
        if found is None:
            return None, False
        hit = min(found, cap)
        t.lookup_tokens = hit
        if cap > num_computed_tokens:  # a lookup that cannot load is no query for the hit rate
            self.stats.add("lookups")
            self.stats.add("lookup_query_tokens", cap)
            self.stats.add("lookup_hit_tokens", hit)
        if hit <= num_computed_tokens:
            return 0, False
        return hit - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of the external tokens vLLM accepted, into the blocks it allocated."""
        t = self.trackers.get(request.request_id)
        if t is None:
            return
        t.block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        hit = t.lookup_tokens
        # What lookup found is in storage: never store it again.
        t.stored_tokens = max(t.stored_tokens, hit // self.cs * self.cs)
        if hit % self.cs and hit >= t.prompt_len // self.bs * self.bs:
            t.partial_saved = True
        if num_external_tokens > 0:
            start = hit - num_external_tokens
            first = start // self.cs
            t.pending_load = LoadSpec(start, hit, first, self._hashes_for(t, first * self.cs, hit))
            t.report["promised_tokens"] = num_external_tokens
        elif hit:  # a hit vLLM did not take (e.g. prompt logprobs): drop its pins now
            self.lookup.release([request.request_id])

    def _save_spec(self, t: RequestTracker, num_scheduled: int) -> SaveSpec | None:
        r = t.request
        computed_after = r.num_computed_tokens + num_scheduled
        limit = r.num_tokens if self.cfg.save_decode else t.prompt_len
        full_end = min(computed_after, limit) // self.cs * self.cs
        start, end = t.stored_tokens, t.stored_tokens
        if full_end > start:
            end = full_end
        partial = (self.cfg.save_partial_chunk or self.role == "kv_producer")
        if partial and not t.partial_saved and computed_after >= t.prompt_len \
                and end == t.prompt_len // self.cs * self.cs:
            t.partial_saved = True
            pend = t.prompt_len // self.bs * self.bs
            if pend > end:
                end = pend
        if end <= start:
            return None
        t.stored_tokens = end // self.cs * self.cs
        return SaveSpec(start, end, start // self.cs, self._hashes_for(t, start, end))

    def build_connector_meta(self, so: SchedulerOutput) -> KVPlugMetadata:
        """One ReqMeta per scheduled request that loads or stores something this step."""
        meta = KVPlugMetadata(chunk_size=self.cs, block_size=self.bs)
        self._follow_blocks(so)
        state = getattr(so, "kv_connector_block_state", None)
        for req_id, n in so.num_scheduled_tokens.items():
            t = self.trackers.get(req_id)
            if t is None:
                continue
            load, t.pending_load = t.pending_load, None
            save = self._save_spec(t, n) if t.can_save else None
            if load is None and save is None:
                continue
            groups = state.get_block_ids(req_id) if state is not None else None
            block_ids = list(groups[0]) if groups else list(t.block_ids)
            meta.requests.append(ReqMeta(req_id, block_ids, load, save))
        return meta

    def _follow_blocks(self, so: SchedulerOutput) -> None:
        """Keep each tracker's block table current from the scheduler output (fallback path)."""
        for nr in so.scheduled_new_reqs:
            if (t := self.trackers.get(nr.req_id)) is not None:
                t.block_ids = list(nr.block_ids[0])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.trackers.get(req_id)
            new = cached.new_block_ids[i]
            if t is None or new is None:
                continue
            if req_id in cached.resumed_req_ids:
                t.block_ids = list(new[0])
            else:
                t.block_ids.extend(new[0])

    def update_connector_output(self, meta: KVPlugWorkerMeta | None) -> None:
        """Fold the workers' per-request load results into the trackers."""
        if not isinstance(meta, KVPlugWorkerMeta):
            return
        for req_id, tiers in meta.loaded.items():
            if (t := self.trackers.get(req_id)) is not None:
                rep = t.report
                rep["loaded_tokens"] = rep.get("loaded_tokens", 0) + sum(tiers.values())
                for tier, n in tiers.items():
                    rep.setdefault("tiers", {})[tier] = rep.get("tiers", {}).get(tier, 0) + n
                rep["load_ms"] = round(rep.get("load_ms", 0.0) + meta.load_ms.get(req_id, 0), 3)
        for req_id, n in meta.failed_blocks.items():
            if (t := self.trackers.get(req_id)) is not None:
                t.report["failed_blocks"] = t.report.get("failed_blocks", 0) + n

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request (the workers drop its pins); return what kvplug did for it, which
        vLLM hands back to the caller as ``kv_transfer_params["kvplug"]`` when
        ``report_to_client`` is on (off: every API client would learn what others cached)."""
        t = self.trackers.pop(request.request_id, None)
        if t is not None and t.asking:  # finished (aborted) while its lookup was in flight
            self.lookup.release([request.request_id])
        if t is None or not self.cfg.report_to_client:
            return None
        rep = {"lookup_hit_tokens": t.lookup_tokens, "loaded_tokens": 0, "tiers": {},
               "load_ms": 0.0, "failed_blocks": 0, "stored_tokens": t.stored_tokens, **t.report}
        return {"kvplug": rep}
