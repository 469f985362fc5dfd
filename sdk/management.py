"""What an operator's management calls do to a StorageManager's tiers, and what they report.

The one place for the rules of kvplug's management calls, whoever makes them: the workers'
management service inside vLLM (``kvplug.connector.worker.management``, behind the HTTP API of
``kvplug serve``) and ``kvplug cache status|clear --config FILE`` on the stores directly. Nothing
here imports vLLM.

Every result is per tier and measured, never assumed (a clear that could not be done on a tier
says so on that tier):

* a clear of named keys asks each tier which of them it holds before and after the evict
  (``StorageManager.holds``): ``removed`` is what the tier stopped holding, ``remaining`` what it
  still holds (pinned by a load in flight, or a fault), ``unknown`` when it did not answer;
* a clear of a whole tier flushes its queued writes first (so nothing queued lands after it),
  evicts every unpinned entry it knows, waits (bounded) for a disk tier's background deletes, and
  reports its entry counts before and after from the tier's own ``stats()`` (a disk tier still
  scanning its directory at start-up is waited for, bounded, else the clear says incomplete); a tier that keeps no
  count of its entries (an unbounded value store) cannot be cleared whole and says so;
* a tier whose evict raised or timed out reports ``error``;
* an operator's pin or unpin (:func:`pin_keys`) answers per tier what was pinned, what the tier
  does not hold and what its ``max_pinned_fraction`` refused; a tier that cannot pin says so;
* a clear by tenant (:func:`clear_tenant`) removes the tenant's entries on the tiers that can
  list them (tenants are in object names) and measures the tenant's bytes before and after; a
  tier that cannot says it is not available.

A clear of a token prefix removes the chunks of that prefix; every longer prompt starting with it
chains its chunk hashes over them, so no lookup of such a prompt hits past the cleared start.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .config import PolicyConfig
from .errors import ConfigError
from .keys import CacheKey
from .storage_manager import StorageManager

#: "every byte": what a clear of a whole tier asks its evict to free
ALL_BYTES = 1 << 62
#: how long a clear waits for queued writes to land and a disk tier's deletes to happen
SETTLE_S = 10.0
#: the policy a tier runs when its config sets none (status reports it so)
DEFAULT_POLICIES = {"eviction": "lru", "admission": "always"}
#: what status shows of a tier's own counters (the rest are in /metrics)
STATUS_FIELDS = ("entries", "bytes", "capacity", "pinned", "operator_pinned",
                 "operator_pinned_bytes", "pending_writes", "pending_deletes",
                 "breaker_open", "breaker_trips", "faults", "timeouts", "corrupt",
                 "auth_failures", "evictions", "dropped_puts")


def _count(value: Any) -> int | None:
    return None if value is None else int(value)


def policy_settings(chosen: PolicyConfig | None, default: str) -> dict[str, Any]:
    """A tier's eviction or admission policy as its config says it (``{"policy": NAME,
    ...options}``; ``default`` when none is set), in plain JSON values: a status answer is
    encoded by msgpack and JSON, which take no config objects."""
    if chosen is None:
        return {"policy": default}
    return json.loads(json.dumps({"policy": chosen.policy, **chosen.options()}, default=str))


def tier_status(storage: StorageManager) -> list[dict[str, Any]]:
    """Each tier: name, backend, whether it never blocks (``never_blocks``; ``may_block``, its
    negation, is kept for readers of the old answer and deprecated), its capacity and use,
    breaker state, pins and the policies it runs (as configured; kvplug's built-in ones
    otherwise)."""
    for name in storage.tier_names:
        wait_indexed(storage, name)
    stats = storage.stats()
    out = []
    for cfg, name in zip(storage.config.tiers, storage.tier_names, strict=True):
        s = stats.get(name, {})
        breaker = s.get("breaker_open")
        out.append({
            "name": name, "backend": cfg.backend, "never_blocks": storage.never_blocks(name),
            "may_block": not storage.never_blocks(name),  # deprecated: not never_blocks
            "capacity_bytes": _count(s.get("capacity")), "used_bytes": _count(s.get("bytes")),
            "entries": _count(s.get("entries")), "pinned": _count(s.get("pinned")),
            "operator_pinned": _count(s.get("operator_pinned")),
            "operator_pinned_bytes": _count(s.get("operator_pinned_bytes")),
            "breaker": None if breaker is None else ("open" if breaker else "closed"),
            "policies": {kind: policy_settings(getattr(cfg, kind, None), default)
                         for kind, default in DEFAULT_POLICIES.items()},
            "counters": {k: s[k] for k in STATUS_FIELDS if k in s},
        })
    return out


def _breaker_open(storage: StorageManager, name: str) -> bool:
    return bool(storage.stats().get(name, {}).get("breaker_open"))


def _unreachable(storage: StorageManager, name: str, res: dict[str, Any], was_open: bool) -> None:
    """A clear of a tier whose store was unreachable (its circuit breaker open before or after)
    is not complete, whatever the tier answered: an open breaker answers "not held" for what it
    cannot reach, and deletes are not sent."""
    if was_open or _breaker_open(storage, name):
        res.update(complete=False, error="the store was unreachable (its circuit breaker is "
                   "open): what it holds and what this clear removed are unknown; clear again "
                   "once it is back")


def _faults(storage: StorageManager, name: str) -> float:
    s = storage.stats().get(name, {})
    return s.get("faults", 0) + s.get("timeouts", 0)


def clear_keys(storage: StorageManager, keys: Sequence[CacheKey],
               tiers: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Drop ``keys`` from ``tiers`` (all by default); per tier what it held before and after."""
    out: dict[str, dict[str, Any]] = {}
    for name in tiers or storage.tier_names:
        before = storage.holds(name, keys)
        faults = _faults(storage, name)
        was_open = _breaker_open(storage, name)
        freed = storage.evict(keys=list(keys), tiers=[name])
        after = storage.holds(name, keys)
        res: dict[str, Any] = {"removed_bytes": freed}
        if before is None or after is None:
            res.update(removed=None, remaining=None,
                       error="the tier did not answer which keys it holds (fault or timeout): "
                             "what it removed is unknown")
        else:
            res.update(held_before=sum(before), removed=sum(b and not a for b, a in
                                                            zip(before, after, strict=True)),
                       remaining=sum(after))
            if res["remaining"]:
                res["note"] = ("entries still held: pinned by a load in flight or by an "
                               "operator (kvplug cache unpin), or the tier refused to delete "
                               "them; clear again once loads are over")
        if _faults(storage, name) > faults:
            res["error"] = "the tier's evict raised or timed out (see the engine's log)"
        _unreachable(storage, name, res, was_open)
        out[name] = res
    return out


def _wait_until(storage: StorageManager, done: Callable[[], bool], timeout: float) -> bool:
    """Poll ``done`` every 50 ms for up to ``timeout`` seconds, through the storage's runtime
    (:mod:`kvplug.runtime`: real time in production; under the deterministic simulation the
    wait runs the queued tasks it waits for)."""
    runtime = storage.runtime
    cond = runtime.condition(threading.Lock())
    end = runtime.monotonic() + timeout
    with cond:
        while not done():
            left = end - runtime.monotonic()
            if left <= 0:
                return False
            cond.wait_for(done, min(0.05, left))
    return True


def wait_indexed(storage: StorageManager, name: str, timeout: float = SETTLE_S) -> bool:
    """Whether the tier knows all its entries: a disk tier scans its directory at start-up
    (``indexed`` 0 until done); waits up to ``timeout`` for it."""
    return _wait_until(storage, lambda: storage.stats().get(name, {}).get("indexed", 1) != 0,
                       timeout)


def _settle(storage: StorageManager, name: str) -> dict[str, float]:
    """The tier's stats once its background deletes are done (bounded by :data:`SETTLE_S`)."""
    _wait_until(storage, lambda: not storage.stats().get(name, {}).get("pending_deletes"),
                SETTLE_S)
    return storage.stats().get(name, {})


def clear_tiers(storage: StorageManager, tiers: Sequence[str] | None = None
                ) -> dict[str, dict[str, Any]]:
    """Drop every unpinned entry of ``tiers`` (all by default); per tier what was removed."""
    names = list(tiers or storage.tier_names)
    flushed = storage.flush(SETTLE_S)  # queued writes land now, not after the clear
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        indexed = wait_indexed(storage, name)
        before = storage.stats().get(name, {})
        was_open = _breaker_open(storage, name)
        faults = _faults(storage, name)
        freed = storage.evict(nbytes=ALL_BYTES, tiers=[name])
        after = _settle(storage, name)
        res: dict[str, Any] = {"removed_bytes": freed}
        if "entries" not in before or "entries" not in after:
            res.update(removed=None, remaining=None, complete=False,
                       error="this tier keeps no count of its entries (an unbounded store: no "
                             "capacity option), so it cannot be cleared whole; clear a token "
                             "prefix, or empty the store with its own tools")
        else:
            res.update(entries_before=int(before["entries"]),
                       removed=max(0, int(before["entries"]) - int(after["entries"])),
                       remaining=int(after["entries"]),
                       pending_deletes=int(after.get("pending_deletes", 0)))
            res["complete"] = not res["remaining"] and not res["pending_deletes"]
            if not res["complete"]:
                res["note"] = ("entries left: pinned by loads in flight or by an operator "
                               "(kvplug cache unpin), or deletes still pending; clear again "
                               "once loads are over")
        if not indexed:
            res["complete"] = False
            res["error"] = ("the tier is still scanning its directory: entries it has not "
                            "indexed yet were not cleared; clear again")
        if not flushed:
            res["note"] = ("writes were still queued after the wait: they may land after this "
                           "clear")
        if _faults(storage, name) > faults:
            res["error"] = "the tier's evict raised or timed out (see the engine's log)"
            res["complete"] = False
        _unreachable(storage, name, res, was_open)
        out[name] = res
    return out


def clear_tenant(storage: StorageManager, tenant: str, tiers: Sequence[str] | None = None
                 ) -> dict[str, dict[str, Any]]:
    """Drop tenant id ``tenant``'s unpinned entries from ``tiers`` (all by default). Queued
    writes land first; per tier the entries removed and left (the tier's count) and the bytes
    it held for the tenant before and after (measured: ``tenant_usage``); ``complete`` only
    when the tier then holds no byte of the tenant. A tier that cannot list its entries by
    tenant (a store that evicts by itself) says it is not available."""
    flushed = storage.flush(SETTLE_S)
    out: dict[str, dict[str, Any]] = {}
    for name in tiers or storage.tier_names:
        if not storage.implements(name, "evict_tenant"):
            out[name] = {"removed": None, "removed_bytes": 0, "remaining": None,
                         "complete": False, "error": (
                             "clear by tenant is not available on this tier: its store cannot "
                             "list entries by tenant (and evicts by itself); clear by prefix "
                             "with the tenant's cache_salt, or empty the store with its tools")}
            continue
        wait_indexed(storage, name)
        was_open = _breaker_open(storage, name)
        before = (storage.tenant_usage(name) or {}).get(tenant, 0)
        faults = _faults(storage, name)
        answer = storage.evict_tenant(name, tenant)
        _settle(storage, name)
        after = storage.tenant_usage(name)
        left = None if after is None else after.get(tenant, 0)
        res: dict[str, Any] = {"removed_bytes": before - (left or 0), "remaining_bytes": left}
        if answer is None or left is None:
            res.update(removed=None, remaining=None, complete=False,
                       error="the tier did not answer (fault or timeout): what it removed is "
                             "unknown")
        else:
            res.update(removed=answer[0], remaining=answer[1], complete=left == 0)
            if not res["complete"]:
                res["note"] = ("entries left: pinned by loads in flight or by an operator "
                               "(kvplug cache unpin), or stored meanwhile; clear again")
        if not flushed:
            res["note"] = "writes were still queued after the wait: they may land after this clear"
        if _faults(storage, name) > faults:
            res.update(complete=False, error="the tier's evict raised or timed out (see the log)")
        _unreachable(storage, name, res, was_open)
        out[name] = res
    return out


def pin_keys(storage: StorageManager, keys: Sequence[CacheKey], tiers: Sequence[str] | None = None,
             pin: bool = True, optional: Sequence[CacheKey] = ()) -> dict[str, dict[str, Any]]:
    """An operator's pin (or with ``pin`` False, unpin) of ``keys`` on ``tiers`` (all by
    default); per tier what was done. ``optional`` keys (a prompt's partial chunks: a tier holds
    at most some of them) are pinned where held and never counted as absent.

    Per tier: ``pinned`` (chunks pinned now or already), ``absent`` (chunks of ``keys`` the tier
    does not hold), ``refused`` (past the tier's ``max_pinned_fraction``, with the reason),
    ``pinned_bytes``/``limit_bytes`` (operators' pins on the tier after the call, and their
    bound); an unpin: ``unpinned`` and ``not_pinned``. ``complete`` when the tier did all of it;
    a tier that cannot pin (its store evicts by itself) says so, ``complete`` false."""
    every = list(keys) + list(optional)
    out: dict[str, dict[str, Any]] = {}
    for name in tiers or storage.tier_names:
        faults = _faults(storage, name)
        unsaved = storage.stats().get(name, {}).get("pins_not_saved", 0)
        try:
            answer = storage.operator_pin(name, every, pin)
        except ConfigError as exc:
            out[name] = {"complete": False, "available": False,
                         "error": f"{exc}; pins are not available on this tier"}
            continue
        res: dict[str, Any] = {"available": True}
        if answer is None:
            res.update(complete=False, error="the tier did not answer (fault or timeout): what "
                       "it pinned is unknown; unpin to release what it may hold")
        elif pin:
            main = answer[:len(keys)]
            res.update(pinned=sum(a == "pinned" for a in answer),
                       absent=sum(a == "absent" for a in main),
                       refused=sum(a == "over_limit" for a in answer))
        else:
            res.update(unpinned=sum(bool(a) for a in answer),
                       not_pinned=sum(not a for a in answer[:len(keys)]))
        s = storage.stats().get(name, {})
        cap = s.get("capacity")
        res["pinned_bytes"] = _count(s.get("operator_pinned_bytes"))
        fraction = next(t.max_pinned_fraction for t in storage.config.tiers
                        if t.tier_name == name)
        res["limit_bytes"] = None if cap is None else int(fraction * cap)
        if res.get("refused"):
            res["error"] = (f"{res['refused']} chunk(s) refused: pinning them would take the "
                            f"bytes pinned on tier {name!r} past max_pinned_fraction "
                            f"{fraction:g} of its capacity ({res['limit_bytes']} bytes; "
                            f"{res['pinned_bytes']} pinned); raise max_pinned_fraction in the "
                            "tier's config, or unpin other chunks")
        if res.get("absent"):
            res["note"] = (f"{res['absent']} chunk(s) not held by this tier (not stored yet, or "
                           "evicted): warm the prompt, then pin again")
        if "complete" not in res:
            res["complete"] = not res.get("refused") and not res.get("absent")
        if s.get("pins_not_saved", 0) > unsaved:
            res.update(complete=False, error="the tier's pins file could not be updated (its "
                       "lock was held by another process, or a write failed; see the log): the "
                       "change holds in this process, not across a restart; try again")
        if _faults(storage, name) > faults:
            res.update(complete=False, error="the tier's pin raised or timed out (see the log)")
        out[name] = res
    return out
