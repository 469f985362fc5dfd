"""The one seam between kvplug and concurrency: executors, events, conditions, tickers and the clock.

Every thread, pool, event, condition wait and clock reading on the paths that move KV comes from
a :class:`Runtime`: the connector's (the save thread, the background-load pool, the
StorageManager's readers and each tier's call pool and encoder) and every backend's (a backend
gets it as ``TierContext.runtime``: the posix writers, start-up scan and reaper, the value
tiers' writers, fsspec's pool, ``TierWatch``). Production uses :data:`THREADS` (real threads,
``time.monotonic`` and ``time.time``); the deterministic simulation (``kvplug.connector.sim``)
passes its own, which queues every submitted task and runs it when the seed's schedule says so,
on one thread, and keeps its own clocks, so one seed is one exact interleaving.

A runtime's objects behave like their ``threading`` / ``concurrent.futures`` counterparts:
``executor(...).submit`` returns a :class:`concurrent.futures.Future` (``result(timeout)`` may
raise :class:`concurrent.futures.TimeoutError`), ``event()`` has ``set``/``is_set``/``wait``,
``condition(lock)`` has ``wait(timeout)``/``wait_for(predicate, timeout)``/``notify_all`` and
releases ``lock`` while it waits; ``wait_first(futures, timeout)`` as
``concurrent.futures.wait(..., FIRST_COMPLETED)``, ``wait_all`` as ``concurrent.futures.wait``.

A task must not wait for a lock its submitter may hold while it waits for the task: under the
simulation a wait runs queued tasks on the waiting thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import Any


class DaemonExecutor(Executor):
    """``workers`` daemon threads, started on demand, that run submitted calls in order.

    For a backend's service threads (a reaper, writers, a start-up scan) that must never keep
    the interpreter from exiting when a file system or a server hangs (``ThreadPoolExecutor``'s
    threads are joined at exit)."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = max(1, workers), name
        self._queue: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"cannot schedule new futures after shutdown ({self._name})")
            self._queue.put((fut, lambda: fn(*args, **kwargs)))
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._workers:
                t = threading.Thread(target=self._run, daemon=True,
                                     name=f"{self._name}-{len(self._threads)}"[:40])
                self._threads.append(t)
                t.start()
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - delivered through the future
                    fut.set_exception(exc)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False,
                 timeout: float | None = None) -> None:
        """Stop the threads after what is queued (``cancel_futures``: cancel it instead);
        ``wait``: join them (up to ``timeout`` seconds each: a hung call is left behind)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                t.join(timeout)


class Ticker:
    """Calls ``fn`` on one daemon thread every ``interval_s`` seconds, or at once after
    :meth:`wake`; :meth:`close` stops it (``fn`` never raises into the thread: a caller's
    exception is its own to log)."""

    def __init__(self, fn: Callable[[], None], interval_s: float, name: str) -> None:
        self._fn, self._interval = fn, interval_s
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self, timeout: float | None = None) -> None:
        """Stop; wait up to ``timeout`` for a call in progress (none from ``fn`` itself)."""
        self._closed = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._closed:
                return
            self._fn()


class Runtime:
    """Real threads and the real clock (the default everywhere)."""

    #: Lookups arrive over IPC from the scheduler's process (the worker runs a LookupService
    #: thread); a simulation calls the worker's lookup directly instead.
    remote_lookups = True

    def executor(self, workers: int, name: str, daemon: bool = False) -> Executor:
        """A pool of ``workers`` threads named ``name`` (``shutdown`` as ThreadPoolExecutor);
        ``daemon``: threads that never hold up the interpreter's exit (:class:`DaemonExecutor`)."""
        if daemon:
            return DaemonExecutor(workers, name)
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name[:32])

    def ticker(self, fn: Callable[[], None], interval_s: float, name: str) -> Any:
        """A :class:`Ticker`: ``fn`` every ``interval_s`` seconds and after each ``wake()``."""
        return Ticker(fn, interval_s, name)

    def event(self) -> Any:
        return threading.Event()

    def condition(self, lock: Any = None) -> Any:
        return threading.Condition(lock)

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        """The wall clock (seconds since the epoch): for stamps other processes compare, such
        as a file's mtime in an LRU shared through a directory."""
        return time.time()

    def wait_first(self, futures: Collection[Future], timeout: float) -> None:
        """Return once any of ``futures`` is done, or after ``timeout`` seconds."""
        wait(futures, timeout, return_when=FIRST_COMPLETED)

    def start_threads(self, pool: Executor, workers: int, timeout: float = 1.0) -> None:
        """Start ``workers`` threads of ``pool`` (an idle executor of this runtime) now: a pool
        starts its threads on demand, so its first calls would wait for them (an engine's first
        store, its first load). Each thread waits at a barrier until all exist; a pool that
        cannot run them all within ``timeout`` (busy) is left as it is."""
        gate = threading.Barrier(workers + 1)
        for _ in range(workers):
            pool.submit(_arrive, gate, timeout)
        try:
            gate.wait(timeout)
        except threading.BrokenBarrierError:
            pass

    def wait_all(self, futures: Collection[Future], timeout: float | None) -> bool:
        """Wait until every one of ``futures`` is done (up to ``timeout`` seconds); True if so."""
        return not wait(futures, timeout).not_done


def _arrive(gate: threading.Barrier, timeout: float) -> None:
    try:
        gate.wait(timeout)
    except threading.BrokenBarrierError:
        pass


#: The runtime every kvplug object uses unless given another.
THREADS = Runtime()
