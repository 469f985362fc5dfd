"""Scheduler-side decisions: what is stored (lookup), what to load, what to store, per request.

Runs in vLLM's engine-core process. It never touches KV bytes: it hashes token chunks, asks the
workers' lookup services how many leading tokens are stored, and turns vLLM's scheduling decisions
into per-step :class:`~kvplug.connector.protocol.metadata.ReqMeta` (load and save specs) for the workers.

Save policy: chunks known to be stored (the lookup hit) are skipped. Hits are block granular: with
``save_partial_chunk`` (default) a block-aligned partial chunk is stored where vLLM's own prefix
cache would stop reusing the prompt (``(len - 1) // block * block``), and, at request end, one at
the last full block of prompt+answer (the next turn of a chat starts with it; vLLM frees the
blocks once the workers report that save done). KV produced while decoding is stored with
``save_decode`` (default). A request opts out with ``kv_transfer_params={"kvplug_save": False}``
(and ``"kvplug_load": False`` skips the lookup). Roles: ``kv_consumer`` never stores,
``kv_producer`` never loads and stores everything it computes.

Lookup: the full chunks, then the block ends inside the chunk after the last full one; when a
full chunk is missing (turn N+1 of a chat has a full chunk where turn N stored a partial one), a
second lookup tries the block ends inside that chunk.

Speculative drafters that read the target's hidden states (EAGLE, MTP; ``drop_last_block``):
the drafter's KV at a position is computed with the token after it, which the stored range's
key does not cover, so, as vLLM does for its own prefix cache, the last block of a hit is not
loaded (vLLM recomputes it; its chunk is fetched and only the blocks before it written), and
while a request decodes its KV is stored only one block behind what is computed (the drafter
may still rewrite the last accepted position); at the request's end the rest is stored.

In-step loads (a hit in L1, or a small one on a local disk, written inside the step that uses
it) are only safe where vLLM cannot run a step before the previous step's output is processed.
Its engine core keeps a batch queue of ``max_concurrent_batches`` steps: under asynchronous
scheduling (on by default where supported) and under pipeline parallelism (the plain Scheduler
with a queue as deep as the pipeline) step N+1 is scheduled and run before step N's output, and
its load errors, reach the scheduler. A synchronous load that fails in step N is then read by
N+1 over the unloaded blocks (and stored from them), and vLLM's recompute rolls the request
back without dropping N+1's sampled token: a wrong token would be served. So every load is a
background one there (``runs_ahead``, :func:`..compat.runs_ahead`): the request waits in
``WAITING_FOR_REMOTE_KVS`` and is not scheduled until vLLM has taken the load's result, errors
included. Found by the simulation (seed 107; pipeline parallelism: its batch-queue kind).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from kvplug.logs import LogOnce
from kvplug.policies.tenants import tenant_id
from kvplug.storage_manager import auth_keyring
from kvplug.tokens import TokenDatabase

from ..protocol.config import ConnectorConfig
from ..protocol.groups import GroupLayout
from ..protocol.identity import chunk_extra_keys
from ..protocol.metadata import KVPlugMetadata, KVPlugWorkerMeta, LoadSpec, ReqMeta, SaveSpec
from ..protocol.stats import StatsRecorder
from . import handoff
from .handoff import HandoffWait
from .tenants import TenantGate
from .unwritten import UnwrittenBlocks

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvplug.connector")


@dataclass
class RequestTracker:
    """What the scheduler side remembers about one live request."""

    request: Request
    prompt_len: int
    can_load: bool
    can_save: bool
    hashes: list[bytes] = field(default_factory=list)  # full-chunk hashes computed so far
    lookup_tokens: int = 0  # last lookup's hit (tokens stored, counted from 0)
    usable_tokens: int = 0  # of it, what vLLM is told (less the last block: drop_last_block)
    stored_chunk_end: int = 0  # [0, stored_chunk_end) is stored or being stored (chunk aligned)
    stored_block_end: int = 0  # [0, stored_block_end) likewise, to a block (may end in a chunk)
    refine: tuple[int, int] | None = None  # (num_tokens, chunk) of a second lookup not answered
    pending_load: LoadSpec | None = None
    load_background: bool = False  # the last lookup's hit needs a tier that may block
    slow_chunks: frozenset[int] = frozenset()  # the last hit's chunks only a blocking tier holds
    asking: bool = False  # a lookup is in flight (answered None)
    sent_save: bool = False  # a save went to the workers (async saves: blocks held at finish)
    block_ids: list[int] = field(default_factory=list)  # fallback when vLLM gives no block state
    tables: tuple[list[int], ...] = ()  # every KV cache group's block table (hybrid models)
    report: dict[str, Any] = field(default_factory=dict)  # returned in kv_transfer_params
    #: its KV may predate a weights reset: no load nor store until it starts over (see reset)
    stale: bool = False
    #: its tenant id (of its cache_salt only; hashed: never the salt)
    tenant: str = ""
    #: a consumer's wait for the chunks a producer's hand-off named (.handoff)
    handoff: HandoffWait | None = None


class LookupFn(Protocol):
    """The workers' lookup as the scheduler side asks it (across processes:
    :class:`~kvplug.connector.protocol.lookup.LookupClient`). :meth:`lookup` and :meth:`release`
    are required; every other member is optional, with the default declared here, which a
    lookup deriving from this class inherits and :func:`lookup_member` applies to one that does
    not (a stand-in with only the two)."""

    #: Lookups so far that ended because a rank did not answer in time. Default 0: never.
    timeouts: int = 0

    def lookup(self, req_id: str, hashes: list[bytes], tails: list[tuple[int, bytes]],
               tenant: str = "", fresh: bool = False) -> int | None:
        """Leading stored tokens of ``hashes`` (full chunks), then of ``tails`` (``(end, hash)``
        of partial chunks, longest first), pinned until :meth:`release`; ``None``: not answered
        yet, ask again. ``fresh``: the tiers forget the misses they remember of these chunks."""
        ...

    def release(self, req_ids: list[str]) -> None:
        """Drop what these requests' lookups hold (their pins, a lookup still in flight)."""
        ...

    def set_epoch(self, epoch: str) -> None:
        """Look up under the weights epoch ``epoch`` from now on. Default: nothing (a lookup
        whose keys carry no epoch)."""

    def take_slow(self, req_id: str) -> Collection[int]:
        """The chunks of ``req_id``'s last answered lookup that only a tier that may block
        holds: loaded in the background. Default: none."""
        return ()

    def take_local(self, req_id: str) -> Collection[int]:
        """The chunks of ``req_id``'s last answered lookup that only a local medium holds:
        loaded inside the step while its budget lasts. Default: none."""
        return ()


_ABSENT = object()


def lookup_member(lookup: object, name: str) -> Any:
    """``lookup``'s optional member ``name`` (:class:`LookupFn`), or the default declared there
    where ``lookup`` leaves it out."""
    member = getattr(lookup, name, _ABSENT)
    if member is not _ABSENT:
        return member
    default = getattr(LookupFn, name)
    return default.__get__(lookup) if callable(default) else default



class SchedulerSide:
    """The scheduler half of :class:`~kvplug.connector.KVPlugConnector`."""

    def __init__(
        self, config: ConnectorConfig, block_size: int, role: str, lookup: LookupFn,
        layout: GroupLayout | None = None, drop_last_block: bool = False,
        runs_ahead: str | None = None, keys_digest: str = "",
    ) -> None:
        self.layout = layout or GroupLayout()  # KV cache groups (..protocol.groups)
        if config.chunk_size % block_size and self.layout.servable:
            raise ValueError(f"kvplug chunk_size={config.chunk_size} must be a multiple of vLLM's "
                             f"block_size={block_size}")
        self.cfg = config
        self.chunk_size = config.chunk_size
        self.token_db = TokenDatabase(config.chunk_size)
        self.block_size = block_size
        #: an EAGLE/MTP drafter: the last block of a hit is recomputed (module docstring)
        self.drop_last_block = drop_last_block
        #: why vLLM may run a step before the previous step's output is processed (its batch
        #: queue: asynchronous scheduling, pipeline parallelism), or None: then every load is a
        #: background one (module docstring)
        self.runs_ahead = runs_ahead
        if layout is None or layout.servable:
            logger.info("kvplug: %s", f"every load in the background: vLLM runs steps ahead of "
                        f"their outputs ({runs_ahead})" if runs_ahead else
                        "hits in RAM (and small ones on a local disk) load inside the engine step: "
                        "vLLM processes each step's output before the next step runs")
        self.role = role
        self.lookup = lookup
        self.stats = StatsRecorder()
        #: requests that may not use the cache at all (require_cache_salt, multimodal ids)
        self.tenants = TenantGate(config.require_cache_salt, self.stats)
        #: tenant ids are keyed by the deployment secret when there is one (as the workers' are)
        self._auth = auth_keyring(config)
        self.trackers: dict[str, RequestTracker] = {}
        self._background: list[str] = []  # requests whose background load starts this step
        self._in_step_spent = 0  # this step's bytes of local-medium hits loaded in the step
        self._finishing: list[ReqMeta] = []  # saves of finished requests (see finish_save)
        #: finished requests whose blocks vLLM keeps until the workers report their saves done
        self.held: set[str] = set()
        #: blocks a failed load left unwritten, followed until a step writes them
        self.unwritten = UnwrittenBlocks(block_size)
        #: told of every chunk planned for a load or a save: (request, start, end, hashes)
        self.on_chunks: Callable[[Request, int, int, list[bytes]], None] | None = None
        #: the weights epoch keys are made under ("": the weights on disk); see :meth:`reset`
        self.epoch = ""
        self.draw_epoch: Callable[[], str] = partial(secrets.token_hex, 8)  # a fresh epoch
        #: what this engine's keys are made of (..protocol.identity.keys_digest): a producer
        #: names it in its hand-offs, a consumer waits only for hand-offs naming its own
        self.keys_digest = keys_digest
        self.clock: Callable[[], float] = time.monotonic  # hand-off waits
        self._handoff_log = LogOnce(logger)
        if config.fresh_epoch_at_start:
            self._new_epoch("start-up (fresh_epoch_at_start)")

    # -- weights epoch -------------------------------------------------------------------------
    def _new_epoch(self, why: str) -> None:
        self.follow_epoch(self.draw_epoch())
        logger.info("kvplug: weights epoch %s (%s): nothing stored before is served to this "
                    "engine; engines on the earlier weights keep their entries", self.epoch, why)

    def reset(self) -> None:
        """vLLM's ``reset_cache`` (``reset_prefix_cache(reset_connector=True)``, sleep, pause
        with ``clear_cache``): the weights changed. A fresh epoch goes into every later lookup
        and step, so no entry stored before is served again, on any tier. Requests alive now
        may hold KV of the old weights: they neither store nor load until vLLM starts them over
        (a new lookup); the stores of finished ones not yet sent are dropped (their blocks are
        still released as usual). Loads already sent under the old epoch fail at the workers."""
        self._new_epoch("reset_cache: the weights changed")
        self.stats.add("weight_resets")
        self.lookup.release(list(self.trackers))
        background = set(self._background)  # loads not sent yet: they go out under the new epoch
        for req_id, t in self.trackers.items():
            t.lookup_tokens, t.usable_tokens, t.refine, t.asking = 0, 0, None, False
            if req_id not in background:
                t.stale, t.pending_load = True, None
        for r in self._finishing:  # old weights' KV: nothing stored, the hold still released
            if r.save is not None:
                r.save = SaveSpec(r.save.start, r.save.start, r.save.first_chunk, [])

    # -- hashing (kvplug.tokens.TokenDatabase: vLLM's sha256_cbor block hash over chunks) --------
    def full_hashes(self, t: RequestTracker, num_chunks: int) -> list[bytes]:
        """The chained hashes of the first ``num_chunks`` full chunks (cached per request)."""
        return self.token_db.extend_hashes(t.request.all_token_ids, t.hashes, num_chunks,
                                           extra_keys=partial(chunk_extra_keys, t.request))

    def partial_hash(self, t: RequestTracker, end: int) -> bytes:
        """The hash of the partial chunk ending at ``end`` (not chunk aligned)."""
        return self.token_db.partial_hash(t.request.all_token_ids, end, t.hashes,
                                          extra_keys=partial(chunk_extra_keys, t.request))

    def _hashes_for(self, t: RequestTracker, start: int, end: int) -> list[bytes]:
        """Hashes of the chunks covering ``[start, end)``; a last chunk ending early is partial."""
        full = self.full_hashes(t, end // self.chunk_size)[start // self.chunk_size:]
        if end % self.chunk_size:
            full = [*full, self.partial_hash(t, end)]
        return full

    def prefix_hashes(self, t: RequestTracker, end: int
                      ) -> tuple[list[bytes], list[tuple[int, bytes]]]:
        """Every chunk a lookup of ``[0, end)`` may name: the full chunks' hashes, and
        ``(tokens, hash)`` of the partial chunk ending at each block end that is not a chunk end
        (the management API's per-tier lookup, clear and pin of a prompt)."""
        tails = [(e, self.partial_hash(t, e)) for e in range(self.block_size, end + 1, self.block_size)
                 if e % self.chunk_size]
        return self.full_hashes(t, end // self.chunk_size), tails

    # -- requests, tenants, epoch: also what the management API's own scheduler side uses ------
    def track(self, request: Request) -> RequestTracker:
        """The request's tracker, made on first sight (what it may load and store, its tenant
        id, a consumer's hand-off wait); the tracker caches the request's chunk hashes."""
        t = self.trackers.get(request.request_id)
        if t is None:
            t = RequestTracker(request=request, prompt_len=request.num_prompt_tokens,
                               can_load=False, can_save=False)
            self._allow(t)
            t.tenant = self._tenant_of(request)
            if self.role == "kv_consumer":
                self._handoff_receive(t)
            self.trackers[request.request_id] = t
        return t

    def forget(self, request_id: str) -> None:
        """Drop a request's pins and tracker (a lookup made only to answer a question, never
        followed by a step)."""
        self.lookup.release([request_id])
        self.trackers.pop(request_id, None)

    def tenant_id(self, salt: str) -> str:
        """The tenant id of the ``cache_salt`` ``salt``, as keys and the workers name it (keyed
        by the deployment secret when there is one; never the salt itself)."""
        return tenant_id(salt, self._auth)

    def follow_epoch(self, epoch: str) -> None:
        """Make later lookups under the weights epoch ``epoch`` (one the workers report): the
        management API's scheduler side follows the engine's instead of drawing its own."""
        self.epoch = epoch
        lookup_member(self.lookup, "set_epoch")(epoch)

    # -- vLLM hooks ----------------------------------------------------------------------------
    def _tenant_of(self, request: Request) -> str:
        """The request's tenant id: of its ``cache_salt`` only
        (:func:`kvplug.policies.tenants.tenant_id`), ``""`` without one. A tenant is never
        taken from ``kv_transfer_params``: a client could name another tenant there without its
        salt, charging and evicting that tenant's entries (or a fresh name, a fresh quota)."""
        salt = getattr(request, "cache_salt", None)
        return self.tenant_id(str(salt)) if salt else ""

    def _allow(self, t: RequestTracker) -> None:
        """What the request may do: load and store unless its role or its params say no."""
        params: dict[str, Any] = t.request.kv_transfer_params or {}
        # prompt embeddings are not cached; nor is a model with a group kvplug cannot restore,
        # nor a request that could share with another tenant (.tenants)
        keyed = t.request.prompt_token_ids is not None and self.layout.servable \
            and self.tenants.admits(t.request)
        t.can_load = keyed and self.role != "kv_producer" and bool(params.get("kvplug_load", True))
        t.can_save = keyed and self.role != "kv_consumer" and bool(params.get("kvplug_save", True))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Stored leading tokens beyond ``num_computed_tokens``, and whether vLLM loads them
        asynchronously (some chunk to load is only in a tier that may block). ``(None, False)``
        while the workers have not answered: vLLM skips the request this step and asks again,
        and the lookup goes on meanwhile (the scheduler never waits on a tier).

        The hit is capped so at least one token is left to compute (vLLM needs a token to run)
        and stays chunk aligned (block aligned for a stored partial chunk). Repeated calls repeat
        the lookup, replacing the request's pins; nothing accumulates.
        """
        t = self.track(request)
        if t.stale:  # asked again after a weights reset: it holds no KV of the old weights now
            t.stale, t.stored_chunk_end, t.stored_block_end = False, 0, 0
            self._allow(t)
        t.lookup_tokens = t.usable_tokens = 0
        t.pending_load = None
        t.load_background = False
        if not t.can_load:
            return 0, False
        cap = (request.num_tokens - 1) // self.block_size * self.block_size
        if cap <= num_computed_tokens and not t.can_save:
            return 0, False  # vLLM holds it all; a lookup would only say what not to store again
        if t.handoff is not None and self._handoff_later(t):
            return None, False  # the chunks a producer named: looked up again a little later
        full = cap // self.chunk_size
        hashes = self.full_hashes(t, full)
        n = t.refine[1] if t.refine is not None and t.refine[0] == request.num_tokens else full
        timeouts = lookup_member(self.lookup, "timeouts")
        found = self._ask(t, hashes[:n], cap)
        timed_out = lookup_member(self.lookup, "timeouts") > timeouts  # a late rank: no second ask
        if t.handoff is not None and self._handoff_pending(t, found, num_computed_tokens):
            return None, False  # not all of it stored yet: wait (.handoff)
        if found is not None and not timed_out and n == full and found < full * self.chunk_size \
                and cap > num_computed_tokens:
            n = found // self.chunk_size  # the first missing full chunk: try the partial ones in it
            found = self._ask(t, hashes[:n], cap)
        t.refine = (request.num_tokens, n) if found is None and n < full else None
        if found is None and cap <= num_computed_tokens:
            # vLLM's own cache holds the prompt: this lookup only spares a second copy, and never
            # holds the request back (its pins are dropped; the chunks may be stored again).
            self.lookup.release([request.request_id])
            return 0, False
        t.asking = found is None
        if found is None:
            return None, False
        t.lookup_tokens = min(found, cap)
        # block aligned: a stored range ends at a block end
        hit = t.usable_tokens = max(0, t.lookup_tokens - self.block_size) if self.drop_last_block \
            else t.lookup_tokens
        if cap > num_computed_tokens:  # a lookup that cannot load is no query for the hit rate
            self.stats.add("lookups")
            self.stats.add("lookup_query_tokens", cap)
            self.stats.add("lookup_hit_tokens", hit)
        if hit <= num_computed_tokens:
            return 0, False
        slow = lookup_member(self.lookup, "take_slow")(request.request_id)
        local = lookup_member(self.lookup, "take_local")(request.request_id)
        t.slow_chunks = frozenset(slow)
        loaded = range(num_computed_tokens // self.chunk_size, -(-hit // self.chunk_size))
        # several KV cache groups: vLLM takes load failures only as failed async loads;
        # vLLM running steps ahead of their outputs: see the module docstring
        t.load_background = (self.layout.multi or bool(self.runs_ahead)
                             or any(i in loaded for i in slow)
                             or (any(i in loaded for i in local)
                                 and not self._in_step_budget(hit - num_computed_tokens)))
        return hit - num_computed_tokens, t.load_background

    def _in_step_budget(self, tokens: int) -> bool:
        """Whether a hit of ``tokens`` from a local medium still fits this step's
        ``in_step_load_bytes`` (then taken from it): the step reads it as it reads RAM hits,
        instead of the request waiting a step for a background load. Unknown KV sizes never
        fit. Taken when asked: a request vLLM then cannot schedule has spent it (conservative)."""
        need = tokens * self.layout.block_bytes // max(1, self.block_size)
        if not need or self._in_step_spent + need > self.cfg.in_step_load_bytes:
            return False
        self._in_step_spent += need
        self.stats.add("inline_local_loads")
        return True

    def hit_split(self, req_id: str, num_external_tokens: int) -> tuple[int, int]:
        """The last hit's external tokens (its last ``num_external_tokens``) as (held by a tier
        that never blocks, only by a tier that may block): vLLM's cache-hit-by-source metric."""
        t = self.trackers.get(req_id)
        if t is None:
            return num_external_tokens, 0
        start, end = t.usable_tokens - num_external_tokens, t.usable_tokens
        slow = sum(max(0, min(end, (i + 1) * self.chunk_size) - max(start, i * self.chunk_size))
                   for i in t.slow_chunks)
        return num_external_tokens - slow, slow

    def _ask(self, t: RequestTracker, hashes: list[bytes], cap: int) -> int | None:
        """Look up ``hashes`` (full chunks), then the partial chunks ending at each block end
        inside the next chunk (below ``cap``), longest first."""
        n = len(hashes)
        top = min(cap, (n + 1) * self.chunk_size - self.block_size)
        tails = [(e, self.partial_hash(t, e)) for e in range(top, n * self.chunk_size, -self.block_size)]
        timeouts = lookup_member(self.lookup, "timeouts")
        scope: dict[str, Any] = {"tenant": t.tenant} if t.tenant else {}
        if t.handoff is not None:  # chunks a producer named: no tier answers from a stale miss
            scope["fresh"] = True
        found = self.lookup.lookup(t.request.request_id, hashes, tails, **scope)
        if (late := lookup_member(self.lookup, "timeouts") - timeouts) > 0:
            self.stats.add("lookup_timeouts", late)
        return found

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of the external tokens vLLM accepted, into the blocks it allocated."""
        t = self.trackers.get(request.request_id)
        if t is None:
            return
        tables = blocks.get_block_ids() if blocks is not None else ([],)
        t.block_ids, t.tables = list(tables[0]), tuple(map(list, tables))
        hit = t.lookup_tokens
        # What lookup found is in storage: never store it again.
        t.stored_chunk_end = max(t.stored_chunk_end, hit // self.chunk_size * self.chunk_size)
        t.stored_block_end = max(t.stored_block_end, hit)
        if num_external_tokens > 0:
            upto = t.usable_tokens  # the hit's last block is recomputed: drop_last_block
            start = upto - num_external_tokens
            first = start // self.chunk_size
            t.pending_load = LoadSpec(start, hit, first, self._hashes_for(t, first * self.chunk_size, hit),
                                      background=t.load_background,
                                      upto=upto if upto < hit else None)
            if self.on_chunks is not None:  # a load promotes its chunks into L1
                self.on_chunks(request, first * self.chunk_size, hit, t.pending_load.hashes)
            if t.load_background:  # not scheduled while it loads: sent on its own
                self._background.append(request.request_id)
            t.report["promised_tokens"] = num_external_tokens
            t.report["async_load"] = t.load_background
        elif hit:  # a hit vLLM did not take (e.g. prompt logprobs): drop its pins now
            self.lookup.release([request.request_id])

    def _save_spec(self, t: RequestTracker, computed: int, final: bool = False
                   ) -> SaveSpec | None:
        """What to store once ``computed`` tokens have KV: the full chunks not stored yet and,
        with partial chunks on, a block-aligned partial chunk ending where a later request can
        reuse: once the prompt is computed, ``(prompt_len - 1) // block * block`` (an identical
        prompt); at request end (``final``), the last full block (the next turn of a chat). For
        a chunk-aligned prompt that partial lies in the last full chunk, which is stored the
        next time instead."""
        r = t.request
        top = min(computed, r.num_tokens if self.cfg.save_decode else t.prompt_len)
        start, end = t.stored_chunk_end, top // self.chunk_size * self.chunk_size
        if (self.cfg.save_partial_chunk or self.role == "kv_producer") \
                and computed >= t.prompt_len:
            pend = (top if final else t.prompt_len - 1) // self.block_size * self.block_size
            if pend % self.chunk_size and pend > t.stored_block_end:
                end = pend
        if end <= start or end <= t.stored_block_end:
            return None
        t.stored_chunk_end, t.stored_block_end = end // self.chunk_size * self.chunk_size, end
        spec = SaveSpec(start, end, start // self.chunk_size, self._hashes_for(t, start, end))
        if self.on_chunks is not None:
            self.on_chunks(r, start, end, spec.hashes)
        return spec

    def finish_save(self, request: Request, block_ids: list[int],
                    tables: tuple[list[int], ...] = ()) -> bool:
        """At request end, queue the store of what is computed and not stored yet, block
        aligned (the answer's blocks: turn N+1 of a chat starts with turn N's prompt+answer).
        True when there is one (or an asynchronous save may still read the blocks): vLLM then
        keeps the blocks until the workers report it done (``finished_sending``), and
        :attr:`held` names the request until then."""
        held = self._finish_save(request, block_ids, tables)
        if held:
            self.held.add(request.request_id)
        return held

    def release_held(self, finished_sending: Collection[str] | None) -> None:
        """vLLM freed these requests' blocks (every worker reported their saves done)."""
        self.held.difference_update(finished_sending or ())

    def _finish_save(self, request: Request, block_ids: list[int],
                     tables: tuple[list[int], ...]) -> bool:
        t = self.trackers.get(request.request_id)
        if t is None:
            return False
        # asynchronous saves: one may still read the blocks; the workers report the request
        # once none does (they decide from the same metadata: a ReqMeta with a save)
        held = bool(self.cfg.async_save) and t.sent_save
        if not t.can_save or t.stale:
            return held
        done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        if done < t.prompt_len:  # aborted before its prompt was computed: nothing new
            return held
        spec = self._save_spec(t, min(done, request.num_tokens), final=True)
        if spec is None:
            return held
        self._finishing.append(ReqMeta(request.request_id, list(block_ids), save=spec,
                                       finished=True, tables=self._tables(tables),
                                       tenant=t.tenant))
        return True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPlugMetadata:
        """One ReqMeta per scheduled request that loads or stores something this step."""
        meta = KVPlugMetadata(chunk_size=self.chunk_size, block_size=self.block_size, epoch=self.epoch,
                              idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        meta.handoffs = meta.idle and self._handoffs_waiting()
        meta.requests, self._finishing = self._finishing, []
        self._in_step_spent = 0  # the next step's budget
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted:  # blocks freed after their copies: nothing holds them now
            if (t := self.trackers.get(req_id)) is not None:  # (the workers forget them too)
                # its block table went back to vLLM, which hands those blocks to other
                # requests: it no longer names this request's KV (a resumed request gets a new
                # one), so no rule may follow blocks through it (UnwrittenBlocks.failed)
                t.sent_save, t.block_ids, t.tables = False, [], ()
        self._follow_blocks(scheduler_output)
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        work = [(req_id, 0) for req_id in self._background]
        self._background = []
        for req_id, n in [*work, *scheduler_output.num_scheduled_tokens.items()]:
            t = self.trackers.get(req_id)
            if t is None:
                continue
            load, t.pending_load = t.pending_load, None
            save = (self._save_spec(t, self._computed_after(t, n))
                    if t.can_save and not t.stale and n else None)
            if load is None and save is None:
                continue
            t.sent_save = t.sent_save or save is not None
            groups = state.get_block_ids(req_id) if state is not None else None
            block_ids = list(groups[0]) if groups else list(t.block_ids)
            meta.requests.append(ReqMeta(req_id, block_ids, load, save,
                                         tables=self._tables(groups or t.tables),
                                         tenant=t.tenant))
        if not self.layout.multi:
            meta.unwritten = self._unwritten_reads(meta, scheduler_output, state)
        return meta

    def _unwritten_reads(self, meta: KVPlugMetadata, scheduler_output: SchedulerOutput, state: Any
                         ) -> list[int]:
        """The blocks this step reads that a failed load left unwritten (:mod:`.unwritten`)."""
        for r in meta.requests:
            if r.load is not None:
                self.unwritten.loading(r.block_ids, r.load.start, r.load.write_end)
        work = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            if (t := self.trackers.get(req_id)) is not None:
                groups = state.get_block_ids(req_id) if state is not None else None
                work.append((list(groups[0]) if groups else t.block_ids,
                             t.request.num_computed_tokens, n))
        return self.unwritten.step(work)

    def _computed_after(self, t: RequestTracker, n: int) -> int:
        """Tokens whose KV is final after this step schedules ``n`` of ``t``: with an EAGLE/MTP
        drafter, while decoding, one block less (the drafter may rewrite its KV at the last
        accepted position after a rejected draft)."""
        done = t.request.num_computed_tokens
        if self.drop_last_block and done >= t.prompt_len:
            return max(t.prompt_len, done - self.block_size)
        return done + n

    def _tables(self, tables: tuple[list[int], ...] | list | None) -> tuple[list[int], ...]:
        """Every group's block table for the workers; empty for a single-group model."""
        return tuple(map(list, tables)) if self.layout.multi and tables else ()

    def _follow_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Keep each tracker's block table current from the scheduler output (fallback path)."""
        for nr in scheduler_output.scheduled_new_reqs:
            if (t := self.trackers.get(nr.req_id)) is not None:
                t.block_ids, t.tables = list(nr.block_ids[0]), tuple(map(list, nr.block_ids))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.trackers.get(req_id)
            new = cached.new_block_ids[i]
            if t is None or new is None:
                continue
            if req_id in cached.resumed_req_ids:
                t.block_ids, t.tables = list(new[0]), tuple(map(list, new))
            else:
                t.block_ids.extend(new[0])
                for table, more in zip(t.tables, new, strict=False):
                    table.extend(more)

    def update_connector_output(self, meta: KVPlugWorkerMeta | None,
                                invalid_blocks: Collection[int] | None = None) -> None:
        """Fold the workers' per-request load results into the trackers. Every worker (TP rank,
        PP stage) reports the same load, merged in one step or (background loads) each in the
        step its own fetch ended: fold with the maximum, never the sum. ``invalid_blocks``: the
        blocks vLLM was told hold no valid KV (followed until written, :mod:`.unwritten`)."""
        if invalid_blocks and not self.layout.multi:
            self.unwritten.failed(invalid_blocks, (t.block_ids for t in self.trackers.values()))
        if not isinstance(meta, KVPlugWorkerMeta):
            return
        for req_id, tiers in meta.loaded.items():
            if (t := self.trackers.get(req_id)) is not None:
                rep = t.report
                rep["loaded_tokens"] = max(rep.get("loaded_tokens", 0), sum(tiers.values()))
                per_tier = rep.setdefault("tiers", {})
                for tier, n in tiers.items():
                    per_tier[tier] = max(per_tier.get(tier, 0), n)
                rep["load_ms"] = round(max(rep.get("load_ms", 0.0), meta.load_ms.get(req_id, 0)),
                                       3)
        for req_id, tok in meta.failed_from.items():
            if (t := self.trackers.get(req_id)) is not None:
                # not stored from there on (the chunk failed; KV computed over it was dropped):
                # stored again once vLLM recomputed it
                t.stored_chunk_end = min(t.stored_chunk_end, tok // self.chunk_size * self.chunk_size)
                t.stored_block_end = min(t.stored_block_end, tok)
        for req_id, n in meta.num_failed_blocks.items():
            if (t := self.trackers.get(req_id)) is not None:
                t.report["failed_blocks"] = max(t.report.get("failed_blocks", 0), n)
                # vLLM recomputes; a background load that failed whole sends the request back
                # to a lookup that would find the same chunks and fail again, forever
                t.can_load = False

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request (the workers drop its pins); return what kvplug did for it, which
        vLLM hands back to the caller as ``kv_transfer_params["kvplug"]`` when
        ``report_to_client`` is on (off: every API client would learn what others cached), and,
        from a producer, its hand-off (:mod:`.handoff`: what it stores of this request alone)."""
        t = self.trackers.pop(request.request_id, None)
        if t is not None and t.asking:  # finished (aborted) while its lookup was in flight
            self.lookup.release([request.request_id])
        offered = self._handoff_offer(t) if t is not None and self.role == "kv_producer" else None
        if t is None or not self.cfg.report_to_client:
            return offered
        rep = {"lookup_hit_tokens": t.lookup_tokens, "loaded_tokens": 0, "tiers": {},
               "load_ms": 0.0, "failed_blocks": 0, "stored_tokens": t.stored_chunk_end, **t.report}
        return {**(offered or {}), "kvplug": rep}

    # -- disaggregated prefill: the producer's hand-off and the consumer's wait (.handoff) --------
    def _handoff_offer(self, t: RequestTracker) -> dict[str, Any] | None:
        """A producer's hand-off for a finished request: the leading tokens whose chunks it
        sent to be stored (every block but the one holding the prompt's last token, what a
        consumer with the same prompt looks up; less if the prompt was not all computed: its
        full chunks), named by the chained hash of the chunk ending there. None: nothing."""
        if not t.can_save or t.stale:
            return None
        prompt_end = (t.prompt_len - 1) // self.block_size * self.block_size
        tokens = prompt_end if t.stored_block_end >= prompt_end \
            else t.stored_chunk_end // self.chunk_size * self.chunk_size
        if tokens <= 0:
            return None
        last = self._hashes_for(t, (tokens - 1) // self.chunk_size * self.chunk_size, tokens)[-1]
        self.stats.add("handoff_offers")
        return handoff.offer(tokens, last, handoff.keys_identity(self.keys_digest, self.epoch),
                             self.cfg.handoff_wait_s, self.cfg.tier_names())

    def _handoff_receive(self, t: RequestTracker) -> None:
        """A consumer's new request: wait for the chunks its hand-off names, if it has one that
        names this prompt (the same chained hash) under this engine's keys."""
        named = handoff.named_in(t.request.kv_transfer_params)
        if named is None or not t.can_load:
            return
        if isinstance(named, str):
            return self._handoff_ignored(t, named)
        if named.keys != handoff.keys_identity(self.keys_digest, self.epoch):
            return self._handoff_ignored(t, "its producer's keys differ from this engine's "
                                            "(model, layout, parallelism, KV dtype or weights "
                                            "epoch): it could never find them")
        r = t.request
        if named.tokens % self.block_size or named.tokens > r.num_tokens \
                or self._hashes_for(t, (named.tokens - 1) // self.chunk_size * self.chunk_size,
                                    named.tokens)[-1] != named.last_hash:
            return self._handoff_ignored(t, "it names another prompt than the request's")
        cap = (r.num_tokens - 1) // self.block_size * self.block_size
        target = named.tokens if named.tokens <= cap else cap // self.chunk_size * self.chunk_size
        wait = min(named.ttl_s, self.cfg.handoff_wait_s)
        if target > 0 and wait > 0:
            now = self.clock()
            t.handoff = HandoffWait(target, now, now + wait)
            self.stats.add("handoff_waits")

    def _handoffs_waiting(self) -> bool:
        """Whether a request waits for chunks a producer named."""
        return any(t.handoff is not None and t.handoff.waiting for t in self.trackers.values())

    def _handoff_ignored(self, t: RequestTracker, why: str) -> None:
        self.stats.add("handoff_ignored")
        t.report["handoff"] = {"outcome": "ignored", "why": why}
        self._handoff_log(why, "kvplug: a request's hand-off is ignored (%s); it loads what a "
                          "lookup finds now, without waiting (further ones are counted in "
                          "handoff_ignored, not logged)", why)

    def _handoff_later(self, t: RequestTracker) -> bool:
        """A waiting request whose next lookup is not due yet (none in flight, the deadline
        not passed)."""
        w = t.handoff
        assert w is not None
        now = self.clock()
        return w.waiting and not t.asking and now < w.deadline and not w.due(now)

    def _handoff_pending(self, t: RequestTracker, found: int | None,
                         num_computed_tokens: int) -> bool:
        """After a lookup for a waiting request: whether it keeps waiting (it found less than
        the producer named and the deadline is ahead; its pins are dropped, the next lookup
        spaced). An answer still to come is the usual path's (it asks again)."""
        w = t.handoff
        assert w is not None
        if not w.waiting or found is None:
            return False
        now = self.clock()
        if found < w.target and num_computed_tokens < w.target and now < w.deadline:
            self.lookup.release([t.request.request_id])
            t.asking = False
            w.missed(now)
            return True
        outcome = "expired" if found < w.target and num_computed_tokens < w.target else "ready"
        t.report["handoff"] = w.end(outcome, now)
        self.stats.add(f"handoff_{outcome}")
        return False
