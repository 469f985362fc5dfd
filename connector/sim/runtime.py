"""The simulation's :class:`kvplug.runtime.Runtime`: every task kvplug submits is queued, and runs
only when the simulation says so, whole, on the simulation's one thread.

So one seed is one exact interleaving: the schedule picks which queued task runs next (``step``),
and every place kvplug would block decides from the simulation's state, never from a clock:

* ``Future.result(timeout)`` on a task not run yet: the task runs right there, unless its pool is
  *gated* (a tier that blocks on demand), then the wait times out (the clock jumps by
  ``timeout``) and the task stays queued — its late result arrives when the gate opens;
* ``Condition.wait(timeout)`` (a lookup waiting for a save's put): releases the lock, runs the
  save tasks if ``settle`` is on, else times out;
* ``Event.wait()``: runs queued tasks until the event is set (a task never waits mid-way here);
* ``Condition.wait_for(predicate, timeout)`` (a backend's flush, the posix writer waiting for its
  reaper): runs runnable tasks in queue order until the predicate holds, else times out;
* a ticker (``TierWatch``) is a task queued on ``wake()``;
* a task submitted from a thread the simulation does not own (fsspec's event loop) runs there at
  once: such work is outside the simulation's control;
* the clocks are the simulation's: ``monotonic`` moves only when a wait times out, ``time`` (the
  wall clock of posix's mtime stamps) one millisecond per reading besides.

A *late* call: a gated pool's task that times out may be marked as started (``late``), so the
caller cannot cancel it (``Future.cancel`` fails, as for a call a real thread is running) and its
result arrives when the gate opens, long after its caller gave up (``Tier._late`` cleans up).

Whose time: while the simulation runs vLLM's engine thread (:meth:`SimRuntime.engine_thread`,
around each worker hook), every jump of the clock counts as the engine's wait
(``engine_waited``), and every task it waits on through ``Future.result`` (or ``wait_all``)
runs as the engine thread too: a tier call made there is in ``engine_calls`` (timed out or
not). A task a wait runs because it happens to be runnable (``Event.wait``, ``Condition.wait``
and ``wait_for``, the schedule's own steps) runs as its own thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvplug.runtime import Runtime

#: the simulated wall clock's origin (ms since the epoch, September 2020): before any real
#: file's mtime, so one the simulation did not stamp is the newest, whatever the real time
WALL_EPOCH_MS = 1_600_000_000_000


class SimFuture(Future):
    """A Future whose blocking ``result`` asks the simulation instead of waiting."""

    def __init__(self, runtime: SimRuntime, pool: SimExecutor, fn: Callable[[], Any],
                 call: tuple[Any, tuple, dict] = (None, (), {})) -> None:
        super().__init__()
        self.runtime, self.pool, self.fn = runtime, pool, fn
        self.call = call  # what was submitted: (function, args, keyword arguments)
        self.started = False  # marked running at a timeout (a late call): cannot be cancelled

    def run(self) -> None:
        if not self.started and not self.set_running_or_notify_cancel():
            return
        try:
            value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            self.set_exception(exc)
        else:
            self.set_result(value)

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            if self.runtime.engine and self.runtime.on_engine_call is not None:
                self.runtime.on_engine_call(self)  # a call the engine thread waits for
            if timeout is not None and self.pool.gated:
                fn = self.call[0]
                self.runtime.waited(timeout, f"{getattr(fn, 'name', '') or getattr(fn, '__name__', '?')}"
                                    f" on {self.pool.name}")
                if self.runtime.late and not self.started:  # a real thread had begun it
                    self.started = self.set_running_or_notify_cancel()
                    self.runtime.late_calls += self.started
                raise FutureTimeout()
            self.runtime.run_task(self, waited_on=True)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self.runtime.run_task(self, waited_on=True)
        return super().exception(0)


class SimExecutor:
    """A pool whose tasks wait in the simulation's queue."""

    def __init__(self, runtime: SimRuntime, workers: int, name: str) -> None:
        self.runtime, self.workers, self.name = runtime, workers, name
        self.gated = False  # a tier that blocks: its calls time out and wait for the gate
        self.closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> SimFuture:
        if self.closed:
            raise RuntimeError(f"cannot schedule new futures after shutdown ({self.name})")
        fut = SimFuture(self.runtime, self, lambda: fn(*args, **kw), (fn, args, kw))
        if threading.get_ident() != self.runtime.owner:  # a foreign thread (fsspec's loop): at once
            self.runtime.foreign += 1
            fut.run()
            return fut
        self.runtime.queue.append(fut)
        return fut

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        futs = [self.submit(fn, x) for x in items]
        return iter([f.result() for f in futs])

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False,
                 timeout: float | None = None) -> None:
        self.closed = True
        mine = [f for f in self.runtime.queue if f.pool is self]
        for f in mine:
            if cancel_futures and not f.started:
                self.runtime.queue.remove(f)
                f.cancel()
            elif wait:
                self.runtime.run_task(f, waited_on=True)


class SimEvent:
    def __init__(self, runtime: SimRuntime) -> None:
        self.runtime, self.flag = runtime, False

    def set(self) -> None:
        self.flag = True

    def is_set(self) -> bool:
        return self.flag

    def clear(self) -> None:
        self.flag = False

    def wait(self, timeout: float | None = None) -> bool:
        while not self.flag and self.runtime.runnable():
            self.runtime.run_task(self.runtime.runnable()[0])
        return self.flag


class SimCondition:
    def __init__(self, runtime: SimRuntime, lock: Any) -> None:
        self.runtime, self.lock = runtime, lock

    def __enter__(self) -> SimCondition:
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        self.lock.release()
        try:
            ran = False
            if self.runtime.settle:
                for f in [f for f in self.runtime.runnable() if f.pool.name == "kvplug-save"]:
                    self.runtime.run_task(f)
                    ran = True
            if not ran:
                self.runtime.waited(timeout or 0.0)
        finally:
            self.lock.acquire()
        return ran

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run runnable tasks (queue order, the lock released) until ``predicate`` holds; if
        none may run, the wait times out (the clock jumps by ``timeout``)."""
        result = predicate()
        while not result:
            ready = self.runtime.runnable()
            if not ready:
                self.runtime.waited(timeout or 0.0)
                return predicate()
            self.lock.release()
            try:
                self.runtime.run_task(ready[0])
            finally:
                self.lock.acquire()
            result = predicate()
        return result

    def notify_all(self) -> None:
        pass

    notify = notify_all


class SimTicker:
    """A :class:`kvplug.runtime.Ticker`: ``wake()`` queues one call of ``fn`` (none while one
    is queued); the interval never fires by itself (no clock runs between events)."""

    def __init__(self, runtime: SimRuntime, fn: Callable[[], None], name: str) -> None:
        self.pool = runtime.executor(1, name)
        self.fn = fn
        self.queued: SimFuture | None = None
        self.closed = False

    def wake(self) -> None:
        if not self.closed and (self.queued is None or self.queued.done()):
            self.queued = self.pool.submit(self.fn)

    def close(self, timeout: float | None = None) -> None:
        self.closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)


class SimRuntime(Runtime):
    """Queued tasks, run one at a time when the schedule (or a blocking wait) says so."""

    remote_lookups = False

    def __init__(self) -> None:
        self.queue: list[SimFuture] = []
        self.pools: list[SimExecutor] = []
        self.clock = 1000.0
        self.settle = True  # a lookup waiting for a save's put lets it run
        self.late = False  # a gated call that times out has begun: its result comes late
        self.late_calls = 0
        self.foreign = 0  # tasks submitted from threads the simulation does not own
        self.ran = 0
        self.wall_reads = 0  # readings of the wall clock (time)
        self.owner = threading.get_ident()
        self.on_task: Callable[[SimFuture], None] | None = None  # after every task (invariants)
        #: the code running is vLLM's engine thread (see the module docstring)
        self.engine = False
        self.engine_waited = 0.0  # simulated seconds the engine thread waited (clock jumps)
        #: each of them: (whose engine thread: a worker's rank, seconds, on what)
        self.engine_waits: list[tuple[Any, float, str]] = []
        self.engine_who: Any = None  # whose engine thread runs (each worker has its own)
        self.engine_doing = ""  # what it runs (for the record of its waits)
        self.running: SimFuture | None = None  # the task running now (None: no task)
        #: told of every task the engine thread waits for (a tier call: which tier, what keys)
        self.on_engine_call: Callable[[SimFuture], None] | None = None

    def executor(self, workers: int, name: str, daemon: bool = False) -> SimExecutor:
        pool = SimExecutor(self, workers, name)
        self.pools.append(pool)
        return pool

    def ticker(self, fn: Callable[[], None], interval_s: float, name: str) -> SimTicker:
        return SimTicker(self, fn, name)

    def event(self) -> SimEvent:
        return SimEvent(self)

    def condition(self, lock: Any = None) -> SimCondition:
        return SimCondition(self, lock if lock is not None else threading.RLock())

    def monotonic(self) -> float:
        return self.clock

    def waited(self, seconds: float, on: str = "a condition") -> None:
        """The running thread waited ``seconds`` (a timeout) ``on`` something: the clock jumps."""
        self.clock += seconds
        if self.engine:
            self.engine_waited += seconds
            self.engine_waits.append((self.engine_who, seconds, f"{on} in {self.engine_doing}"))

    @contextlib.contextmanager
    def engine_thread(self, who: Any = None, doing: str = "") -> Iterator[None]:
        """Run the block as ``who``'s engine thread (vLLM's thread in a worker process: its
        waits are the engine's), ``doing`` something (named in the record of its waits)."""
        prev, self.engine = self.engine, True
        self.engine_who, self.engine_doing = who, doing
        try:
            yield
        finally:
            self.engine = prev

    def time(self) -> float:
        """A wall clock that replays: the simulated clock after :data:`WALL_EPOCH_MS`, plus a
        millisecond per reading, so no two stamps tie (posix orders its files by mtime, in ms:
        a tie would fall to the order a directory lists them in)."""
        self.wall_reads += 1
        return (WALL_EPOCH_MS + round(self.clock * 1000) + self.wall_reads) / 1000

    def wait_first(self, futures: Any, timeout: float) -> None:
        """Never waits: the schedule decides when a queued task runs."""

    def start_threads(self, pool: Any, workers: int, timeout: float = 1.0) -> None:
        """Nothing to start: a pool's tasks run when the schedule says."""

    def wait_all(self, futures: Any, timeout: float | None) -> bool:
        """Run each future's task in the order given (a gated one: the wait times out). A set
        is refused: its order follows memory addresses, and the run would differ from process to
        process (seeds that replay differently)."""
        if isinstance(futures, (set, frozenset)):
            raise TypeError("wait_all needs futures in a deterministic order (a list), not a set")
        for f in list(futures):
            if not f.done() and isinstance(f, SimFuture):
                if self.engine and self.on_engine_call is not None:
                    self.on_engine_call(f)
                if f.pool.gated:
                    self.waited(timeout or 0.0, f"a task of {f.pool.name}")
                    return False
                self.run_task(f, waited_on=True)
        return all(f.done() for f in futures)

    def runnable(self) -> list[SimFuture]:
        """Queued tasks that may run now: not gated; a one-thread pool runs in order."""
        out, single = [], set()
        for f in self.queue:
            if f.pool.gated:
                continue
            if f.pool.workers == 1:
                if id(f.pool) in single:
                    continue
                single.add(id(f.pool))
            out.append(f)
        return out

    def run_task(self, fut: SimFuture, waited_on: bool = False) -> None:
        """Run ``fut``'s task now: as the thread that waits for it (``waited_on``: its
        ``result``), else as a thread of its own."""
        if fut in self.queue:
            self.queue.remove(fut)
        if fut.done():
            return
        self.ran += 1
        prev, self.engine = self.engine, self.engine and waited_on
        outer, self.running = self.running, fut
        try:
            fut.run()
        finally:
            self.engine, self.running = prev, outer
        if self.on_task is not None:
            self.on_task(fut)

    def step(self, pick: int) -> bool:
        """Run the ``pick``-th runnable task (modulo); False if none may run."""
        ready = self.runnable()
        if not ready:
            return False
        self.run_task(ready[pick % len(ready)])
        return True

    def drain(self, limit: int = 10_000) -> None:
        """Run every runnable task (gates stay as they are)."""
        for _ in range(limit):
            if not self.step(0):
                return
        raise AssertionError(f"tasks never drained: {len(self.queue)} queued")


__all__ = ["SimRuntime", "SimExecutor", "SimFuture", "CancelledError", "FutureTimeout"]
