"""One configured tier and its bounded calls (used by :class:`kvplug.storage_manager.StorageManager`).

A tier that may block (every tier whose class does not set ``never_blocks = True``) gets its own
small thread pool, so a stalled tier holds at most :data:`TIER_THREADS` threads and never delays
another tier's calls. A tier whose every call is bounded by its own client (``call_bound_s``: the
longest one call can wait, no longer than the tier's ``timeout_s``) is called from the caller's
thread instead (:attr:`Tier.on_caller_thread`): the hand-off to a pool thread and back costs 0.1–0.3 ms a
call, as much as reading a 256 KiB value, and buys no bound that the tier does not keep already.
A call that outlives its timeout is cancelled if it has not started; if it
has, its late result is cleaned up when it arrives: a late ``get`` drops its object (a late
``batched_get`` each of its objects), a late ``contains(pin=True)`` releases the pins it took
(nobody will ever unpin them otherwise).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from .config import TierConfig
from .memory import MemoryObj
from .metrics import TierMetrics
from .runtime import THREADS, Runtime

logger = logging.getLogger("kvplug.storage")

#: Threads per tier that may block: the most calls of one tier in flight at once.
TIER_THREADS = 8
#: Keys per ``batched_get`` call: a request's hit of hundreds of chunks is read in calls of this
#: many (run concurrently, but see :data:`SEQUENTIAL_READ_BYTES`), each bounded by the tier's
#: ``timeout_s``.
BATCH_GET_KEYS = 16
#: A local medium's values below this size are read one call after another on the caller's
#: thread, not spread over the readers: a read from the page cache is mostly Python under the
#: GIL, so reader threads queue on it (96 values into L1's pool, 2 cores, ``kvplug bench``'s
#: shapes: in sequence 1.8-1.9x the spread at 256 KiB, 1.2-1.4x at 1 MiB, 0.75x at 4 MiB, where
#: the copies themselves run in parallel). A remote tier is always spread (its calls wait on
#: the network).
SEQUENTIAL_READ_BYTES = 2 << 20
#: Puts queued for a tier's encoder beyond this are dropped (counted as codec_dropped_puts).
MAX_ENCODER_QUEUE = 64


class WaitBudget:
    """One allowance of waiting on tiers, shared by every call of a batch (an engine step's
    in-step reads): each call waits at most what is left, and what it waited is taken off, so a
    hung medium costs the batch the allowance once, not a timeout per call or group of keys.
    ``clock`` is the runtime's (:meth:`kvplug.runtime.Runtime.monotonic`)."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.seconds = seconds
        self.clock = clock
        self.left = seconds

    def remaining(self) -> float:
        return max(0.0, self.left)

    def spent(self) -> bool:
        return self.left <= 0.0

    def charge(self, since: float) -> None:
        """Take off the time waited since ``since`` (a reading of ``clock``)."""
        self.left -= max(0.0, self.clock() - since)


def release(objs: list) -> None:
    """Drop the reference of every memory object in ``objs`` (a batch nobody will use)."""
    for obj in objs:
        if isinstance(obj, MemoryObj):
            obj.ref_down()


def _bounded_within(backend: object, timeout_s: float) -> bool:
    """Whether ``backend`` declares every call bounded (``call_bound_s``) within ``timeout_s``."""
    bound = getattr(backend, "call_bound_s", None)
    return isinstance(bound, (int, float)) and not isinstance(bound, bool) and 0 < bound <= timeout_s


class Tier:
    """One configured tier: its backend instance, metrics wrapper, hook callers and thread pool."""

    def __init__(self, index: int, config: TierConfig, backend: object, package: str,
                 runtime: Runtime = THREADS) -> None:
        self.index = index
        self.runtime = runtime
        self.name = config.tier_name
        self.config = config
        self.backend = backend
        self.package = package
        self.metrics = TierMetrics(self.name)
        self.hooks: dict[str, Any] = {}
        self.faults = 0
        self.timeouts = 0
        #: reads a batch's wait allowance did not cover (:class:`WaitBudget`): misses
        self.deadline_misses = 0
        #: Whether the tier never waits on I/O (its class sets ``never_blocks = True``: pure
        #: in-memory tiers): called on the caller's thread without a bound, read inside the
        #: engine step. Every other tier's get/contains runs on the tier's own pool, bounded by
        #: its ``timeout_s``.
        self.never_blocks = bool(getattr(backend, "never_blocks", False))
        #: A tier that may block but reads a medium on this machine (``local_medium``): a small
        #: hit of it may load inside the engine step (the connector's ``in_step_load_bytes``).
        self.local = bool(getattr(backend, "local_medium", False))
        #: Bytes of the last value read from the tier (0: none yet; :meth:`reads_in_sequence`).
        self.value_bytes = 0
        #: Whether bounded calls run on the caller's thread: a tier that never blocks, or one
        #: whose own client bounds every call within ``timeout_s`` (``call_bound_s``, an instance
        #: attribute: e.g. its socket timeout times the failures that open its breaker). Such a
        #: tier still may block (``never_blocks`` stays False: its loads run off the engine step).
        self.on_caller_thread = self.never_blocks or _bounded_within(backend, config.timeout_s)
        self.pool = None if self.never_blocks else runtime.executor(TIER_THREADS, f"kvplug-{self.name}")
        #: The tier's :class:`~kvplug.codecs.CodecWrapper` (set by the StorageManager); a tier
        #: that encodes gets one thread that runs its puts (encoding) off the caller's thread.
        self.codec: Any = None
        #: The tier's view of the deployment keyring (``auth_key_env``), or ``None``.
        self.auth: Any = None
        self.encoder: Executor | None = None
        #: The tier's :class:`~kvplug.policies.gate.AdmissionGate`, or ``None``: every chunk is
        #: admitted (no ``admission`` setting).
        self.admission: Any = None
        #: queued encoding puts in submission order (a dict: waited for in the order the one
        #: encoder thread runs them, never in an order memory addresses give a set)
        self._pending: dict[Future, None] = {}
        self._pending_lock = threading.Lock()
        self._nowait: bool | None = None  # learned on first use (the hooks are wired then)
        self._implements: dict[str, bool] = {}

    def start_encoder(self) -> None:
        self.encoder = self.runtime.executor(1, f"kvplug-enc-{self.name}")

    def put_later(self, fn: Any, *args: Any) -> Future:
        """Run ``fn(*args)`` (an encoding put) on the tier's encoder thread; tracked for flush."""
        assert self.encoder is not None
        fut = self.encoder.submit(fn, *args)
        with self._pending_lock:
            self._pending[fut] = None
        fut.add_done_callback(self._done)
        return fut

    def pending_puts(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def _done(self, fut: Future) -> None:
        with self._pending_lock:
            self._pending.pop(fut, None)

    def wait_puts(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for queued encoding puts; True if none is left."""
        with self._pending_lock:
            pending = list(self._pending)
        return not pending or self.runtime.wait_all(pending, timeout)

    def implements(self, hook: str) -> bool:
        """Whether the tier's backend implements ``hook`` (its hook implementations are fixed
        when it is registered, so the answer is kept)."""
        known = self._implements.get(hook)
        if known is None:
            known = any(impl.plugin is self.backend for impl in self.hooks[hook].get_hookimpls())
            self._implements[hook] = known
        return known

    def reads_nowait(self) -> bool:
        """Whether the tier reads what it can without waiting, on the caller's thread, before
        any bounded call (``batched_get_nowait``; a tier that never blocks is called on the
        caller's thread anyway, and a tier with a codec decodes on its bounded calls, off the caller's
        thread)."""
        if self._nowait is None:
            codec = self.codec is not None and self.codec.codec is not None
            self._nowait = not (self.never_blocks or codec) and self.implements("batched_get_nowait")
        return self._nowait

    def saw_reads(self, objs: list) -> None:
        """Note the size of the last value of a batch this tier answered."""
        for obj in reversed(objs):
            if isinstance(obj, MemoryObj):
                self.value_bytes = obj.nbytes
                return

    def reads_in_sequence(self) -> bool:
        """Whether a batch of this tier's reads runs one call after another (a local medium's
        small values, :data:`SEQUENTIAL_READ_BYTES`) rather than spread over threads."""
        return self.local and self.value_bytes < SEQUENTIAL_READ_BYTES

    def call_async(self, hook: str, kwargs: dict[str, Any]) -> Future:
        """Run the backend's ``hook`` with ``kwargs`` on this tier's pool: its future."""
        assert self.pool is not None
        return self.pool.submit(self.hooks[hook], **kwargs)

    def abandon(self, hook: str, fut: Future, kwargs: dict[str, Any]) -> None:
        """The caller stopped waiting for ``fut``: cancel it, or clean up when it finishes."""
        if not fut.cancel():
            fut.add_done_callback(lambda f: self._late(hook, f, kwargs))

    def _late(self, hook: str, fut: Future, kwargs: dict[str, Any]) -> None:
        try:
            res = fut.result()
        except Exception:  # noqa: BLE001 - a late failure holds nothing
            return
        if isinstance(res, MemoryObj):  # a late get / get_layers
            res.ref_down()
        elif hook == "batched_get" and isinstance(res, list):
            release(res)
        elif hook == "contains" and kwargs.get("pin") and isinstance(res, list):
            found = [k for k, hit in zip(kwargs["keys"], res, strict=False) if hit]
            if found and self.implements("unpin"):
                try:
                    self.hooks["unpin"](keys=found)
                except Exception:  # noqa: BLE001
                    logger.exception("tier %r: releasing the pins of a late lookup failed",
                                     self.name)

    def shutdown(self) -> None:
        if self.encoder is not None:
            self.encoder.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
