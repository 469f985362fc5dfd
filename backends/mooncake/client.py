"""The mooncake tier's client: Mooncake Store's Python client, its calls bounded and classified.

The client is set up on a background thread as the tier starts (``MooncakeDistributedStore.setup``
with the P2P handshake, no etcd), so the process lends its segment to the store and the first
request does not pay the setup, while a master that is down at start is an outage like any other
(the first call tries again, behind the breaker), not a startup failure. Mooncake reads its time
limits from the environment: ``MC_RPC_TIMEOUT_MS`` and ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (set from
``timeout_s`` unless already set — they are process-wide) and ``MC_STORE_CLIENT_SETUP_RETRIES``
(``setup_retries``; its default would retry for 90 s). The client registers L1's pool
(``ctx.memory_regions``) and its own buffers: loads go in pieces straight into memory objects
(``batch_get_into_multi_buffers``: the header into scratch memory, the layers into the object, no
copy) or whole into a thread's buffer, and stores go from the writer threads' registered encoding
buffers (``batch_upsert_from``). Error codes tell a missing object (-704) from an unreachable
master (-900 and below), which a plain ``get`` (``b''`` for both) cannot.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvplug.errors import ConfigError
from kvplug.redact import Redactor
from kvplug.runtime import THREADS, Runtime

from ..common.breaker import CircuitBreaker
from ..common.value_io import StoreRefused, ValueIO

logger = logging.getLogger("kvplug.backends.mooncake")

#: Mooncake's codes: an object that does not exist; one the master holds a lease on (it was
#: read or asked about within its ``default_kv_lease_ttl``, 10 s by default: a remove of it is
#: refused); codes at or below RPC_FAILED are outages.
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
RPC_FAILED = -900
#: How often a remove Mooncake refused for a lease is asked again (on the tier's next calls).
LEASED_RETRY_S = 1.0
#: Removes refused for a lease remembered at once; past it the oldest is forgotten (left to
#: Mooncake's own eviction) and said once in the log.
MAX_LEASED = 1 << 16


class MooncakeError(ConnectionError):
    """A call the store did not answer (master or peer unreachable, timed out)."""


def _store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError(f"mooncake tier: Mooncake's client is not installed ({exc}); install "
                          "kvplug[mooncake] (and libibverbs1: apt-get install libibverbs1)") from None
    return MooncakeDistributedStore


class MooncakeIO(ValueIO):
    """Mooncake Store's primitives: batch existence, reads in pieces into registered memory
    (L1's pool, this thread's buffers), batch upserts from registered memory (``put`` would keep
    an older value), batch removes.

    Mooncake's master leases an object to whoever reads it or asks whether it exists, and
    refuses to remove it until the lease ends (10 s by default). A name whose remove was refused
    is gone as far as this tier is concerned (evicted for room, cleared by an operator): it is
    answered absent and never read (asking would renew the lease) until a later write stores it
    again, and its remove is asked again on the tier's next calls until Mooncake takes it."""

    reads_into = True

    def __init__(self, name: str, opts: Any, breaker: CircuitBreaker, redact: Redactor,
                 memory_regions: Callable[[], list[tuple[int, int]]] = list,
                 runtime: Runtime = THREADS) -> None:
        super().__init__(name, breaker, redact)
        self._opts = opts
        self._cls = _store_class()
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, int(opts.timeout_s * 1000))))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(opts.timeout_s))))
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(opts.setup_retries))
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._local = threading.local()
        self._memory_regions = memory_regions
        self._buffers: list[np.ndarray] = []  # this client's own buffers (kept alive)
        self._regions: list[tuple[int, int]] = []  # registered [start, end)
        self._closed = False
        #: names whose remove Mooncake refused for a lease -> when it was last asked
        self._leased: dict[str, float] = {}
        self._leased_lock = threading.Lock()
        self._clock = runtime.monotonic
        # one task on a daemon pool of the tier's runtime (kvplug.runtime: a simulation's orders it)
        setup = runtime.executor(1, f"kvplug-{name}-setup", daemon=True)
        setup.submit(self._set_up_early)
        setup.shutdown(wait=False)

    def _set_up_early(self) -> None:
        """Set the client up now (see the module docstring); a failure waits for the first call."""
        try:
            self.store()
        except Exception as exc:  # noqa: BLE001 - the first call sets up again and reports
            logger.info("tier %r: Mooncake client not set up at start (%s); the first call "
                        "tries again", self.name, self.redact.error(exc))

    @property
    def set_up(self) -> bool:
        """Whether the client is set up (lending its segment to the store)."""
        return self._store is not None

    def store(self) -> Any:
        with self._store_lock:
            if self._closed:
                raise MooncakeError("the tier is closed")
            if self._store is None:
                o = self._opts
                store = self._cls()
                rc = store.setup(o.local_hostname, o.metadata_server, int(o.global_segment_size),
                                 int(o.local_buffer_size), o.protocol, o.device_name, o.master)
                if rc != 0:
                    raise MooncakeError(f"setup against master {o.master} failed ({rc})")
                self._store = store
                # L1's pool (reads land in it) and buffers made before the client was set up.
                for address, nbytes in self._memory_regions():
                    self._register(address, nbytes)
                for buf in self._buffers:
                    self._register(buf.ctypes.data, buf.nbytes)
            return self._store

    def _register(self, address: int, nbytes: int) -> None:
        """Register memory with the client (``_store_lock`` held, client set up); memory that
        fails to register is used through copies instead."""
        if self._store.register_buffer(address, nbytes) == 0:
            self._regions.append((address, address + nbytes))

    def _own(self, nbytes: int) -> np.ndarray:
        """A buffer of this client's, registered once the client is set up."""
        buf = np.empty(nbytes, dtype=np.uint8)
        with self._store_lock:
            self._buffers.append(buf)
            if self._store is not None:
                self._register(buf.ctypes.data, buf.nbytes)
        return buf

    def registered(self, address: int, nbytes: int) -> bool:
        return any(a <= address and address + nbytes <= b for a, b in self._regions)

    def new_buffer(self, nbytes: int) -> memoryview:
        return memoryview(self._own(nbytes))

    def scratch(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.scratch = self._own(max(nbytes, 1 << 16))
        return buf

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code <= RPC_FAILED:
            raise MooncakeError(f"{what} failed ({code})")

    # -- removes Mooncake refused for a lease (see the class docstring) ---------------------------
    def _gone(self, names: Sequence[str]) -> set[str]:
        """Of ``names``, those removed as far as this tier is concerned (their remove waits for
        a lease to end); the removes that are due are asked again first."""
        self._remove_leased()
        with self._leased_lock:
            return {n for n in names if n in self._leased} if self._leased else set()

    def _remove_leased(self) -> None:
        """Ask again for the removes refused at least :data:`LEASED_RETRY_S` ago."""
        now = self._clock()
        with self._leased_lock:
            due = [n for n, at in self._leased.items() if now - at >= LEASED_RETRY_S]
            for n in due:
                self._leased[n] = now
        if due:
            self._removed(due, self.store().batch_remove(due))

    def _removed(self, names: Sequence[str], codes: Sequence[int]) -> None:
        """Note the answers of a batch remove: a refusal for a lease is remembered (asked again
        later), anything else ends it; an outage raises."""
        now = self._clock()
        with self._leased_lock:
            for n, c in zip(names, codes):
                if c == OBJECT_HAS_LEASE:
                    self._leased.setdefault(n, now)
                else:
                    self._leased.pop(n, None)
            while len(self._leased) > MAX_LEASED:
                self._leased.pop(next(iter(self._leased)))
                self._said_once("leased", "tier %r: more than %d removes wait for Mooncake's "
                                "leases; the oldest are left to Mooncake's own eviction",
                                self.name, MAX_LEASED)
        for c in codes:
            self._check(c, "batch_remove")

    def _stored(self, names: Sequence[str]) -> None:
        """These names hold what was just written: no remove of theirs is pending any more."""
        if self._leased:
            with self._leased_lock:
                for n in names:
                    self._leased.pop(n, None)

    def _said_once(self, what: str, msg: str, *args: Any) -> None:
        if not getattr(self, f"_told_{what}", False):
            setattr(self, f"_told_{what}", True)
            logger.warning(msg, *args)

    def _exists(self, names: Sequence[str]) -> list[bool | None]:
        gone = self._gone(names)
        ask = [n for n in names if n not in gone]
        codes = self.store().batch_is_exist(ask) if ask else []
        if min(codes, default=0) <= RPC_FAILED:
            self._check(min(codes), "batch_is_exist")
        answers = dict(zip(ask, codes))
        return [False if n in gone else True if answers[n] == 1 else False if answers[n] == 0
                else None for n in names]

    def _slab(self, store: Any, size: int) -> np.ndarray:
        """This thread's read buffer for whole values, grown to ``size`` bytes when needed."""
        slab = getattr(self._local, "slab", None)
        if slab is None or slab.nbytes < size:
            slab = self._local.slab = self._own(1 << max(22, (size - 1).bit_length()))
        return slab

    def _get(self, name: str) -> memoryview | None:
        """The value as a view of this thread's read buffer (valid until its next read). One
        call when the buffer is large enough (the usual case once a thread has read a chunk);
        ``get_size`` only on a miss or a value larger than the buffer."""
        if self._gone([name]):
            return None
        store = self.store()
        slab = getattr(self._local, "slab", None)
        if slab is not None:
            n = store.get_into(name, slab.ctypes.data, slab.nbytes)
            if n >= 0:
                return memoryview(slab)[:n]
            self._check(n, "get_into")  # an outage raises here, without a second call
        size = store.get_size(name)
        if size < 0:
            self._check(size, "get_size")
            return None
        limit = self.read_limit()
        if limit is not None and size > limit:  # never sized by the store: a miss
            return None
        slab = self._slab(store, size)
        n = store.get_into(name, slab.ctypes.data, slab.nbytes)
        if n < 0:
            self._check(n, "get_into")
            return None  # removed or evicted since get_size
        return memoryview(slab)[:n]

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        out = []
        for name in names:  # each read reuses the thread's buffer: keep a copy
            view = self._get(name)
            out.append(None if view is None else bytes(view))
        return out

    def _get_each(self, names: Sequence[str], use: Callable[[int, memoryview | None], None],
                  expects: Sequence[int | None] | None = None) -> None:
        for i, name in enumerate(names):  # a view of the thread's buffer: used before the next
            use(i, self._get(name))

    def _get_into_many(self, names: Sequence[str],
                       pieces: Sequence[Sequence[tuple[int, int]]]) -> list[int | None]:
        gone = self._gone(names)
        ask = [i for i, n in enumerate(names) if n not in gone]
        got = self.store().batch_get_into_multi_buffers(
            [names[i] for i in ask], [[a for a, _ in pieces[i]] for i in ask],
            [[n for _, n in pieces[i]] for i in ask]) if ask else []
        codes = [OBJECT_NOT_FOUND] * len(names)
        for i, code in zip(ask, got):
            codes[i] = code
        out: list[int | None] = []
        for code, p in zip(codes, pieces):
            if code >= 0:
                out.append(code if code == sum(n for _, n in p) else -1)
            elif code == OBJECT_NOT_FOUND:
                out.append(None)
            else:  # -600 (pieces too small), -800 (too large): another size; outages raise
                self._check(code, "batch_get_into_multi_buffers")
                out.append(-1)
        return out

    def _set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None]:
        store = self.store()
        names = [n for n, _ in items]
        where = [_address(v) for _, v in items]
        if all(a is not None and self.registered(a, len(v)) for a, (_, v) in zip(where, items)):
            codes = store.batch_upsert_from(names, where, [len(v) for _, v in items])
            for c in codes:
                self._check(c, "batch_upsert_from")
            self._stored([n for n, c in zip(names, codes) if c == 0])
            return [None if c == 0 else StoreRefused(f"batch_upsert_from refused ({c}: full or "
                                                     "too large)") for c in codes]
        rc = store.upsert_batch(names, [v for _, v in items])
        if rc == 0:
            self._stored(names)
            return [None] * len(items)
        self._check(rc, "upsert_batch")
        return [StoreRefused(f"upsert_batch refused ({rc}: full or too large)")] * len(items)

    def _delete(self, names: Sequence[str]) -> None:
        names = list(names)
        self._removed(names, self.store().batch_remove(names))

    def close(self) -> None:
        with self._store_lock:
            self._closed = True
            store, self._store = self._store, None
            regions, self._regions = self._regions, []
            self._buffers = []
        if store is not None:
            for address, _ in regions:
                try:
                    store.unregister_buffer(address)
                except Exception:  # noqa: BLE001, S110 - closing anyway
                    pass
            try:
                store.close()
            except Exception:  # noqa: BLE001, S110 - a master that is gone
                pass


def _address(value: Any) -> int | None:
    """The address of a writable buffer's bytes (``None`` for bytes: never registered)."""
    if not isinstance(value, memoryview) or value.readonly:
        return None
    return np.frombuffer(value, dtype=np.uint8).ctypes.data
