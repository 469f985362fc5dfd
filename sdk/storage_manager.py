"""The StorageManager: one pluggy PluginManager, one backend instance per tier, in tier order.

It is the only thing the cache engine talks to. It decides *which tier* answers; backends decide
*how* bytes are kept. Every hook call goes through :meth:`_call`, which turns an exception from a
backend into a counted, once-logged miss, and bounds calls on tiers that may block with
the tier's ``timeout_s`` so a stalled tier degrades to a miss instead of hanging the engine (only
tiers whose class sets ``never_blocks = True``, like ``local_cpu``, or whose client bounds every
call within ``timeout_s``, ``call_bound_s``, are called on the caller's thread). Each tier
that may block has its own bounded pool (:mod:`.tier_calls`): a stalled tier starves no other, and
late results release what they hold (objects, pins). The tiers are built, and their hooks scoped,
by :mod:`.tier_setup`. What a tier's read may allocate (``ctx.allocate``, ``ctx.read_limit``) is
decided by :mod:`.read_memory`, before any allocation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from .chunkfile.auth import Keyring
from .config import KVPlugConfig, TierConfig, load_config
from .errors import ConfigError
from .heap import HeapBuffers
from .keys import CacheKey
from .logs import LogOnce
from .memory import MemoryFormat, MemoryObj
from .read_memory import DEFAULT_MAX_HEAP_FALLBACK, ChunkGeometry, ReadMemory
from .runtime import THREADS, Runtime
from .tier_calls import (
    BATCH_GET_KEYS,
    MAX_ENCODER_QUEUE,
    TIER_THREADS,
    Tier,
    WaitBudget,
    release,
)
from .tier_setup import ScopedHooks, build_tier, discard_tier

logger = logging.getLogger("kvplug.storage")
#: threads a batched read of a tier that may block is spread over
READERS = 8

def auth_keyring(config: KVPlugConfig) -> Keyring | None:
    """The keyring of ``config``'s ``auth_key_env`` (and previous keys), or ``None`` without it;
    ``ConfigError`` naming a variable that is unset, short or undecodable."""
    if not config.auth_key_env:
        return None
    return Keyring.from_env(config.auth_key_env, config.auth_previous_key_envs,
                            encrypt=config.encrypt)


@dataclass
class PrefixLookup:
    """Result of :meth:`StorageManager.lookup_prefix`."""

    num_chunks: int
    tiers: list[str] = field(default_factory=list)  # tier that holds each hit chunk
    pinned: bool = False


class StorageManager:
    """Tiers of storage behind one API: allocate, put, get, prefix lookup, evict, close."""

    def __init__(self, config: KVPlugConfig | dict | str | None = None, *,
                 runtime: Runtime = THREADS, geometry: ChunkGeometry | None = None,
                 **extra: Any) -> None:
        """``geometry``: the engine's chunk objects (the connector's); reads of any other shape
        are refused before allocating (:mod:`.read_memory`). ``extra`` goes to ``ctx.extra``."""
        self.config = load_config(config)
        self.runtime = runtime  # every pool below comes from it (kvplug.runtime)
        self.chunk_size = self.config.chunk_size
        self._hooks = ScopedHooks()  # every tier's plugins, each scoped to its tiers
        self.pm = self._hooks.pm
        self._tiers: list[Tier] = []
        self._log_once = LogOnce(logger)
        self._closed = False
        self._lock = threading.Lock()
        cap = self.config.max_heap_fallback
        self.reads = ReadMemory(self.allocate, self._pool_sizes,
                                DEFAULT_MAX_HEAP_FALLBACK if cap is None else int(cap), geometry)
        #: Memory when no tier owns a pool: buffers reused, not faulted in afresh (:mod:`.heap`).
        self.heap = HeapBuffers()
        #: The deployment's keyring (``auth_key_env``): handed to every tier, never global.
        self.auth = auth_keyring(self.config)
        # Bounded tier calls run on each tier's own pool; batched_get fans out over this one.
        self._readers = runtime.executor(READERS, "kvplug-read")
        names = self.config.tier_names()
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"tier name(s) {dupes} appear more than once; give each tier a unique 'name'"
            )
        try:
            for index, tier_cfg in enumerate(self.config.tiers):
                self._add_tier(index, tier_cfg, extra)
        except BaseException:
            self.close()
            raise
        logger.info(
            "kvplug storage ready: %s",
            " -> ".join(f"{t.name} ({t.config.backend})" for t in self._tiers),
        )

    # -- construction ---------------------------------------------------------------------------
    def _add_tier(self, index: int, cfg: TierConfig, extra: dict[str, Any]) -> None:
        tier = build_tier(index, cfg, self.reads.allocate, self.chunk_size, extra,
                          self.runtime, self.memory_regions, self.reads.read_limit, self.auth,
                          self.reads.header_limit)
        try:
            self._hooks.register(tier.backend, f"tier:{tier.name}", {tier.name})
            self._hooks.register(tier.metrics, f"metrics:{tier.name}", {tier.name})
            # Registered last, so it wraps the metrics: they count the bytes the tier really moves.
            self._hooks.register(tier.codec, f"codec:{tier.name}", {tier.name})
            if tier.codec.codec is not None:
                tier.start_encoder()
            self._tiers.append(tier)
            self._hooks.wire(self._tiers)
        except BaseException:
            # not a tier of this manager after all: released here, as close() would have
            if tier in self._tiers:
                self._tiers.remove(tier)
            discard_tier(tier.backend, tier, tier.name)
            raise

    def add_wrapper(self, plugin: object, tiers: Sequence[str] | None = None) -> None:
        """Register a ``@hookimpl(wrapper=True)`` plugin on some tiers (all if ``None``)."""
        unknown = set(tiers or ()) - set(self.tier_names)
        if unknown:
            raise ConfigError(f"unknown tier(s) {sorted(unknown)}; tiers are {self.tier_names}")
        self._hooks.register(plugin, f"wrapper:{id(plugin)}",
                             None if tiers is None else set(tiers))
        self._hooks.wire(self._tiers)

    # -- plumbing -------------------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    def backend(self, tier: str | int) -> object:
        """The backend instance of a tier, by name or position (for tools and tests)."""
        for t in self._tiers:
            if t.name == tier or t.index == tier:
                return t.backend
        raise ConfigError(f"unknown tier {tier!r}; tiers are {self.tier_names}")

    def _fault(self, tier: Tier, hook: str, exc: BaseException) -> None:
        tier.faults += 1
        self._log_once(
            (tier.name, hook),
            "tier %r (%s) failed in %s: %s: %s — treated as a miss; further failures of "
            "this kind are counted in stats, not logged",
            tier.name, tier.config.backend, hook, type(exc).__name__, exc,
        )

    def _call(self, tier: Tier, hook: str, bounded: bool = False,
              budget: WaitBudget | None = None, **kwargs: Any) -> Any:
        """Call one tier's hook: its backend's answer itself (every hook is ``firstresult``,
        :mod:`kvplug.hookspecs`); exceptions (and, if ``bounded``, timeouts) become ``None``.
        ``budget``: the call is bounded by what is left of it too (and never started once it is
        spent), even where the tier's own client bounds its calls (``on_caller_thread``)."""
        if tier.never_blocks or (budget is None and (not bounded or tier.on_caller_thread)):
            try:
                return tier.hooks[hook](**kwargs)
            except Exception as exc:  # noqa: BLE001 - a tier fault is a miss
                self._fault(tier, hook, exc)
                return None
        if budget is not None and budget.spent():
            return self._over_budget(tier, hook, budget)
        return self._wait(tier, hook, tier.call_async(hook, kwargs), kwargs, budget)

    def _wait(self, tier: Tier, hook: str, fut: Any, kwargs: dict[str, Any],
              budget: WaitBudget | None = None) -> Any:
        """The answer of a call submitted to the tier's pool, waited for at most the tier's
        ``timeout_s`` (and what is left of ``budget``); past it, abandoned (a late result
        releases what it holds) and a miss."""
        timeout = tier.config.timeout_s if budget is None else \
            min(tier.config.timeout_s, budget.remaining())
        since = self.runtime.monotonic()
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            tier.abandon(hook, fut, kwargs)
            if budget is not None and timeout < tier.config.timeout_s:
                return self._over_budget(tier, hook, budget)
            tier.timeouts += 1
            self._fault(tier, hook, TimeoutError(f"no answer within {tier.config.timeout_s}s"))
            return None
        except Exception as exc:  # noqa: BLE001
            self._fault(tier, hook, exc)
            return None
        finally:
            if budget is not None:
                budget.charge(since)

    def _over_budget(self, tier: Tier, hook: str, budget: WaitBudget) -> None:
        """A read the batch's wait allowance did not cover: a miss, counted, logged once."""
        tier.deadline_misses += 1
        self._log_once((tier.name, "budget"),
                       "tier %r (%s): %s not answered within the engine step's allowance of "
                       "%.3gs for reads (in_step_load_deadline_s) — treated as a miss (vLLM "
                       "recomputes); further ones are counted in stats (deadline_misses)",
                       tier.name, tier.config.backend, hook, budget.seconds)
        return None

    # -- allocation -----------------------------------------------------------------------------
    def memory_regions(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the host buffers that :meth:`allocate` draws from (every
        pool-owning tier's ``memory_regions``); what tiers get as ``ctx.memory_regions``."""
        out: list[tuple[int, int]] = []
        for tier in self._tiers:
            if tier.implements("memory_regions"):
                out += [(int(a), int(n)) for a, n in self._call(tier, "memory_regions") or []]
        return out

    def allocate(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.uint8,
        fmt: MemoryFormat = MemoryFormat.KV_PAGES,
        num_tokens: int = 0,
    ) -> MemoryObj | None:
        """Memory for a chunk from the first tier owning a pool; heap if none does (buffers
        reused: :mod:`.heap`); None if full."""
        owners = 0
        for tier in self._tiers:
            if not tier.implements("allocate"):
                continue
            owners += 1
            obj = self._call(tier, "allocate", shape=tuple(shape), dtype=dtype, fmt=fmt,
                             num_tokens=num_tokens)
            if obj is not None:
                return obj
        if owners:
            return None
        return self.heap.allocate(tuple(shape), dtype, fmt, num_tokens)

    @property
    def geometry(self) -> ChunkGeometry | None:
        """The engine's chunk geometry reads are checked against (``None``: not known)."""
        return self.reads.geometry

    @geometry.setter
    def geometry(self, value: ChunkGeometry | None) -> None:
        self.reads.geometry = value

    @property
    def read_heap_fallbacks(self) -> int:
        """Reads that found the pool full and went to the heap (:mod:`.read_memory`)."""
        return self.reads.counts["read_heap_fallbacks"]

    def _pool_sizes(self) -> list[int]:
        return [n for _, n in self.memory_regions()]

    # -- store ----------------------------------------------------------------------------------
    def batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """Write-through to every tier. The caller keeps (and later drops) its own references.

        A key given twice (two requests finishing the same prefix in one step) is stored once:
        a key names its bytes, so the first object stands for both, and each tier receives
        distinct keys (the ``batched_submit_put`` contract)."""
        if len(keys) != len(objs):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(objs)} objects")
        if not keys:
            return
        if len(set(keys)) != len(keys):
            first: dict[CacheKey, MemoryObj] = {}
            for key, obj in zip(keys, objs):
                first.setdefault(key, obj)
            keys, objs = list(first), list(first.values())
        self._record_use(keys)
        for tier in self._tiers:
            self._put_to(tier, *self._admitted(tier, list(keys), list(objs)))

    def _put_to(self, tier: Tier, keys: list[CacheKey], objs: list[MemoryObj]) -> None:
        """One tier's store of ``keys`` (through its encoder thread when it has a codec)."""
        if not keys:
            return
        if tier.encoder is not None:
            self._put_encoded(tier, keys, objs)
        else:
            self._call(tier, "batched_submit_put", keys=keys, objs=objs)

    # -- admission (kvplug.policies: a tier's ``admission`` setting) ----------------------------
    def _record_use(self, keys: Sequence[CacheKey]) -> None:
        """Tell every tier's admission policy that a request used ``keys`` (stored or loaded)."""
        for tier in self._tiers:
            if tier.admission is not None and keys:
                try:
                    tier.admission.record_use(keys)
                except Exception as exc:  # noqa: BLE001 - a policy's bug is a counted fault
                    self._fault(tier, "admission.record_use", exc)

    def _admitted(self, tier: Tier, keys: list[CacheKey],
                  objs: list[MemoryObj]) -> tuple[list[CacheKey], list[MemoryObj]]:
        """The part of a store that ``tier``'s admission policy admits (all without a policy,
        or when the policy fails: the store goes on as it would without one)."""
        if tier.admission is None or not keys:
            return keys, objs
        try:
            ok = tier.admission.admit(keys, [o.nbytes for o in objs])
        except Exception as exc:  # noqa: BLE001
            self._fault(tier, "admission.admit", exc)
            return keys, objs
        return [k for k, a in zip(keys, ok) if a], [o for o, a in zip(objs, ok) if a]

    def _used(self, keys: list[CacheKey], objs: list[MemoryObj], served: list[int]) -> None:
        """Loads of ``keys`` (``objs[i]`` read from tier ``served[i]``): each is a use; a chunk
        another tier refused before is stored there now if its policy's ``admit_loaded`` says so."""
        self._record_use(keys)
        for tier in self._tiers:
            if tier.admission is None or not tier.admission.on_load:
                continue
            try:
                again = [i for i, r in enumerate(tier.admission.refused(keys))
                         if r and served[i] != tier.index]
                ok = tier.admission.admit_loaded([keys[i] for i in again],
                                                 [objs[i].nbytes for i in again]) if again else []
            except Exception as exc:  # noqa: BLE001
                self._fault(tier, "admission.admit_loaded", exc)
                continue
            self._put_to(tier, [keys[i] for i, a in zip(again, ok) if a],
                         [objs[i] for i, a in zip(again, ok) if a])

    def _put_encoded(self, tier: Tier, keys: list[CacheKey], objs: list[MemoryObj]) -> None:
        """A put to a tier with a codec runs on its encoder thread (encoding is CPU work that
        must not sit in the engine's step); the objects are held until it ran. A full queue
        (the codec cannot keep up) drops the store, as a full write queue does."""
        if tier.pending_puts() >= MAX_ENCODER_QUEUE:
            tier.codec.dropped(len(keys))
            return
        for obj in objs:
            obj.ref_up()

        def run() -> None:
            try:
                self._call(tier, "batched_submit_put", keys=keys, objs=list(objs))
            finally:
                for obj in objs:
                    obj.ref_down()

        try:
            tier.put_later(run)
        except RuntimeError as exc:  # the manager is closing: the store is dropped
            for obj in objs:
                obj.ref_down()
            self._fault(tier, "batched_submit_put", exc)

    # -- retrieve -------------------------------------------------------------------------------
    def get(self, key: CacheKey, *, promote: bool = True) -> MemoryObj | None:
        """The chunk from the fastest tier holding it; a lower-tier hit is promoted into L1."""
        for tier in self._tiers:
            obj = self._read_nowait(tier, [key])[0] if tier.reads_nowait() else None
            if obj is None:
                obj = self._call(tier, "get", bounded=True, key=key)
            if obj is not None:
                if promote and tier.index > 0:
                    self.promote(key, obj)
                self._used([key], [obj], [tier.index])
                return obj
        return None

    def promote(self, key: CacheKey, obj: MemoryObj) -> None:
        """Put a chunk read from a lower tier into L1 (the caller keeps its reference)."""
        if len(self._tiers) > 1:
            self._put_to(self._tiers[0], *self._admitted(self._tiers[0], [key], [obj]))

    def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """:meth:`get` for many keys, tier by tier: each tier is asked only for what the faster
        ones missed, a tier that implements ``batched_get`` in calls of up to
        :data:`~.tier_calls.BATCH_GET_KEYS` keys (concurrently, except a local medium's small
        values: :data:`~.tier_calls.SEQUENTIAL_READ_BYTES`), any other with one ``get`` per key
        (tiers that may block concurrently). Lower-tier hits are promoted into L1."""
        return self.batched_get_where(keys)[0]

    def batched_get_where(self, keys: Sequence[CacheKey]
                          ) -> tuple[list[MemoryObj | None], list[str | None]]:
        """:meth:`batched_get`, and the name of the tier each object came from (None: missed)."""
        keys = list(keys)
        out: list[MemoryObj | None] = [None] * len(keys)
        served = [-1] * len(keys)
        todo = list(range(len(keys)))
        for tier in self._tiers:
            if not todo:
                break
            for i, obj in zip(todo, self._read_from(tier, [keys[i] for i in todo])):
                if obj is not None:
                    self._hit(keys[i], obj, tier, i, out, served)
            todo = [i for i in todo if out[i] is None]
        self._served(keys, out, served)
        return out, [self._tiers[i].name if i >= 0 else None for i in served]

    def read_pinned(self, keys: Sequence[CacheKey], tiers: Sequence[str],
                    budget: WaitBudget) -> list[MemoryObj | None]:
        """What an engine step may read: each key from the one tier named for it (where its
        lookup found and pinned it), never from another, and only from a tier that never
        blocks or reads a medium on this machine (``local_medium``); every call of the batch
        shares ``budget`` (:meth:`wait_budget`). A key whose tier misses, is another kind, or
        is not answered within the budget is a miss. Lower-tier hits are promoted into L1."""
        keys = list(keys)
        out: list[MemoryObj | None] = [None] * len(keys)
        served = [-1] * len(keys)
        for tier in self._tiers:
            todo = [i for i, name in enumerate(tiers) if name == tier.name]
            if not todo:
                continue
            if not (tier.never_blocks or tier.local):
                self._log_once((tier.name, "read_pinned"),
                               "tier %r (%s) may block and is no local medium: an engine step "
                               "never reads it; %d key(s) sent there are misses (vLLM "
                               "recomputes)", tier.name, tier.config.backend, len(todo))
                continue
            for i, obj in zip(todo, self._read_from(tier, [keys[i] for i in todo], budget)):
                if obj is not None:
                    self._hit(keys[i], obj, tier, i, out, served)
        self._served(keys, out, served)
        return out

    def _hit(self, key: CacheKey, obj: MemoryObj, tier: Tier, i: int,
             out: list[MemoryObj | None], served: list[int]) -> None:
        """Key ``i`` of a batch read was found on ``tier``: noted, and promoted into L1 from
        a lower tier."""
        out[i], served[i] = obj, tier.index
        if tier.index > 0:
            self.promote(key, obj)

    def _served(self, keys: list[CacheKey], objs: list[MemoryObj | None],
                served: list[int]) -> None:
        """A batch read is over: every hit is a use (admission policies)."""
        hit = [i for i in range(len(keys)) if objs[i] is not None]
        if hit:
            self._used([keys[i] for i in hit], [objs[i] for i in hit],  # type: ignore[misc]
                       [served[i] for i in hit])

    def wait_budget(self, seconds: float) -> WaitBudget:
        """An allowance of ``seconds`` of waiting shared by a batch of reads (:meth:`read_pinned`,
        :meth:`get_layers`), on this manager's clock."""
        return WaitBudget(seconds, self.runtime.monotonic)

    def find_never_blocking(self, key: CacheKey) -> str | None:
        """The first tier that never blocks and holds ``key`` (no pin), or ``None``: where a
        step may read a key no lookup pinned, without waiting on anything."""
        for tier in self._tiers:
            if tier.never_blocks:
                found = self._call(tier, "contains", keys=[key], pin=False)
                if isinstance(found, list) and found and found[0]:
                    return tier.name
        return None

    def _read_from(self, tier: Tier, keys: list[CacheKey],
                   budget: WaitBudget | None = None) -> list[MemoryObj | None]:
        """One tier's answers for ``keys``: what it reads without waiting, on this thread
        (``batched_get_nowait``), then the rest through its bounded calls (see
        :meth:`batched_get`; ``budget``: see :meth:`_read_within`). A batch of a local
        medium's large values is spread over threads instead, whose copies run in parallel
        (:data:`~.tier_calls.SEQUENTIAL_READ_BYTES`)."""
        if not tier.reads_nowait() or (len(keys) > 1 and not tier.reads_in_sequence()):
            return self._read_waiting(tier, keys, budget)
        out = self._read_nowait(tier, keys)
        rest = [i for i, obj in enumerate(out) if obj is None]
        if rest:
            for i, obj in zip(rest, self._read_waiting(tier, [keys[i] for i in rest], budget)):
                out[i] = obj
        return out

    def _read_nowait(self, tier: Tier, keys: list[CacheKey]) -> list[MemoryObj | None]:
        """What ``tier`` reads of ``keys`` without waiting on its medium, on the caller's thread
        (``batched_get_nowait``; a fault or a wrong answer: nothing read)."""
        return self._batch_answer(tier, keys, self._call(tier, "batched_get_nowait", keys=keys),
                                  "batched_get_nowait")

    def _read_waiting(self, tier: Tier, keys: list[CacheKey],
                      budget: WaitBudget | None = None) -> list[MemoryObj | None]:
        """:meth:`_read_from` through the tier's calls that may wait."""
        if budget is not None and not tier.never_blocks:
            return self._read_within(tier, keys, budget)
        if len(keys) > 1 and tier.implements("batched_get"):
            groups = [keys[i : i + BATCH_GET_KEYS] for i in range(0, len(keys), BATCH_GET_KEYS)]
            parts = (self._readers.map(lambda g: self._batch_from(tier, g), groups)
                     if len(groups) > 1 and not tier.reads_in_sequence()
                     else [self._batch_from(tier, g) for g in groups])
            return [obj for part in parts for obj in part]

        def one(key: CacheKey) -> MemoryObj | None:
            return self._call(tier, "get", bounded=True, key=key)

        if tier.never_blocks or len(keys) == 1:
            return [one(k) for k in keys]
        return list(self._readers.map(one, keys))

    def _read_within(self, tier: Tier, keys: list[CacheKey],
                     budget: WaitBudget) -> list[MemoryObj | None]:
        """:meth:`_read_from` under one wait allowance for the whole batch: its calls go to the
        tier's own pool (never the shared readers, which background loads may keep busy) and
        are waited for with what is left of ``budget``; once it is spent, the rest are misses
        without a call. A local medium's small values one call after another, others all
        submitted at once (:data:`~.tier_calls.SEQUENTIAL_READ_BYTES`)."""
        batched = len(keys) > 1 and tier.implements("batched_get")
        step = BATCH_GET_KEYS if batched else 1
        groups = [keys[i : i + step] for i in range(0, len(keys), step)]
        hook = "batched_get" if batched else "get"

        def args(group: list[CacheKey]) -> dict[str, Any]:
            return {"keys": group} if batched else {"key": group[0]}

        def answer(group: list[CacheKey], got: Any) -> list[MemoryObj | None]:
            return self._batch_answer(tier, group, got) if batched else [got]

        out: list[MemoryObj | None] = []
        if tier.reads_in_sequence() or len(groups) == 1:
            for g in groups:
                out += answer(g, self._call(tier, hook, budget=budget, **args(g)))
            return out
        calls = [(g, args(g)) for g in groups]
        futs = [tier.call_async(hook, kw) for _, kw in calls] if not budget.spent() else []
        for i, (g, kw) in enumerate(calls):
            if i >= len(futs) or budget.spent():
                if i < len(futs):
                    tier.abandon(hook, futs[i], kw)
                out += answer(g, self._over_budget(tier, hook, budget))
                continue
            out += answer(g, self._wait(tier, hook, futs[i], kw, budget))
        return out

    def _batch_from(self, tier: Tier, keys: list[CacheKey]) -> list[MemoryObj | None]:
        """One bounded ``batched_get`` call; a fault, a timeout or a wrong answer: all misses."""
        return self._batch_answer(tier, keys, self._call(tier, "batched_get", bounded=True,
                                                         keys=keys))

    def _batch_answer(self, tier: Tier, keys: list[CacheKey], got: Any,
                      hook: str = "batched_get") -> list[MemoryObj | None]:
        """A tier's ``batched_get`` (``hook``) answer for ``keys`` as one object (or None) per
        key; a wrong answer (not a list of one answer per key) is a fault and all misses."""
        if isinstance(got, list) and len(got) == len(keys):
            tier.saw_reads(got)
            return got
        if got is not None:
            if isinstance(got, list):
                release(got)
            self._fault(tier, hook, ValueError(
                f"answered {type(got).__name__} of length {len(got) if isinstance(got, list) else '-'}"
                f" for {len(keys)} keys; a list of one answer per key is expected"))
        return [None] * len(keys)

    def never_blocks(self, tier: str) -> bool:
        """Whether tier ``tier`` never waits on I/O (its class sets ``never_blocks``): an engine
        step may read it. Every other tier may block: a load from it runs off the engine step,
        unless the tier is a local medium (:meth:`local_medium`)."""
        return any(t.name == tier and t.never_blocks for t in self._tiers)

    def local_medium(self, tier: str) -> bool:
        """Whether tier ``tier`` reads a medium on this machine (its class sets ``local_medium``):
        a small hit of it may load inside the engine step although the tier may block."""
        return any(t.name == tier and t.local for t in self._tiers)

    def reads_layers(self, tier: str) -> bool:
        """Whether tier ``tier`` implements ``get_layers`` (reads a layer range of a chunk)."""
        return any(t.name == tier and t.implements("get_layers") for t in self._tiers)

    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int,
                   tier: str | None = None, budget: WaitBudget | None = None
                   ) -> MemoryObj | None:
        """Layers ``[first_layer, first_layer + num_layers)`` of a chunk from the first tier that
        reads layer ranges and has it (only from ``tier`` when given); ``None`` if none has it.
        Layer-wise loads use it for chunks that lookup found in such a tier; ``budget``: the
        call waits at most what is left of it (:meth:`wait_budget`)."""
        for t in self._tiers:
            if not t.implements("get_layers") or tier not in (None, t.name):
                continue
            obj = self._call(t, "get_layers", bounded=True, budget=budget, key=key,
                             first_layer=first_layer, num_layers=num_layers)
            if obj is not None:
                if first_layer == 0:  # a layer-wise load reads layer 0 once per use
                    self._record_use([key])
                return obj
        return None

    def lookup_prefix(self, keys: Sequence[CacheKey], pin: bool = False,
                      fresh: bool = False) -> PrefixLookup:
        """How many leading ``keys`` some tier holds; optionally pin them where they are.
        ``fresh``: no tier answers from a miss it remembers (``forget_misses`` first): keys
        another engine announced it is storing."""
        if fresh:
            self.forget_misses(keys)
        n = len(keys)
        where: list[str | None] = [None] * n
        for tier in self._tiers:
            todo = [i for i in range(n) if where[i] is None]
            if not todo:
                break
            found = self._call(tier, "contains", bounded=True, keys=[keys[i] for i in todo],
                               pin=pin)
            for i, hit in zip(todo, found if isinstance(found, list) else ()):
                if hit:
                    where[i] = tier.name
        prefix = next((i for i, w in enumerate(where) if w is None), n)
        if pin:
            beyond = [(keys[i], where[i]) for i in range(prefix, n) if where[i] is not None]
            if beyond:
                self.unpin([k for k, _ in beyond], [t for _, t in beyond])
        return PrefixLookup(prefix, [w for w in where[:prefix] if w is not None], pin)

    def forget_misses(self, keys: Sequence[CacheKey]) -> None:
        """Every tier that remembers misses forgets those of ``keys`` (the optional
        ``forget_misses`` hook)."""
        for tier in self._tiers:
            if keys and tier.implements("forget_misses"):
                self._call(tier, "forget_misses", keys=list(keys))

    def unpin(self, keys: Sequence[CacheKey], tiers: Sequence[str]) -> None:
        """Release pins taken by ``lookup_prefix(pin=True)``; ``tiers[i]`` is where key i is."""
        by_tier: dict[str, list[CacheKey]] = {}
        for key, name in zip(keys, tiers):
            by_tier.setdefault(name, []).append(key)
        for tier in self._tiers:
            if tier.name in by_tier and tier.implements("unpin"):
                self._call(tier, "unpin", keys=by_tier[tier.name])

    def _named(self, tier: str) -> Tier:
        for t in self._tiers:
            if t.name == tier:
                return t
        raise ConfigError(f"unknown tier {tier!r}; tiers are {self.tier_names}")

    def implements(self, tier: str, hook: str) -> bool:
        """Whether tier ``tier``'s backend implements the (optional) hook ``hook``."""
        return self._named(tier).implements(hook)

    def tenant_usage(self, tier: str) -> dict[str, int] | None:
        """Bytes per tenant id on tier ``tier`` (the ``tenant_usage`` hook), or ``None`` when the
        tier cannot list its entries or did not answer."""
        t = self._named(tier)
        if not t.implements("tenant_usage"):
            return None
        answer = self._call(t, "tenant_usage", bounded=True)
        return dict(answer) if isinstance(answer, dict) else None

    def evict_tenant(self, tier: str, tenant: str) -> list[int] | None:
        """Drop tenant ``tenant``'s unpinned entries on tier ``tier`` (the ``evict_tenant``
        hook): ``[removed, left]``, or ``None`` when the tier raised or answered wrong.
        ``ConfigError`` when the tier cannot list its entries."""
        t = self._named(tier)
        if not t.implements("evict_tenant"):
            raise ConfigError(f"tier {tier!r} (backend {t.config.backend!r}) cannot list its "
                              "entries by tenant")
        answer = self._call(t, "evict_tenant", tenant=tenant)
        ok = isinstance(answer, list) and len(answer) == 2
        return [int(x) for x in answer] if ok else None

    def operator_pin(self, tier: str, keys: Sequence[CacheKey], pin: bool = True
                     ) -> list[str] | list[bool] | None:
        """An operator's pin (``pin``) or unpin of ``keys`` on tier ``tier`` (the
        ``operator_pin``/``operator_unpin`` hooks; the tier's ``max_pinned_fraction`` bounds them):
        one answer per key; ``None`` when the tier raised or answered wrong. ``ConfigError``
        when the tier cannot pin (its backend has no such hook)."""
        hook = "operator_pin" if pin else "operator_unpin"
        t = self._named(tier)
        if not t.implements(hook):
            raise ConfigError(f"tier {tier!r} (backend {t.config.backend!r}) cannot pin entries: "
                              "its store evicts by itself")
        if not keys:
            return []
        answer = self._call(t, hook, bounded=True, keys=list(keys))
        if not isinstance(answer, list) or len(answer) != len(keys):
            return None
        return answer

    def contains(self, key: CacheKey) -> str | None:
        """The name of the first tier holding ``key``, or ``None``."""
        hit = self.lookup_prefix([key])
        return hit.tiers[0] if hit.num_chunks else None

    def holds(self, tier: str, keys: Sequence[CacheKey]) -> list[bool] | None:
        """Which of ``keys`` tier ``tier`` holds (no pins; bounded by its ``timeout_s``), or
        ``None`` when the tier did not answer (a fault or a timeout: unknown, not absent)."""
        found = [t for t in self._tiers if t.name == tier]
        if not found:
            raise ConfigError(f"unknown tier {tier!r}; tiers are {self.tier_names}")
        if not keys:
            return []
        answer = self._call(found[0], "contains", bounded=True, keys=list(keys), pin=False)
        if not isinstance(answer, list) or len(answer) != len(keys):
            return None
        return [bool(x) for x in answer]

    # -- housekeeping ---------------------------------------------------------------------------
    def evict(
        self,
        keys: Sequence[CacheKey] | None = None,
        nbytes: int = 0,
        tiers: Sequence[str] | None = None,
    ) -> int:
        """Drop ``keys`` (or free ``nbytes``) in every tier, or only in ``tiers``; bytes freed."""
        unknown = set(tiers or ()) - set(self.tier_names)
        if unknown:
            raise ConfigError(f"unknown tier(s) {sorted(unknown)}; tiers are {self.tier_names}")
        total = 0
        for tier in self._tiers:
            if tiers is not None and tier.name not in tiers:
                continue
            total += self._call(tier, "evict", keys=None if keys is None else list(keys),
                                nbytes=nbytes) or 0
        return total

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued writes on every tier; True if all drained."""
        ok = True
        for tier in self._tiers:
            ok = tier.wait_puts(timeout) and ok
            if tier.implements("flush"):
                ok = bool(self._call(tier, "flush", timeout=timeout)) and ok
        return ok

    def stats(self) -> dict[str, dict[str, float]]:
        """Per tier: the metrics wrapper's counters, faults, timeouts and the backend's stats."""
        out: dict[str, dict[str, float]] = {}
        for tier in self._tiers:
            entry = tier.metrics.snapshot()
            entry["faults"] = tier.faults
            entry["timeouts"] = tier.timeouts
            entry["deadline_misses"] = tier.deadline_misses
            if tier.auth is not None:
                entry["auth_failures"] = tier.auth.failures
            if tier.admission is not None:
                try:
                    entry.update(tier.admission.stats())
                except Exception as exc:  # noqa: BLE001
                    self._fault(tier, "admission.stats", exc)
            codec = tier.codec.snapshot() if tier.codec is not None else {}
            if tier.codec is not None and (tier.codec.codec is not None or any(codec.values())):
                entry.update(codec)
            if tier.implements("stats"):
                entry.update(self._call(tier, "stats") or {})
            out[tier.name] = entry
        if self._tiers:  # reads refused or sent to the heap: the manager's, shown with L1
            out[self._tiers[0].name].update(self.reads.stats())
            if any(self.heap.counts.values()):  # no tier owns a pool: heap memory reused
                out[self._tiers[0].name].update(self.heap.stats())
        return out

    def start_threads(self) -> None:
        """Start the readers' and every tier's call threads now (an engine's start-up), not on
        the first store and load that need them."""
        self.runtime.start_threads(self._readers, READERS)
        for tier in self._tiers:
            if tier.pool is not None:
                self.runtime.start_threads(tier.pool, TIER_THREADS)
            if tier.encoder is not None:
                self.runtime.start_threads(tier.encoder, 1)

    def close(self) -> None:
        """Drain writes and release every tier; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for tier in self._tiers:
            if not tier.wait_puts(30.0):
                logger.warning("tier %r: encoding puts still queued at close are dropped",
                               tier.name)
        for tier in reversed(self._tiers):
            if "close" in tier.hooks and tier.implements("close"):
                self._call(tier, "close")
        for tier in self._tiers:
            tier.shutdown()
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.heap.clear()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

