"""The calls a remote tier makes to its store, behind the tier's circuit breaker.

:class:`GuardedCalls` is what every remote tier shares (resp, mooncake and fsspec): counting,
credential scrubbing, the breaker, batched stores. :class:`ValueIO` adds a key-value store's
calls; its docstring is the whole contract for anyone writing one (``kvplug new-backend NAME
--key-value`` generates a subclass to fill in).
"""

from __future__ import annotations

import threading
from abc import ABC, ABCMeta, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from kvplug.redact import Redactor

from .breaker import CircuitBreaker


class StoreRefused(Exception):
    """The store answered but refused one value (full, too large): not an outage."""


class Unanswered(Exception):
    """The part of the store that holds this value did not answer (a cluster's master down)
    while the rest did: a failed store of this value, not a full store."""


F = TypeVar("F", bound=Callable[..., Any])

#: The attribute a primitive's flag (:func:`needed_when`) is recorded under.
NEEDED_WHEN = "needed_when"


def needed_when(flag: str) -> Callable[[F], F]:
    """Declares a primitive that a subclass must implement when it sets ``flag`` (the body
    declared here is never run: construction refuses such a subclass, :class:`_NeedsPrimitives`)."""
    def mark(fn: F) -> F:
        setattr(fn, NEEDED_WHEN, flag)
        return fn
    return mark


class _NeedsPrimitives(ABCMeta):
    """ABC's check, plus one after ``__init__`` (a flag may be set there): every primitive
    :func:`needed_when` a flag the instance sets is implemented, else a ``TypeError`` naming it."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        io = super().__call__(*args, **kwargs)
        missing = io.missing_primitives()
        if missing:
            raise TypeError(f"{cls.__name__} does not implement {', '.join(missing)}")
        return io


class GuardedCalls(ABC):
    """Counted calls to one remote store behind the tier's circuit breaker (what every remote
    tier shares: resp, mooncake, fsspec). A failed or timed-out call is counted, its message
    scrubbed of credentials and fed to the breaker; a call the breaker refuses is not made."""

    #: Exception types (besides ``TimeoutError``) counted as timeouts.
    timeout_types: tuple[type[BaseException], ...] = ()
    #: The stats name of timed-out calls.
    timeout_stat = "socket_timeouts"
    #: Whether the store keeps the buffer a value is sent from (fsspec's uploads): the writer then
    #: encodes each value into fresh bytes instead of its reused scratch buffer.
    keeps_values = False

    def __init__(self, name: str, breaker: CircuitBreaker, redact: Redactor) -> None:
        self.name = name
        self.breaker = breaker
        self.redact = redact
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("remote_errors", self.timeout_stat, "store_errors",
                                      "remote_lookups", "evicted"), 0)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def failed(self, exc: BaseException, breaker: CircuitBreaker | None = None) -> None:
        """Record a failed call (unreachable, reset, timed out) and feed it to the breaker (the
        tier's, or ``breaker``: one part of the store's, e.g. a cluster master's)."""
        timeout = isinstance(exc, (TimeoutError, *self.timeout_types))
        self._count(self.timeout_stat if timeout else "remote_errors")
        (breaker or self.breaker).failure(self.redact.error(exc))

    def allow(self) -> bool:
        """Whether the store may be called now (see :meth:`CircuitBreaker.allow`)."""
        return self.breaker.allow()

    def forgo(self) -> None:
        """A call :meth:`allow` granted will not be made (see :meth:`CircuitBreaker.forgo`)."""
        self.breaker.forgo()

    def _guarded(self, call: Callable[[], Any], guard: bool = True) -> tuple[bool, Any]:
        """``(True, result)`` of ``call``, or ``(False, None)`` when refused or failed."""
        if guard and not self.breaker.allow():
            return False, None
        try:
            out = call()
        except Exception as exc:  # noqa: BLE001 - every failure is a miss, counted
            self.failed(exc)
            return False, None
        self.breaker.success()
        return True, out

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None] | None:
        """Store values in one batch: per item ``None`` (stored) or why the store refused it;
        ``None`` as a whole when the call failed. Callers ask :meth:`allow` first."""
        ok, out = self._guarded(lambda: self._set_many(items), guard=False)
        if not ok:
            return None
        refused = sum(e is not None for e in out)
        if refused:
            self._count("store_errors", refused)
        return out

    @abstractmethod
    def _set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None]:
        """Store every value in one batch (copy it, unless :attr:`keeps_values`: the writer
        reuses its buffer); per value ``None`` (stored) or why the store refused it
        (:class:`StoreRefused`, :class:`Unanswered`); raise when the call as a whole failed."""

    def new_buffer(self, nbytes: int) -> memoryview:
        """Memory for a writer thread to encode values into (kept and reused by that thread; its
        pages are backed as they are first written); a store whose client sends from registered
        memory registers it."""
        return memoryview(np.empty(nbytes, dtype=np.uint8))

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}


class ValueIO(GuardedCalls, metaclass=_NeedsPrimitives):
    """Guarded, counted calls to one key-value store: what a new key-value tier implements.

    A key-value tier is a ``ValueStoreTier`` (``value_tier.py``) whose ``open_io`` returns a
    subclass of this class. The tier implements every kvplug hook (``sdk/hookspecs.py``) on top of
    it: each chunk is one value in kvplug's chunk format under a name made from its key; stores
    are queued and sent in batches by writer threads; lookups are batched; pins, an optional LRU
    ``capacity`` and the breaker are kept by the tier. A subclass writes only the store's
    primitives below (the methods whose names start with ``_``, plus ``scratch`` and
    ``registered``), each one bounded round trip or batch call.

    **Required** (``@abstractmethod``: a subclass without one cannot be constructed):
    :meth:`_exists`, :meth:`_get`, :meth:`_set_many`, :meth:`_delete`.

    **Optional** (a default body, said on each): :meth:`_get_many` (default: one :meth:`_get`
    per name; write it when the store has a batch or pipelined read), :meth:`_get_each` (default:
    the values of :meth:`_get_many`; write it when the store reads into a reused buffer, so a
    batch is copied once), :meth:`_get_range` (default: none, and :attr:`ranged_reads` is then
    false; write it to serve layer ranges: without it the tier class must set
    ``get_layers = None``, and constructing the tier says so), :meth:`registered` (default:
    ``False``), :meth:`new_buffer` (default: plain memory), :meth:`close` (default: nothing).

    **Flags** (class attributes, or set in ``__init__``; each marked ``needed_when(flag)``
    primitive must be written when its flag is set, else construction raises a ``TypeError``
    naming it, as for a missing abstract method):

    * :attr:`reads_into` (default ``False``): the store receives a value in pieces straight into
      caller memory; the tier then reads chunks into its memory objects without a copy. Needs
      :meth:`_get_into_many` and :meth:`scratch`; :meth:`registered` says which memory qualifies.
    * :attr:`reads_anywhere` (default ``False``): with :attr:`reads_into`, any memory qualifies
      (a socket's ``recv_into``), so a tier with no L1 pool in front reads in place too.
    * :attr:`sized_reads` (default ``False``): a whole read is given the size the tier expects
      and a value of unknown size is read header first. Needs :meth:`_get_sized`, :meth:`_head`
      and :meth:`_get_range`. For stores that would otherwise download a value whole whatever
      its size (object stores).
    * :attr:`keeps_values` (default ``False``): the store keeps the buffer a value is sent from;
      the writer then encodes each value into fresh bytes rather than its reused buffer.
    * :attr:`timeout_types` (default none): the client's exception types, besides
      ``TimeoutError``, counted as timeouts.

    **Errors.** A primitive raises on a failed or timed-out call (any exception) and never
    retries: this class counts it (``remote_errors``, or :attr:`timeout_stat` for a timeout),
    scrubs credentials from its message, feeds it to the breaker and answers a miss (``None``);
    while the breaker is open the store is not called. A missing value is ``None``, not an
    exception. In :meth:`_set_many` a value the store refused while the call succeeded is
    returned in its place: :class:`StoreRefused` (full, too large: counted, not held against the
    breaker) or :class:`Unanswered` (the part of the store that holds it did not answer). Bound
    every call by the tier's ``timeout_s`` (give it to the client); kvplug also answers a hook
    that is late as a miss.

    **Untrusted bytes.** Return what the store holds, as is: nothing is trusted. Before a byte
    reaches the engine the tier checks the value's length against the largest chunk the engine
    can have (:attr:`read_limit`, set by the tier), its header (format version, the key it was
    stored under, sizes), every layer's checksum and, with ``auth_key_env``, its MAC. A value
    that fails is a miss, counted and logged once: a ``corrupt`` one is deleted, one of another
    format version (``other_version``) or too long (``oversized``) left in place. Where the
    store can, a whole read receives at most ``read_limit() + 1`` bytes (a ``sized_reads`` read:
    ``expect + 1``), so a value too long costs no more than that to refuse.

    **Testing.** The package ``kvplug new-backend NAME --key-value`` generates has
    ``tests/test_backend.py``: kvplug's conformance kit (the tier alone and behind ``local_cpu``,
    persistent, a value corrupted in the store) and its deterministic simulation, against an
    in-process stand-in of the store. Run ``python -m pytest`` in the package after every change.
    """

    #: Whether the store reads a value in pieces straight into caller memory
    #: (:meth:`get_into_many`; the tier then reads chunks into its memory objects).
    reads_into = False
    #: Whether those reads may land in any memory (a socket's ``recv_into``), not only in memory
    #: registered with the store's client (Mooncake): then a tier with no L1 pool in front reads
    #: into its heap objects in place too.
    reads_anywhere = False
    #: ``read_limit() -> int | None``: the most bytes of one value a read may receive (the
    #: tier's ``ctx.read_limit``, set by the tier); a store receives at most one byte more, so
    #: the tier sees a longer value is too long without it costing its length.
    read_limit: Callable[[], int | None] = staticmethod(lambda: None)
    #: Whether a whole read takes the size the tier expects (:meth:`get`'s ``expect``: the
    #: store then receives at most one byte more) and a value of unknown size is read header
    #: first (:meth:`head`, then the body the checked header sizes): fsspec, whose objects a
    #: read would otherwise download whole whatever their size.
    sized_reads = False

    # -- what subclasses implement (raise on a failed call) -------------------------------------
    @abstractmethod
    def _exists(self, names: Sequence[str]) -> list[bool | None]:
        """Per name whether the store holds it, in one batch."""

    @abstractmethod
    def _get(self, name: str) -> bytes | None:
        """The whole value, ``None`` when it is missing."""

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """Whole values in one batch (one pipeline, one batch call); one ``_get`` each unless a
        store overrides it."""
        return [self._get(n) for n in names]

    @needed_when("sized_reads")
    def _get_sized(self, name: str, expect: int) -> bytes | None:
        """Bytes ``[0, expect + 1)`` of the value: all of it when it is at most ``expect`` bytes
        long."""
        raise NotImplementedError

    def _get_each(self, names: Sequence[str],
                  use: Callable[[int, bytes | memoryview | None], None],
                  expects: Sequence[int | None] | None = None) -> None:
        """Hand each value to ``use(i, value)`` as it is read; a store that reads into a reused
        buffer hands a view of it, valid only during the call (no copy per value); ``expects``:
        the sizes the tier expects (:attr:`sized_reads` stores). Default: the values of
        :meth:`_get_many`."""
        for i, value in enumerate(self._get_many(names)):
            use(i, value)

    @needed_when("sized_reads")
    def _head(self, name: str, length: int) -> tuple[bytes, int] | None:
        """The first ``length`` bytes of a value and its size, in one round trip; ``None`` when
        it is missing."""
        raise NotImplementedError

    @needed_when("sized_reads")
    def _get_range(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a value, ``None`` when it is missing: the body of a
        :attr:`sized_reads` read, and a tier's ``get_layers`` (see :attr:`ranged_reads`)."""
        raise NotImplementedError

    @abstractmethod
    def _delete(self, names: Sequence[str]) -> None:
        """Delete values in one batch (missing ones are fine)."""

    @needed_when("reads_into")
    def _get_into_many(self, names: Sequence[str], pieces: Sequence[Sequence[tuple[int, int]]]
                       ) -> list[int | bytearray | None]:
        """See :meth:`get_into_many`."""
        raise NotImplementedError

    def registered(self, address: int, nbytes: int) -> bool:
        """Whether the store may read into ``[address, address + nbytes)`` (a store that reads
        into memory only reads into memory registered with its client)."""
        return False

    @needed_when("reads_into")
    def scratch(self, nbytes: int) -> Any:
        """This thread's scratch memory for reads in pieces (at least ``nbytes``; registered),
        as a numpy ``uint8`` array; reused by the thread's next read."""
        raise NotImplementedError

    @property
    def ranged_reads(self) -> bool:
        """Whether the store reads a byte range of a value (:meth:`_get_range`): a tier's
        ``get_layers`` needs it, and so does every :attr:`sized_reads` store. True where
        :meth:`_get_range` is implemented or :attr:`sized_reads` is set."""
        return self.sized_reads or type(self)._get_range is not ValueIO._get_range

    def missing_primitives(self) -> list[str]:
        """The primitives :func:`needed_when` a flag this store sets that it does not implement
        (each named with the flag)."""
        missing = []
        for name, declared in vars(ValueIO).items():
            flag = getattr(declared, NEEDED_WHEN, None)
            if flag is not None and getattr(self, flag) and getattr(type(self), name) is declared:
                missing.append(f"{name} (needed with {flag})")
        return missing

    def close(self) -> None:
        """Release the client (idempotent)."""

    # -- guarded calls --------------------------------------------------------------------------
    def exists(self, names: Sequence[str]) -> list[bool | None]:
        """Per name: whether the store holds it (``None``: unknown, the store is unavailable)."""
        self._count("remote_lookups", len(names))
        ok, out = self._guarded(lambda: self._exists(names))
        return out if ok else [None] * len(names)

    def get(self, name: str, expect: int | None = None) -> bytes | None:
        """The whole value (``None``: missing or unavailable); with ``expect`` (a
        :attr:`sized_reads` store), at most ``expect + 1`` bytes of it."""
        if expect is not None and self.sized_reads:
            return self._guarded(lambda: self._get_sized(name, expect))[1]
        return self._guarded(lambda: self._get(name))[1]

    def head(self, name: str, length: int) -> tuple[bytes, int] | None:
        """See :meth:`_head`; ``None`` when missing or unavailable."""
        return self._guarded(lambda: self._head(name, length))[1]

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """Whole values, one per name (``None``: missing; all ``None``: unavailable)."""
        ok, out = self._guarded(lambda: self._get_many(names))
        return out if ok else [None] * len(names)

    def get_each(self, names: Sequence[str],
                 use: Callable[[int, bytes | memoryview | None], None],
                 expects: Sequence[int | None] | None = None) -> None:
        """:meth:`get_many` handing each value to ``use(i, value)`` as it is read (a view valid
        only during the call); every index is handed once, ``None`` for a missing value and for
        each one left unread when the store failed or was refused part way. ``expects``: as
        :meth:`get`'s ``expect``, per name."""
        done = 0

        def counted(i: int, value: bytes | memoryview | None) -> None:
            nonlocal done
            done = i + 1
            use(i, value)

        self._guarded(lambda: self._get_each(names, counted, expects))
        for i in range(done, len(names)):
            use(i, None)

    def get_into_many(self, names: Sequence[str], pieces: Sequence[Sequence[tuple[int, int]]]
                      ) -> list[int | bytearray | None]:
        """Read each value into its pieces (``(address, nbytes)``, registered memory, in order).
        Per name: the value's size when it filled every piece exactly; when its size differs,
        the whole value where the store read it anyway (resp), else ``-1`` (nothing usable was
        read); ``None`` when it is missing; all ``None`` when the store is unavailable."""
        ok, out = self._guarded(lambda: self._get_into_many(names, pieces))
        return out if ok else [None] * len(names)

    def get_range(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a value; ``None`` when missing or unavailable."""
        return self._guarded(lambda: self._get_range(name, start, end))[1]

    def delete(self, names: Sequence[str]) -> None:
        """Delete values (missing ones are fine); counted as ``evicted``."""
        if names:
            self._count("evicted", len(names))
            self._guarded(lambda: self._delete(names))
