"""The one seam between kvplug and concurrency: executors, events, conditions and the clock.

Every thread pool, event, condition wait and clock reading on the paths that move KV (the save
thread, the background-load pool, the StorageManager's readers and each tier's call pool) comes
from a :class:`Runtime`. Production uses :data:`THREADS` (real threads, ``time.monotonic``); the
deterministic simulation (``tests/sim``) passes its own, which queues every submitted task and
runs it when the seed's schedule says so, on one thread, so one seed is one exact interleaving.

A runtime's objects behave like their ``threading`` / ``concurrent.futures`` counterparts:
``executor(...).submit`` returns a :class:`concurrent.futures.Future` (``result(timeout)`` may
raise :class:`concurrent.futures.TimeoutError`), ``event()`` has ``set``/``is_set``/``wait``,
``condition(lock)`` has ``wait(timeout)``/``notify_all`` and releases ``lock`` while it waits;
``wait_first(futures, timeout)`` as ``concurrent.futures.wait(..., FIRST_COMPLETED)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import Any


class Runtime:
    """Real threads and the real clock (the default everywhere)."""

    #: Lookups arrive over IPC from the scheduler's process (the worker runs a LookupService
    #: thread); a simulation calls the worker's lookup directly instead.
    remote_lookups = True

    def executor(self, workers: int, name: str) -> Executor:
        """A pool of ``workers`` threads named ``name`` (``shutdown`` as ThreadPoolExecutor)."""
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name[:32])

    def event(self) -> Any:
        return threading.Event()

    def condition(self, lock: Any) -> Any:
        return threading.Condition(lock)

    def monotonic(self) -> float:
        return time.monotonic()

    def wait_first(self, futures: Collection[Future], timeout: float) -> None:
        """Return once any of ``futures`` is done, or after ``timeout`` seconds."""
        wait(futures, timeout, return_when=FIRST_COMPLETED)


#: The runtime every kvplug object uses unless given another.
THREADS = Runtime()
