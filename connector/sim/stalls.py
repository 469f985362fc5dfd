"""Invariant **I10**, the engine step never waits on a tier: a part of :class:`.world.World`
with its own state.

Everything the simulation calls on the workers during a step (``handle_preemptions``, ``bind``,
``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``,
``get_finished`` and the ``take_*`` calls, or the connector's methods that route to them) runs as
vLLM's engine thread (:meth:`.runtime.SimRuntime.engine_thread`); the lookups (the scheduler
side, the lookup services) and the tasks the runtime runs on their own threads do not. Then:

* the simulated time the engine thread waits inside kvplug in one step (every clock jump while
  it runs: a tier call that timed out, a condition that timed out) stays within the workers'
  ``in_step_load_deadline_s`` (one deadline for all of a step's in-step reads);
* every read it makes of a tier that may block (``get``, ``batched_get``, ``get_layers``,
  ``contains``, and ``batched_get_nowait``, which never waits but reads all the same; directly,
  or a pool task it waits for through ``Future.result``) is of a local medium (posix), for keys
  a lookup of its rank pinned on that very tier: never a remote tier, never a tier the lookup
  did not find the key in (a fall-through), never a key no lookup pinned (an unpinned tail). L1
  never blocks: reading it is free.

Other calls the engine thread makes on such tiers (a synchronous save's queued put, an unpin)
are counted, not checked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from .engine import Violation

#: the hooks that read a tier (what an in-step load may only ask of the tier its lookup pinned)
READS = frozenset({"get", "batched_get", "batched_get_nowait", "get_layers", "contains"})
#: the deadline when the workers' config does not say (``in_step_load_deadline_s``'s default)
DEADLINE_S = 0.5


class StallCheck:
    """I10 (see the module docstring) over one world's workers and runtime."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.runtime = world.runtime
        self.runtime.on_engine_call = self._pool_call
        self._pools: dict[int, tuple[int, str]] = {}  # id(a tier's pool) -> (rank, tier)
        self.hook = ""  # the worker hook running (for the message)
        self.max_waited = 0.0  # the longest wait of a step so far (seconds)
        self.counts: Counter[str] = Counter()

    def watch(self, rank: int, storage: Any) -> None:
        """Watch rank ``rank``'s tiers: their pools (calls the engine waits for) and, through a
        wrapper on each, the calls made on the caller's thread."""
        for t in storage._tiers:
            if t.pool is not None:
                self._pools[id(t.pool)] = (rank, t.name)
            storage.add_wrapper(_caller_thread_calls(self, rank, t.name), tiers=[t.name])

    # -- what the engine thread calls -------------------------------------------------------------
    def _pool_call(self, fut: Any) -> None:
        """The engine thread waits for ``fut``: a tier call if it is a tier's pool task."""
        where = self._pools.get(id(fut.pool))
        if where is None:
            return
        fn, _, kwargs = fut.call
        hook = getattr(fn, "name", "") or getattr(fn, "__name__", "?")
        self.called(*where, hook, _keys(kwargs), late=fut.pool.gated)

    def on_caller_thread(self, rank: int, tier: str, hook: str, keys: Sequence[Any]) -> None:
        """A hook of ``tier`` ran on the calling thread (a tier called directly, or a pool task
        the engine thread waits for, already seen by :meth:`_pool_call`)."""
        if not self.runtime.engine:
            return
        running = self.runtime.running
        if running is not None and id(running.pool) in self._pools:
            return  # a pool task the engine waits for: seen when it waited
        self.called(rank, tier, hook, keys)

    def called(self, rank: int, tier: str, hook: str, keys: Sequence[Any],
               late: bool = False) -> None:
        """The engine thread called ``hook`` of rank ``rank``'s ``tier`` for ``keys``."""
        w = self.world.workers[rank]
        st = w.storage
        if st is None or st.never_blocks(tier):
            return
        self.counts[f"engine-thread calls of a tier that may block ({hook})"] += 1
        if hook not in READS:
            return
        if not st.local_medium(tier):
            raise self._violation(f"rank {rank}'s engine thread called {hook} of tier {tier!r} "
                                  f"(not a local medium) in {self.hook}"
                                  + (", and waited out its timeout" if late else ""))
        pinned = {(k, t) for keys_, tiers in list(w._pins.values())
                  for k, t in zip(keys_, tiers, strict=False)}
        stray = [k for k in keys if (k, tier) not in pinned]
        if stray:
            where = sorted({t for k, t in pinned if k in set(stray)})
            raise self._violation(
                f"rank {rank}'s engine thread called {hook} of tier {tier!r} in {self.hook} for "
                f"{len(stray)} key(s) no lookup of this rank pinned there ("
                + (f"pinned on {where}" if where else "not pinned anywhere") + ")")

    def _violation(self, what: str) -> Violation:
        v = Violation("I10", what)
        self.world.keep(v)  # raised inside kvplug, which may swallow it: the world raises it
        return v  # after the event

    # -- per step ---------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.runtime.engine_waits = []

    def end_step(self, step: int) -> None:
        """Each worker's engine thread waited inside kvplug within the deadline this step (the
        ranks wait side by side, each in its own process)."""
        for rank, w in enumerate(self.world.workers):
            waits = [(s, on) for who, s, on in self.runtime.engine_waits if who == rank]
            waited = sum(s for s, _ in waits)
            self.max_waited = max(self.max_waited, waited)
            deadline = getattr(w.cfg, "in_step_load_deadline_s", DEADLINE_S)
            if waited > deadline + 1e-9:
                on = Counter(on for _, on in waits)
                raise self._violation(
                    f"rank {rank}'s engine thread waited {waited:.2f} s (simulated) inside "
                    f"kvplug in step {step}, past the {deadline} s deadline: "
                    + ", ".join(f"{n} x {what}" for what, n in sorted(on.items())))


def _keys(kwargs: dict[str, Any]) -> list[Any]:
    if "keys" in kwargs:
        return list(kwargs["keys"] or ())
    return [kwargs["key"]] if "key" in kwargs else []


def _caller_thread_calls(check: StallCheck, rank: int, tier: str) -> Any:
    """A wrapper on one tier: its reads, for :meth:`StallCheck.on_caller_thread`."""
    from kvplug.hookspecs import hookimpl

    class _Reads:
        @hookimpl(wrapper=True)
        def get(self, key: Any) -> Any:
            check.on_caller_thread(rank, tier, "get", [key])
            return (yield)

        @hookimpl(wrapper=True)
        def batched_get(self, keys: Any) -> Any:
            check.on_caller_thread(rank, tier, "batched_get", list(keys))
            return (yield)

        @hookimpl(wrapper=True)
        def batched_get_nowait(self, keys: Any) -> Any:
            check.on_caller_thread(rank, tier, "batched_get_nowait", list(keys))
            return (yield)

        @hookimpl(wrapper=True)
        def get_layers(self, key: Any, first_layer: int, num_layers: int) -> Any:
            check.on_caller_thread(rank, tier, "get_layers", [key])
            return (yield)

        @hookimpl(wrapper=True)
        def contains(self, keys: Any, pin: bool) -> Any:
            check.on_caller_thread(rank, tier, "contains", list(keys))
            return (yield)

    return _Reads()
