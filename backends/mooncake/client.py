"""The mooncake tier's client: Mooncake Store's Python client, its calls bounded and classified.

The client is set up on first use (``MooncakeDistributedStore.setup`` with the P2P handshake, no
etcd), so a master that is down when the tier starts is an outage like any other (the breaker),
not a startup failure. Mooncake reads its time limits from the environment: ``MC_RPC_TIMEOUT_MS``
and ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (set from ``timeout_s`` unless already set — they are
process-wide) and ``MC_STORE_CLIENT_SETUP_RETRIES`` (``setup_retries``; its default would retry
for 90 s). Loads go into a registered buffer of the calling thread (``get_into``: no copy inside
the client), sized by ``get_size`` first, whose error code tells a missing object (-704) from an
unreachable master (-900 and below), which a plain ``get`` (``b''`` for both) cannot.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from kvplug.errors import ConfigError

from ..common.breaker import CircuitBreaker
from ..common.redact import Redactor
from ..common.value_io import StoreRefused, ValueIO

#: Mooncake's codes: an object that does not exist; codes at or below RPC_FAILED are outages.
OBJECT_NOT_FOUND = -704
RPC_FAILED = -900


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
    """Mooncake Store's primitives: batch existence, sized reads into registered memory, batch
    upserts (``put`` would keep an older value), batch removes."""

    def __init__(self, name: str, opts: Any, breaker: CircuitBreaker, redact: Redactor) -> None:
        super().__init__(name, breaker, redact)
        self._opts = opts
        self._cls = _store_class()
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, int(opts.timeout_s * 1000))))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(opts.timeout_s))))
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(opts.setup_retries))
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._local = threading.local()
        self._slabs: list[np.ndarray] = []  # every registered buffer (kept alive, unregistered)

    def store(self) -> Any:
        with self._store_lock:
            if self._store is None:
                o = self._opts
                store = self._cls()
                rc = store.setup(o.local_hostname, o.metadata_server, int(o.global_segment_size),
                                 int(o.local_buffer_size), o.protocol, o.device_name, o.master)
                if rc != 0:
                    raise MooncakeError(f"setup against master {o.master} failed ({rc})")
                self._store = store
            return self._store

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code <= RPC_FAILED:
            raise MooncakeError(f"{what} failed ({code})")

    def _exists(self, names: Sequence[str]) -> list[bool | None]:
        codes = self.store().batch_is_exist(list(names))
        for c in codes:
            self._check(c, "batch_is_exist")
        return [True if c == 1 else False if c == 0 else None for c in codes]

    def _slab(self, store: Any, size: int) -> np.ndarray:
        """This thread's registered read buffer, grown to ``size`` bytes when needed."""
        slab = getattr(self._local, "slab", None)
        if slab is None or slab.nbytes < size:
            slab = np.empty(1 << max(22, (size - 1).bit_length()), dtype=np.uint8)
            rc = store.register_buffer(slab.ctypes.data, slab.nbytes)
            if rc != 0:
                raise MooncakeError(f"register_buffer of {slab.nbytes} bytes failed ({rc})")
            with self._store_lock:
                self._slabs.append(slab)
            self._local.slab = slab
        return slab

    def _get(self, name: str) -> memoryview | None:
        """The value as a view of this thread's read buffer (valid until its next read). One
        call when the buffer is large enough (the usual case once a thread has read a chunk);
        ``get_size`` only on a miss or a value larger than the buffer."""
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
        slab = self._slab(store, size)
        n = store.get_into(name, slab.ctypes.data, slab.nbytes)
        if n < 0:
            self._check(n, "get_into")
            return None  # removed or evicted since get_size
        return memoryview(slab)[:n]

    def _set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None]:
        rc = self.store().upsert_batch([n for n, _ in items], [v for _, v in items])
        if rc == 0:
            return [None] * len(items)
        self._check(rc, "upsert_batch")
        return [StoreRefused(f"upsert_batch refused ({rc}: full or too large)")] * len(items)

    def _delete(self, names: Sequence[str]) -> None:
        for c in self.store().batch_remove(list(names)):
            self._check(c, "batch_remove")

    def close(self) -> None:
        with self._store_lock:
            store, self._store = self._store, None
            slabs, self._slabs = self._slabs, []
        if store is not None:
            for slab in slabs:
                try:
                    store.unregister_buffer(slab.ctypes.data)
                except Exception:  # noqa: BLE001, S110 - closing anyway
                    pass
            try:
                store.close()
            except Exception:  # noqa: BLE001, S110 - a master that is gone
                pass
