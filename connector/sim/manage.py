"""An operator's management calls as events of the simulation, a part of
:class:`.world.World`: clears (all, a few chunks as a prefix clear names them, one tenant) and
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
from typing import Any

from .engine import RANKS, Violation

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


class ManageEvents:
    """The clear and pin events of :class:`.world.World` and their checks (I8)."""

    workers: list[Any]
    stored: list[list[Any]]
    counts: Any
    violation: Violation | None

    def _manage_state(self) -> tuple[list[dict[Any, int]], list[set]]:
        """Per rank: cleared chunks (key -> the event that cleared it), chunks pinned."""
        if "_cleared" not in self.__dict__:
            ranks = len(self.workers)  # the seed's TP size
            self._cleared: list[dict[Any, int]] = [{} for _ in range(ranks)]
            self._op_pins: list[set] = [set() for _ in range(ranks)]
        return self._cleared, self._op_pins

    # -- events ---------------------------------------------------------------------------------
    def clear(self, scope: str, pick: int) -> None:
        from kvplug.management import clear_keys, clear_tenant, clear_tiers

        cleared, _ = self._manage_state()
        for rank, w in enumerate(self.workers):
            st = w.storage
            keys = sorted(set(self.stored[rank]), key=self.stored[rank].index)
            if st is None or not keys:
                continue
            # stores that land while the clear runs (its waits run the other tasks: saves,
            # writers, the neighbour's writes) are stores again, not what the clear left
            self._storing: set | None = self._queued_stores(rank, st, keys)
            pinned_before = self._pinned(st, keys)
            if scope == "prefix":  # a prefix clear names a few consecutive chunks
                start = pick % len(keys)
                target = keys[start:start + 3]
                evictable = self._evictable(st, target, keyed=True)
                res = clear_keys(st, target)
            elif scope == "tenant":
                tenant = sorted({k.tenant for k in keys})[pick % len({k.tenant for k in keys})]
                target = [k for k in keys if k.tenant == tenant]
                evictable = self._evictable(st, target, keyed=False)
                res = clear_tenant(st, tenant)
            else:
                target = keys
                evictable = self._evictable(st, target, keyed=False)
                res = clear_tiers(st)
            stored_meanwhile, self._storing = self._storing, None
            self.counts[f"clear {scope}"] += 1
            # a chunk pinned before or after (a lookup's pin holds a posix file open: served from
            # that descriptor even once another process sharing the directory deleted the file)
            protected = pinned_before | self._pinned(st, keys)
            self._check_cleared(rank, st, evictable, target, cleared[rank], res,
                                (stored_meanwhile or set()) | protected)

    def _queued_stores(self, rank: int, st: Any, keys: list) -> set:
        """Keys whose store is queued on a tier (or by the neighbour process) as the clear begins:
        such a store may land after the clear (its response says so), a store again."""
        out: set = set()
        tiers = [st.backend(t) for t in st.tier_names]
        nb = getattr(self, "nb", None)
        if rank == 0 and nb is not None:
            tiers += [nb.backend(t) for t in nb.tier_names]
        for tier in tiers:
            if hasattr(tier, "writer") and hasattr(tier, "directory"):  # posix
                with tier.directory.lock:
                    out |= {k for k in keys if tier._rel(k) in tier.writer.pending}
            elif hasattr(tier, "_writer") and hasattr(tier, "name_of"):  # a value store
                out |= {k for k in keys if tier._writer.protected(tier.name_of(k))
                        and tier.name_of(k) not in tier._pins}
        return out

    def pin(self, rank: int, pick: int, on: bool) -> None:
        from kvplug.management import pin_keys

        _, pins = self._manage_state()
        rank %= len(self.workers)  # drawn over the default TP size; the seed's may be smaller
        st = self.workers[rank].storage
        keys = self.stored[rank]
        if st is None or not keys:
            return
        key = keys[pick % len(keys)]
        res = pin_keys(st, [key], pin=on)
        if on:
            pins[rank].add(key)
        self.counts["operator " + ("pins" if on else "unpins") + " taken"] += sum(
            int(r.get("pinned" if on else "unpinned") or 0) for r in res.values())

    def release_operator_pins(self) -> None:
        """At quiescence: unpin everything an operator pinned (late pins included)."""
        from kvplug.management import pin_keys

        _, pins = self._manage_state()
        for rank, w in enumerate(self.workers):
            if pins[rank] and w.storage is not None:
                pin_keys(w.storage, sorted(pins[rank], key=repr), pin=False)
                pins[rank].clear()

    # -- I8 -------------------------------------------------------------------------------------
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
        cleared, _ = self._manage_state()
        for k in keys:
            cleared[rank].pop(k, None)
        if getattr(self, "_storing", None) is not None:
            self._storing.update(keys)

    def check_served(self, rank: int, key: Any) -> None:
        """A tier answered ``key``: a violation when a clear removed it and nothing stored it
        again since."""
        cleared, _ = self._manage_state()
        if key in cleared[rank]:
            self.violation = self.violation or Violation(
                "I8", f"rank {rank}: a chunk cleared from every tier was served: {key}")
            raise self.violation
