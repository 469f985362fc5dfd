"""An operator's management calls as events of the simulation (:class:`Operator`, a part of
:class:`.world.World`), and the check of what a clear leaves (:class:`ClearCheck`, another):
clears (all, a few chunks as a prefix clear names them, one tenant) and
pins/unpins, made through :mod:`kvplug.management` exactly as the workers' management service
makes them, on both ranks' tiers.

Invariant **I8**, a clear tells the truth:

* right after a clear, no tier that can do it (L1, posix; the value store for a clear of named
  chunks) still holds a chunk the clear targeted unless it was pinned (by a lookup or an
  operator) or in use (L1: a reader holds the object) when the clear began or when it ended;
* a chunk the clear left in no tier is never served afterwards (a tier's ``get`` answers it)
  unless it was stored again since.

A pinned chunk is never evicted: I7 already watches every eviction, an operator's pins
included. Pins an operator took are released at quiescence (as a client's unpin), so I5 still
finds no pin left.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .engine import RANKS, Violation

if TYPE_CHECKING:
    from .world import World

#: the clear scopes a schedule draws
SCOPES = ("all", "prefix", "tenant")


def with_manage_events(seed: int, events: list[tuple]) -> list[tuple]:
    """``events`` with clears and pins inserted, from a stream of their own, in about half the
    seeds (the others keep their schedules; so do the suite's regression seeds, 128, 294, 331
    and 7003276, which this stream leaves out)."""
    rng = random.Random(seed * 7919 + 34)
    if rng.random() >= 0.5:
        return events
    out: list[tuple] = []
    for ev in events:
        out.append(ev)
        x = rng.random()
        if x < 0.05:
            out.append(("clear", rng.choice(SCOPES), rng.randrange(16)))
        elif x < 0.09:
            out.append((rng.choice(("pin", "pin", "unpin")), rng.randrange(RANKS),
                        rng.randrange(16)))
    return out


class Operator:
    """An operator's clear and pin events, made through :mod:`kvplug.management` on every
    rank's storage as the workers' management service makes them; each clear is checked by the
    world's :class:`ClearCheck`. Reads from the world: the workers' storage and the chunks the
    tiers held (:attr:`.ChunkCheck.stored`); counts the clears and pins. Its state: per rank,
    the chunks an operator pinned (released at quiescence)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pins: list[set] = [set() for _ in range(world.cfg.tp)]

    def clear(self, scope: str, pick: int) -> None:
        """A clear of ``scope`` (:data:`SCOPES`; ``pick`` chooses the chunks or the tenant) on
        every rank, each checked by the world's :class:`ClearCheck` around the call."""
        from kvplug.management import clear_keys, clear_tenant, clear_tiers

        w = self.world
        check = w.clears
        for rank, worker in enumerate(w.workers):
            st = worker.storage
            keys = sorted(set(w.chunks.stored[rank]), key=w.chunks.stored[rank].index)
            if st is None or not keys:
                continue
            if scope == "prefix":  # a prefix clear names a few consecutive chunks
                start = pick % len(keys)
                target = keys[start:start + 3]
                check.begin(rank, st, keys, target, keyed=True)
                res = clear_keys(st, target)
            elif scope == "tenant":
                tenant = sorted({k.tenant for k in keys})[pick % len({k.tenant for k in keys})]
                target = [k for k in keys if k.tenant == tenant]
                check.begin(rank, st, keys, target, keyed=False)
                res = clear_tenant(st, tenant)
            else:
                target = keys
                check.begin(rank, st, keys, target, keyed=False)
                res = clear_tiers(st)
            w.counts[f"clear {scope}"] += 1
            check.end(rank, st, res)

    def pin(self, rank: int, pick: int, on: bool) -> None:
        from kvplug.management import pin_keys

        w = self.world
        rank %= len(w.workers)  # drawn over the default TP size; the seed's may be smaller
        st = w.workers[rank].storage
        keys = w.chunks.stored[rank]
        if st is None or not keys:
            return
        key = keys[pick % len(keys)]
        res = pin_keys(st, [key], pin=on)
        if on:
            self.pins[rank].add(key)
        w.counts["operator " + ("pins" if on else "unpins") + " taken"] += sum(
            int(r.get("pinned" if on else "unpinned") or 0) for r in res.values())

    def release_pins(self) -> None:
        """At quiescence: unpin everything an operator pinned (late pins included)."""
        from kvplug.management import pin_keys

        for rank, w in enumerate(self.world.workers):
            if self.pins[rank] and w.storage is not None:
                pin_keys(w.storage, sorted(self.pins[rank], key=repr), pin=False)
                self.pins[rank].clear()


@dataclass
class _Clearing:
    """One rank's clear in progress: what it targets, and what stood before it began."""

    keys: list  # every chunk the rank's tiers held (in the order first stored)
    target: list
    pinned_before: set
    evictable: dict[str, set]


class ClearCheck:
    """I8 (see the module docstring). Reads from the world: nothing but the storage each clear
    runs on (its tiers' pins, readers, queued writes), and the neighbour process's queued writes
    on rank 0's directory (``neighbour``). Its state: per rank, the chunks a clear removed from every
    tier (never served again unless stored again), the chunks stored while a clear runs, and the
    clear in progress."""

    def __init__(self, world: World) -> None:
        self.world = world
        #: per rank: chunks a clear removed from every tier -> the order they were cleared in
        self.cleared: list[dict[Any, int]] = [{} for _ in range(world.cfg.tp)]
        #: chunks stored while a clear runs (its waits run the other tasks: saves, writers, the
        #: neighbour's writes): stores again, not what the clear left (None: no clear runs)
        self.storing: set | None = None
        self._clearing: _Clearing | None = None

    def begin(self, rank: int, st: Any, keys: list, target: list, keyed: bool) -> None:
        """A clear of ``target`` (named chunks when ``keyed``) is about to run on ``st``."""
        self.storing = self._queued_stores(rank, st, keys)
        pinned_before = self._pinned(st, keys)
        self._clearing = _Clearing(keys, target, pinned_before,
                                   self._evictable(st, target, keyed=keyed))

    def end(self, rank: int, st: Any, res: dict[str, dict[str, Any]]) -> None:
        """The clear begun on ``st`` answered ``res``: I8 on what it left."""
        c, self._clearing = self._clearing, None
        assert c is not None
        stored_meanwhile, self.storing = self.storing, None
        # a chunk pinned before or after (a lookup's pin holds a posix file open: served from
        # that descriptor even once another process sharing the directory deleted the file)
        protected = c.pinned_before | self._pinned(st, c.keys)
        self._check_cleared(rank, st, c.evictable, c.target, self.cleared[rank], res,
                            (stored_meanwhile or set()) | protected)

    def _queued_stores(self, rank: int, st: Any, keys: list) -> set:
        """Keys whose store is queued on a tier (or by the neighbour process) as the clear begins:
        such a store may land after the clear (its response says so), a store again."""
        out: set = set()
        tiers = [st.backend(t) for t in st.tier_names]
        neighbour = self.world.neighbour
        if rank == 0 and neighbour is not None:
            tiers += [neighbour.backend(t) for t in neighbour.tier_names]
        for tier in tiers:
            if hasattr(tier, "writer") and hasattr(tier, "directory"):  # posix
                with tier.directory.lock:
                    out |= {k for k in keys if tier._rel(k) in tier.writer.pending}
            elif hasattr(tier, "_writer") and hasattr(tier, "name_of"):  # a value store
                out |= {k for k in keys if tier._writer.protected(tier.name_of(k))
                        and tier.name_of(k) not in tier._pins}
        return out

    @staticmethod
    def _pinned(st: Any, keys: list) -> set:
        """Keys some tier of ``st`` keeps pinned now (L1: pinned or held by a reader; posix:
        pinned or its file held open; a value store: pinned)."""
        out: set = set()
        l1 = st.backend("local_cpu")
        with l1._lock:
            out |= {k for k in keys if k in l1._pins
                    or (k in l1._entries and l1._entries[k].ref_count > 1)}
        if "posix" in st.tier_names:
            disk = st.backend("posix")
            with disk.directory.lock:
                out |= {k for k in keys if (rel := disk._rel(k)) in disk.directory.index.pins
                        or rel in disk.held._counts}
        if "values" in st.tier_names:
            tier = st.backend("values")
            out |= {k for k in keys if tier.name_of(k) in tier._pins}
        return out

    @staticmethod
    def _evictable(st: Any, keys: list, keyed: bool) -> dict[str, set]:
        """Per tier that can clear them: the keys it holds that nothing protects now (not
        pinned; L1: no reader holds the object). The value store only for named keys."""
        out: dict[str, set] = {}
        l1 = st.backend("local_cpu")
        with l1._lock:
            out["local_cpu"] = {k for k in keys if k in l1._entries and k not in l1._pins
                                and l1._entries[k].ref_count == 1}
        if "posix" in st.tier_names:
            disk = st.backend("posix")
            index = disk.directory.index
            with disk.directory.lock:
                out["posix"] = {k for k in keys if (rel := disk._rel(k)) in index
                                and rel not in index.pins and rel not in disk.writer.pending}
        elif keyed and "values" in st.tier_names:
            tier = st.backend("values")
            held = st.holds("values", keys) or [False] * len(keys)
            out["values"] = {k for k, h in zip(keys, held, strict=True)
                             if h and tier.name_of(k) not in tier._pins}
        return out

    def _check_cleared(self, rank: int, st: Any, evictable: dict[str, set], target: list,
                       cleared: dict[Any, int], res: dict[str, dict[str, Any]],
                       excused: set) -> None:
        """I8 after a clear: no target left on a tier that answered (one in a fault says its
        removal is unknown) that nothing protected before or after it; the targets gone from
        every tier that answered are recorded as cleared (never served again unless stored
        again). ``excused``: stored again while the clear ran, or pinned before or after it."""
        answered = {t for t, r in res.items() if not r.get("error")}
        for tier, keys in evictable.items():
            keys = keys - excused
            if not keys or tier not in answered:
                continue
            ordered = sorted(keys, key=repr)
            held = st.holds(tier, ordered)
            if held is None:  # the tier did not answer (gated): unknown, not checked
                continue
            left = [k for k, h in zip(ordered, held, strict=True) if h]
            # protected now: pinned while the clear ran (a lookup, or an operator's pin whose
            # call timed out and landed late, as its answer warned) is as good as before
            left = [k for k in left if k in self._evictable(st, left, keyed=True).get(tier, ())]
            if left:
                raise Violation("I8", f"rank {rank}: a clear left {len(left)} unpinned chunk(s) "
                                      f"on {tier}: {left[0]}")
        if answered != set(st.tier_names):  # a tier's answer unknown: nothing is known cleared
            return
        for key in target:
            if key in excused:
                continue
            answers = [st.holds(t, [key]) for t in st.tier_names]
            if all(a == [False] for a in answers):
                cleared[key] = len(cleared)

    def restored(self, rank: int, keys: Any) -> None:
        """Chunks stored again (any tier's put): served from now on as they may."""
        for k in keys:
            self.cleared[rank].pop(k, None)
        if self.storing is not None:
            self.storing.update(keys)

    def check_served(self, rank: int, key: Any) -> None:
        """A tier answered ``key``: a violation when a clear removed it and nothing stored it
        again since."""
        if key in self.cleared[rank]:
            raise self.world.keep(Violation(
                "I8", f"rank {rank}: a chunk cleared from every tier was served: {key}"))
