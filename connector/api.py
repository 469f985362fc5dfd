"""kvplug's management and lookup API on vLLM's own HTTP server, under ``/kvplug/v1/``.

A vLLM endpoint plugin (entry point ``vllm.endpoint_plugins: kvplug_api``; vLLM loads one only
when ``VLLM_PLUGINS`` names it, which ``kvplug serve`` does). FastAPI routes, so the calls are in
the server's OpenAPI schema (``/openapi.json``):

* ``POST /kvplug/v1/lookup`` {prompt | token_ids, cache_salt?}: the tokens the engine's scheduler
  would be told are stored (the scheduler side's own code, :class:`.scheduler.side.SchedulerSide`,
  asking the workers' lookup services, then releasing the pins) and, per tier, the leading tokens
  it holds and the tokens of the hit a load would read from it: what a KV-aware router asks;
* ``POST /kvplug/v1/clear`` {scope: all | tier | prefix | tenant, ...}: per tier what was
  removed and what remains (:mod:`kvplug.management`); ``ok`` only when every tier did all of it
  (a tenant clear acts on the tiers that can list entries by tenant, L1 and posix; the others
  say it is not available);
* ``POST /kvplug/v1/pin`` and ``/unpin`` {prompt | token_ids, cache_salt?, tiers?}: an
  operator's pins of a prompt's chunks (exempt from eviction until unpinned, kept across restarts
  on posix, within each tier's ``max_pinned_fraction``): per tier what was pinned, what it does
  not hold and what was refused (with the reason); a tier that cannot pin says so;
* ``GET /kvplug/v1/status``: tiers, capacity and use, breakers, pins, policies, per rank.

The tiers live in the workers: every call reaches them through their management sockets
(:mod:`.manage`). With ``--api-key`` (or ``VLLM_API_KEY``) every route needs
``Authorization: Bearer <key>``, as vLLM's ``/v1`` routes (vLLM's own check guards only those);
with ``management_key_env`` in the kvplug config, that variable's key instead (clients that
hold vLLM's key are then refused: they may be tenants).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import secrets
import threading
import time
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from kvplug.logs import LogOnce
from kvplug.redact import looks_like_variable
from pydantic import BaseModel, ConfigDict, Field

from .compat import drops_last_block
from .protocol.config import ConnectorConfig, load_connector_config
from .protocol.lookup import LookupClient, socket_path
from .protocol.manage import (
    ManageClear,
    ManageClient,
    ManageLookup,
    ManageMsg,
    ManagePin,
    ManageStatus,
    client_for,
)
from .scheduler.side import SchedulerSide

logger = logging.getLogger("kvplug.connector")

PREFIX = "/kvplug/v1"
#: how long a lookup through the scheduler's path may take before it answers 503 (each of its
#: lookups ends within ``lookup_timeout_s``; this only bounds a wedged worker): with the
#: workers' wait (:data:`.protocol.manage.MANAGE_TIMEOUT_S`) a call answers within 40 s, under
#: the 60 s HTTP proxies in front of vLLM commonly allow
LOOKUP_DEADLINE_S = 20.0


# -- request and response bodies (the OpenAPI schema) ------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored


class PromptText(_Body):
    """A prompt as text, tokenized by the served model's tokenizer as ``/v1/completions`` does."""

    prompt: str = Field(description="prompt text")
    cache_salt: str | None = Field(default=None, description="the request's cache_salt")


class PromptIds(_Body):
    """A prompt as token ids."""

    token_ids: list[int] = Field(description="prompt token ids")
    cache_salt: str | None = Field(default=None, description="the request's cache_salt")


LookupRequest = PromptText | PromptIds


class TierLookup(BaseModel):
    held: int = Field(description="leading tokens this tier holds on its own (min over ranks)")
    served: int = Field(description="tokens of the hit a load would read from this tier")


class LookupResponse(BaseModel):
    tokens: int = Field(description="tokens the scheduler would load (what a request would hit)")
    prompt_tokens: int
    chunk_size: int
    block_size: int
    tiers: dict[str, TierLookup]


TierNames = Annotated[list[str], Field(min_length=1, description="tier names")]


class ClearAll(_Body):
    """Every entry of every tier."""

    scope: Literal["all"]


class ClearTiers(_Body):
    """Every entry of the tiers named."""

    scope: Literal["tier"]
    tiers: TierNames


class ClearPrefixText(PromptText):
    """The chunks of a prompt (so every longer prompt starting with it), in every tier or the
    tiers named."""

    scope: Literal["prefix"]
    tiers: TierNames | None = None


class ClearPrefixIds(PromptIds):
    """:class:`ClearPrefixText` with token ids."""

    scope: Literal["prefix"]
    tiers: TierNames | None = None


class ClearTenant(_Body):
    """One tenant's entries (``tenant``: its cache_salt, or the ``tenant`` its requests name),
    in every tier or the tiers named; a tier that cannot list entries by tenant says so."""

    scope: Literal["tenant"]
    tenant: str = Field(min_length=1, description="the tenant's cache_salt or tenant name")
    tiers: TierNames | None = None


ClearRequest = ClearAll | ClearTiers | ClearPrefixText | ClearPrefixIds | ClearTenant


class TierClear(BaseModel):
    removed: int | None = Field(description="entries removed (summed over ranks); null: unknown")
    removed_bytes: int = Field(description="bytes the tier reports freed")
    remaining: int | None = Field(description="entries still there; null: unknown")
    remaining_bytes: int | None = Field(default=None, description="a tenant clear: bytes of the "
                                        "tenant the tier still holds (measured)")
    complete: bool
    error: str | None = None
    note: str | None = None


class ClearResponse(BaseModel):
    ok: bool = Field(description="every tier asked did all of it")
    scope: str
    tiers: dict[str, TierClear]
    ranks: list[dict[str, Any]]


class PinText(PromptText):
    """The chunks of a prompt (its full chunks; its partial ones where a tier holds them), on
    every tier or the tiers named."""

    tiers: TierNames | None = None


class PinIds(PromptIds):
    """:class:`PinText` with token ids."""

    tiers: TierNames | None = None


PinRequest = PinText | PinIds


class TierPin(BaseModel):
    available: bool = Field(description="whether the tier can pin at all (a store that evicts "
                                        "by itself cannot)")
    pinned: int | None = Field(default=None, description="chunks pinned (now or already; "
                                                         "summed over ranks)")
    absent: int | None = Field(default=None, description="full chunks the tier does not hold")
    refused: int | None = Field(default=None, description="chunks past max_pinned_fraction")
    unpinned: int | None = Field(default=None, description="chunks unpinned")
    not_pinned: int | None = Field(default=None, description="chunks that held no pin")
    pinned_bytes: int | None = Field(default=None, description="bytes pinned by operators "
                                                               "on the tier after the call")
    limit_bytes: int | None = Field(default=None, description="max_pinned_fraction x capacity")
    complete: bool
    error: str | None = None
    note: str | None = None


class PinResponse(BaseModel):
    ok: bool = Field(description="every tier asked did all of it")
    tokens: int = Field(description="prompt tokens")
    tiers: dict[str, TierPin]
    ranks: list[dict[str, Any]]


class TierStatus(BaseModel):
    name: str
    backend: str
    never_blocks: bool = Field(description="the tier never waits on I/O (its class sets "
                               "never_blocks): an engine step may read it")
    may_block: bool = Field(deprecated="read never_blocks: may_block is its negation, kept for "
                            "existing readers")
    capacity_bytes: int | None
    used_bytes: int | None
    entries: int | None
    pinned: int | None
    operator_pinned: int | None = Field(default=None, description="entries an operator pinned")
    operator_pinned_bytes: int | None = None
    breaker: Literal["open", "closed"] | None
    policies: dict[str, Any]


class StatusResponse(BaseModel):
    model: str
    chunk_size: int
    block_size: int
    tiers: list[TierStatus]
    ranks: list[dict[str, Any]]


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int


class ErrorBody(BaseModel):
    """vLLM's error body (its server formats every HTTP error so)."""

    error: ErrorInfo


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "a request body the schema refuses"},
    401: {"model": ErrorBody, "description": "the server has --api-key and it was not sent"},
    503: {"model": ErrorBody, "description": "a worker did not answer, or no kvplug connector"},
}


# -- the engine side of the calls ---------------------------------------------------------------
@dataclass
class _Query:
    """What :class:`.scheduler.side.SchedulerSide` reads of a ``vllm.v1.request.Request``."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    lora_request: None = None
    mm_features: None = None
    prompt_embeds: None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    num_prompt_tokens = num_tokens


class _AcrossRanks:
    """One tier's answers from every rank, added up the same way by clear, pin and status."""

    def __init__(self, per: list[dict[str, Any]]) -> None:
        self.per = per

    def total(self, k: str) -> int | None:
        """The sum over the ranks; None where a rank did not count it."""
        vals = [p.get(k) for p in self.per]
        return None if any(v is None for v in vals) else sum(vals)

    def joined(self, k: str) -> str | None:
        """The ranks' distinct messages (errors, notes), sorted and joined; None where none."""
        return "; ".join(sorted({p[k] for p in self.per if p.get(k)})) or None


class Engine:
    """What the routes need of the running engine: its kvplug config, the workers' management
    sockets, a scheduler side of its own for lookups, and the tokenizer."""

    def __init__(self, vllm_config: Any, tokenizer: Any, config: ConnectorConfig) -> None:
        xfer = vllm_config.kv_transfer_config
        self.config = config
        self.model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
        self.block_size = int(vllm_config.cache_config.block_size or 16)
        pc = vllm_config.parallel_config
        engine_id = xfer.engine_id or "default"
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.client: ManageClient = client_for(engine_id, tp, pp)
        lookups = LookupClient([socket_path(engine_id, r, p) for p in range(pp)
                                for r in range(tp)], self.config.lookup_timeout_s)
        # the scheduler's own code; its epoch is set to the workers' before each lookup
        cfg = self.config.model_copy(update={"fresh_epoch_at_start": False})
        self.sched = SchedulerSide(cfg, self.block_size, xfer.kv_role or "kv_both", lookups,
                                   drop_last_block=drops_last_block(vllm_config))
        self.tokenizer = tokenizer
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the scheduler side and its sockets: one call at a time

    def token_ids(self, body: PromptText | PromptIds) -> list[int]:
        if isinstance(body, PromptIds):
            return list(body.token_ids)
        if self.tokenizer is None:
            raise HTTPException(400, "this server has no tokenizer (--skip-tokenizer-init): "
                                     "send token_ids")
        return list(self.tokenizer.encode(body.prompt))

    def ask(self, msg: ManageMsg) -> list[dict[str, Any]]:
        """Every rank's answer; 503 naming the rank that failed."""
        out = []
        for reply in self.client.ask(msg):
            if not reply.ok:
                raise HTTPException(503, f"kvplug worker: {reply.error}")
            out.append(reply.body)
        return out

    def lookup(self, ids: list[int], salt: str | None) -> LookupResponse:
        if len(ids) <= self.block_size:  # nothing a request could load: it computes a token
            return LookupResponse(tokens=0, prompt_tokens=len(ids), chunk_size=self.sched.chunk_size,
                                  block_size=self.block_size,
                                  tiers={n: TierLookup(held=0, served=0)
                                         for n in self.config.tier_names()})
        with self._lock:
            q = _Query(f"kvplug-api-lookup-{next(self._ids)}", ids, salt)
            tiers = self._per_tier(q)
            tokens = self._scheduler_hit(q)
        return LookupResponse(tokens=tokens, prompt_tokens=len(ids), chunk_size=self.sched.chunk_size,
                              block_size=self.block_size, tiers=tiers)

    def _per_tier(self, q: _Query) -> dict[str, TierLookup]:
        t = self.sched.track(q)  # hashes as the scheduler makes them (salt, chunk keys)
        cap = (q.num_tokens - 1) // self.sched.block_size * self.sched.block_size
        if not t.can_load or cap <= 0:
            names = self.config.tier_names()
            return {n: TierLookup(held=0, served=0) for n in names}
        full, tails = self.sched.prefix_hashes(t, cap)
        ranks = self.ask(ManageLookup(full, tails, t.tenant))
        self.sched.follow_epoch(ranks[0]["epoch"])  # the weights epoch the workers run under
        return {name: TierLookup(held=min(r["tiers"][name]["held"] for r in ranks),
                                 served=min(r["tiers"][name]["served"] for r in ranks))
                for name in ranks[0]["tiers"]}

    def _scheduler_hit(self, q: _Query) -> int:
        """``SchedulerSide.get_num_new_matched_tokens`` until the workers answered; pins
        released at once."""
        end = time.monotonic() + LOOKUP_DEADLINE_S
        try:
            while True:
                hit, _ = self.sched.get_num_new_matched_tokens(q, 0)
                if hit is not None:
                    return hit
                if time.monotonic() > end:
                    raise HTTPException(503, "kvplug lookup: the workers did not answer")
                time.sleep(0.002)
        finally:
            self.sched.forget(q.request_id)

    def _known_tiers(self, asked: list[str] | None) -> None:
        """404 naming any tier in ``asked`` that the config does not have."""
        unknown = sorted(set(asked or ()) - set(self.config.tier_names()))
        if unknown:
            raise HTTPException(404, f"unknown tier(s) {unknown}; tiers are "
                                     f"{self.config.tier_names()}")

    def _prompt_chunks(self, ids: list[int], salt: str | None,
                       what: str) -> tuple[list[bytes], list[bytes], str]:
        """The hashes of a prompt's full chunks and of its partial chunks at every block end, and
        the tenant of their keys, as the scheduler makes them (salt, chunk keys)."""
        with self._lock:
            q = _Query(f"kvplug-api-{what}-{next(self._ids)}", ids, salt)
            t = self.sched.track(q)
            full, tails = self.sched.prefix_hashes(t, q.num_tokens)
            self.sched.trackers.pop(q.request_id, None)
        return full, [h for _, h in tails], t.tenant

    def clear(self, body: ClearRequest) -> ClearResponse:
        tiers_asked = getattr(body, "tiers", None)
        self._known_tiers(tiers_asked)
        hashes, key_tenant = None, ""
        if isinstance(body, ClearPrefixText | ClearPrefixIds):
            full, tails, key_tenant = self._prompt_chunks(self.token_ids(body), body.cache_salt,
                                                          "clear")
            hashes = full + tails
        if isinstance(body, ClearTenant):  # its id, as the scheduler makes it (never the salt)
            ranks = self.ask(ManageClear(tiers_asked, None, self.sched.tenant_id(body.tenant),
                                         True))
        else:
            ranks = self.ask(ManageClear(tiers_asked, hashes, key_tenant))
        tiers: dict[str, TierClear] = {}
        for name in ranks[0]["tiers"]:
            a = _AcrossRanks([r["tiers"][name] for r in ranks])
            error = a.joined("error")
            complete = all(p.get("complete", p.get("remaining") == 0) for p in a.per) \
                and error is None
            tiers[name] = TierClear(removed=a.total("removed"),
                                    removed_bytes=a.total("removed_bytes") or 0,
                                    remaining=a.total("remaining"), complete=complete,
                                    remaining_bytes=a.total("remaining_bytes"),
                                    error=error, note=a.joined("note"))
        return ClearResponse(ok=all(t.complete for t in tiers.values()), scope=body.scope,
                             tiers=tiers, ranks=ranks)

    def pin(self, body: PinRequest, pin: bool) -> PinResponse:
        """An operator's pin (or unpin) of a prompt's chunks, per tier (:mod:`kvplug.management`)."""
        self._known_tiers(body.tiers)
        ids = self.token_ids(body)
        full, tails, key_tenant = self._prompt_chunks(ids, body.cache_salt, "pin")
        ranks = self.ask(ManagePin(full, tails, body.tiers, pin, key_tenant))
        tiers: dict[str, TierPin] = {}
        for name in ranks[0]["tiers"]:
            a = _AcrossRanks([r["tiers"][name] for r in ranks])
            tiers[name] = TierPin(
                available=all(p.get("available", True) for p in a.per),
                **{k: a.total(k) for k in ("pinned", "absent", "refused", "unpinned",
                                           "not_pinned", "pinned_bytes", "limit_bytes")},
                complete=all(p["complete"] for p in a.per), error=a.joined("error"),
                note=a.joined("note"))
        return PinResponse(ok=all(t.complete for t in tiers.values()), tokens=len(ids),
                           tiers=tiers, ranks=ranks)

    def status(self) -> StatusResponse:
        ranks = self.ask(ManageStatus())
        tiers = []
        for i, first in enumerate(ranks[0]["tiers"]):
            a = _AcrossRanks([r["tiers"][i] for r in ranks])
            breakers = {p["breaker"] for p in a.per}
            tiers.append(TierStatus(
                name=first["name"], backend=first["backend"],
                never_blocks=first["never_blocks"], may_block=first["may_block"],
                capacity_bytes=a.total("capacity_bytes"), used_bytes=a.total("used_bytes"),
                entries=a.total("entries"), pinned=a.total("pinned"),
                operator_pinned=a.total("operator_pinned"),
                operator_pinned_bytes=a.total("operator_pinned_bytes"),
                breaker="open" if "open" in breakers else first["breaker"],
                policies=first["policies"]))
        return StatusResponse(model=self.model, chunk_size=self.sched.chunk_size,
                              block_size=self.block_size, tiers=tiers, ranks=ranks)


# -- authentication and routes ------------------------------------------------------------------
_bearer = HTTPBearer(auto_error=False, description="vLLM's --api-key, when the server has one")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


#: Says once per process that ``/kvplug/v1`` answers anyone (no key of either kind).
_open_warning = LogOnce(logger)


def api_keys(args: Namespace, config: ConnectorConfig | None,
             environ: Any = os.environ) -> list[bytes]:
    """Digests of the keys that open ``/kvplug/v1``: the value of ``management_key_env`` when the
    kvplug config names one, else vLLM's ``--api-key`` (or ``VLLM_API_KEY``); none: open, which
    is logged once (a warning naming the fix) when kvplug's connector runs (``config``). A named
    variable that is unset or empty is an error naming it (never an open API)."""
    name = config.management_key_env if config is not None else None
    if name:
        value = environ.get(name)
        if not value:
            shown = f"${name}" if looks_like_variable(name) else (
                "something that looks like a key, not a variable's name (not shown: give the "
                "NAME of the variable holding the key, never the key)")
            raise RuntimeError(f"kvplug: management_key_env names {shown}, which is unset or "
                               "empty in the API server's environment; set it (the management "
                               "API stays closed without it) or remove management_key_env")
        return [_digest(value)]
    keys = [_digest(k) for k in getattr(args, "api_key", None) or [environ.get("VLLM_API_KEY")]
            if k]
    if not keys and config is not None:
        _open_warning("open", "kvplug: the management API (/kvplug/v1: clear, pin, unpin, lookup, "
                      "status) is open: neither vLLM's --api-key (VLLM_API_KEY) nor the kvplug "
                      "config's management_key_env is set, so anyone who reaches this server's "
                      "port can clear or pin the cache and see what it holds (pins persist); set "
                      "management_key_env: NAME (a variable holding the key only operators and "
                      "routers have) or start the server with --api-key")
    return keys


def _authorized(request: Request,
                cred: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    keys: list[bytes] | None = getattr(request.app.state, "kvplug_api_keys", None)
    if keys is None:  # the plugin's state is not set up: closed, never open
        raise HTTPException(503, "kvplug's API is not ready")
    if not keys:
        return
    given = _digest(cred.credentials) if cred is not None else b""
    ok = False
    for k in keys:
        ok |= secrets.compare_digest(given, k)
    if not ok:
        raise HTTPException(401, "Unauthorized: send Authorization: Bearer <the server's "
                                 "--api-key, or the key of the kvplug config's "
                                 "management_key_env>", headers={"WWW-Authenticate": "Bearer"})


def _engine(request: Request) -> Engine:
    engine = getattr(request.app.state, "kvplug_engine", None)
    if engine is None:
        raise HTTPException(503, getattr(request.app.state, "kvplug_unavailable",
                                         "kvplug's API is not ready"))
    return engine


router = APIRouter(prefix=PREFIX, tags=["kvplug"], dependencies=[Depends(_authorized)])


@router.post("/lookup", response_model=LookupResponse, responses=ERRORS)
async def lookup(body: LookupRequest, request: Request) -> LookupResponse:
    """Tokens of this prompt the engine would load from kvplug's tiers, and per tier."""
    engine = _engine(request)
    ids = engine.token_ids(body)
    return await asyncio.to_thread(engine.lookup, ids, body.cache_salt)


@router.post("/clear", response_model=ClearResponse, responses={
    **ERRORS, 404: {"model": ErrorBody, "description": "a tier named is not configured"}})
async def clear(body: ClearRequest, request: Request) -> ClearResponse:
    """Remove entries; per tier what was removed and what remains (``ok``: all of it)."""
    return await asyncio.to_thread(_engine(request).clear, body)


_PIN_ERRORS = {**ERRORS, 404: {"model": ErrorBody, "description": "a tier named is not configured"}}


@router.post("/pin", response_model=PinResponse, responses=_PIN_ERRORS)
async def pin(body: PinRequest, request: Request) -> PinResponse:
    """Keep a prompt's chunks from eviction (until unpinned; across restarts on posix), within
    each tier's ``max_pinned_fraction``; per tier what was pinned (``ok``: all of it)."""
    return await asyncio.to_thread(_engine(request).pin, body, True)


@router.post("/unpin", response_model=PinResponse, responses=_PIN_ERRORS)
async def unpin(body: PinRequest, request: Request) -> PinResponse:
    """Release an operator's pins of a prompt's chunks; per tier what was unpinned."""
    return await asyncio.to_thread(_engine(request).pin, body, False)


@router.get("/status", response_model=StatusResponse, responses=ERRORS)
async def status(request: Request) -> StatusResponse:
    """Tiers, capacity and use, breakers, pins, policies (summed over ranks; per rank too)."""
    return await asyncio.to_thread(_engine(request).status)


class KVPlugEndpoints:
    """vLLM's ``EndpointPlugin``: the routes above on the OpenAI server."""

    name = "kvplug_api"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        state.kvplug_engine = None
        vllm_config = getattr(engine_client, "vllm_config", None)
        xfer = getattr(vllm_config, "kv_transfer_config", None)
        if xfer is None or xfer.kv_connector != "KVPlugConnector":
            state.kvplug_api_keys = api_keys(args, None)
            state.kvplug_unavailable = ("this server does not run kvplug's connector "
                                        "(start it with `kvplug serve`)")
            return
        config = load_connector_config(dict(xfer.kv_connector_extra_config or {}))
        state.kvplug_api_keys = api_keys(args, config)
        get_tokenizer = getattr(engine_client, "get_tokenizer", None)
        tokenizer = get_tokenizer() if get_tokenizer is not None else None
        if asyncio.iscoroutine(tokenizer):
            tokenizer = await tokenizer
        state.kvplug_engine = Engine(vllm_config, tokenizer, config)
