"""``kvplug.backends.common.value_writer.ValueWriter``: the write queue every remote tier shares.
Over an in-memory key-value store (a real ``ValueIO``, whose batch call a test can hold) and the
writer's real threads: the exact bytes of each chunk reach the store, in batches; a store in
flight is invisible and spared by eviction; a full queue, a refusing or a failing store drop and
count, never raise; capacity evictions delete the least recently written unpinned values; every
memory object is released."""

from __future__ import annotations

import logging
import random
import threading

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.backends.common.breaker import CircuitBreaker
from kvplug.backends.common.chunks import HeaderCache
from kvplug.backends.common.index import CapacityIndex, Pins
from kvplug.backends.common.value_io import StoreRefused, ValueIO
from kvplug.backends.common.value_writer import TierParts, ValueWriter
from kvplug.logs import LogOnce
from kvplug.memory import MemoryFormat
from kvplug.pool import HostMemoryPool
from kvplug.redact import Redactor
from kvplug.testing import make_key

HANG = 30.0  # seconds: a hang, never a speed check
SHAPE = (2, 1, 1024)  # 2 KiB chunks


class MemoryStore(ValueIO):
    """A key-value store in a dict. ``hold`` (cleared) parks the next batch call until set;
    ``refuse``: names it answers as full; ``fail``: the next batch calls raise."""

    def __init__(self) -> None:
        super().__init__("kv", CircuitBreaker("kv", threshold=1000), Redactor())
        self.values: dict[str, bytes] = {}
        self.batches: list[list[str]] = []
        self.deleted: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.refuse: set[str] = set()
        self.fail = False

    def _set_many(self, items):
        self.entered.set()
        assert self.hold.wait(HANG), "the test never released the store"
        if self.fail:
            raise ConnectionError("store down")
        self.batches.append([n for n, _ in items])
        out = []
        for name, data in items:
            if name in self.refuse:
                out.append(StoreRefused("OOM"))
            else:
                self.values[name] = bytes(data)
                out.append(None)
        return out

    def _delete(self, names):
        self.deleted.extend(names)
        for n in names:
            self.values.pop(n, None)

    def _exists(self, names):
        return [n in self.values for n in names]

    def _get(self, name):
        return self.values.get(name)


@pytest.fixture
def pool():
    return HostMemoryPool(8 << 20, pin_memory=False)


def chunk(pool: HostMemoryPool, seed: int):
    obj = pool.allocate(SHAPE, fmt=MemoryFormat.KV_PAGES, num_tokens=16)
    g = torch.Generator().manual_seed(seed)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=g))
    return obj


def encoded(key, obj) -> bytes:
    header, bufs = cf.encode_chunk(key, obj)
    return b"".join([header, *bufs])


def writer(store: MemoryStore, *, capacity: int | None = None, max_pending: int = 64,
           threads: int = 2, batch_bytes: int = 1 << 20, pins: Pins | None = None,
           max_pending_bytes: int = 1 << 30) -> ValueWriter:
    parts = TierParts("kv", store, CapacityIndex(capacity), HeaderCache(),
                      Pins() if pins is None else pins,
                      LogOnce(logging.getLogger("test.value_writer")))
    return ValueWriter(parts, max_pending=max_pending, threads=threads, batch_bytes=batch_bytes,
                       written_ttl_s=60.0, max_pending_bytes=max_pending_bytes)


def test_every_chunk_reaches_the_store_with_its_exact_bytes_and_is_released(pool):
    store = MemoryStore()
    w = writer(store, batch_bytes=3 * 2048)
    rng = random.Random(1)
    seeds = rng.sample(range(10_000), 20)
    objs = {f"n{i}": (make_key(s), chunk(pool, s)) for i, s in enumerate(seeds)}
    want = {name: encoded(key, obj) for name, (key, obj) in objs.items()}
    assert len(set(want.values())) == 20  # random chunks: a mix-up would show
    try:
        for name, (key, obj) in objs.items():
            w.enqueue(name, key, obj)
            obj.ref_down()  # the writer holds its own reference
        assert w.flush(HANG)
        assert store.values == want
        assert sorted(n for b in store.batches for n in b) == sorted(want)  # each once
        assert all(obj.is_freed for _, obj in objs.values())
        stats = w.stats()
        assert (stats["written"], stats["bytes_put"], stats["dropped_puts"],
                stats["pending_writes"], stats["queued_bytes"]) == (
            20, sum(map(len, want.values())), 0, 0, 0)
        assert w.known(list(want) + ["other"], trust_written=True) == [True] * 20 + [None]
        assert w.known(list(want), trust_written=False) == [None] * 20
        again = chunk(pool, seeds[0])
        w.enqueue("n0", objs["n0"][0], again)  # written recently: not stored again
        assert w.flush(HANG) and w.stats()["written"] == 20 and again.ref_count == 1
        again.ref_down()
    finally:
        w.close(drain_s=HANG, join_s=HANG)


def test_a_store_in_flight_is_unknown_to_lookups_and_spared_by_eviction(pool):
    store = MemoryStore()
    store.hold.clear()
    w = writer(store, threads=1)
    key, obj = make_key(7), chunk(pool, 7)
    try:
        w.enqueue("a", key, obj)
        assert store.entered.wait(HANG)
        assert w.known(["a", "b"], trust_written=True) == [False, None]
        assert w.protected("a") and not w.protected("b")
        assert not w.flush(0.05)  # the store is parked: the write is pending
        assert w.stats()["pending_writes"] == 1
        assert obj.ref_count == 1  # encoded before the call: L1 may reuse the memory
        store.hold.set()
        assert w.flush(HANG)
        assert not w.protected("a") and w.known(["a"], trust_written=True) == [True]
        assert store.values["a"] == encoded(key, obj)
    finally:
        store.hold.set()
        obj.ref_down()
        w.close(drain_s=HANG, join_s=HANG)


def test_a_full_queue_drops_the_store_and_counts_it(pool):
    store = MemoryStore()
    store.hold.clear()
    w = writer(store, threads=1, max_pending=2)
    objs = [chunk(pool, i) for i in range(5)]
    try:
        w.enqueue("x0", make_key(0), objs[0])
        assert store.entered.wait(HANG)  # x0 is being written: the queue is empty again
        for i in range(1, 5):
            w.enqueue(f"x{i}", make_key(i), objs[i])
        stats = w.stats()
        assert (stats["dropped_queue_full"], stats["dropped_puts"]) == (2, 2)
        # queued ones held, dropped ones released at once (x0 is encoded: released too)
        assert [o.ref_count for o in objs] == [1, 2, 2, 1, 1]
        assert w.known(["x3", "x4"], trust_written=True) == [None, None]
        store.hold.set()
        assert w.flush(HANG)
        assert sorted(store.values) == ["x0", "x1", "x2"]
        assert store.batches[0] == ["x0"] and sorted(store.batches[1]) == ["x1", "x2"]
    finally:
        store.hold.set()
        for o in objs:
            o.ref_down()
        w.close(drain_s=HANG, join_s=HANG)


def test_the_queue_is_bounded_by_bytes_too(pool):
    store = MemoryStore()
    store.hold.clear()
    w = writer(store, threads=1, max_pending=100, max_pending_bytes=2 * 2048)
    objs = [chunk(pool, i) for i in range(5)]
    try:
        w.enqueue("y0", make_key(0), objs[0])
        assert store.entered.wait(HANG)
        for i in range(1, 5):
            w.enqueue(f"y{i}", make_key(i), objs[i])
        assert w.stats()["queued_bytes"] == 2 * 2048
        assert w.stats()["dropped_queue_full"] == 2
    finally:
        store.hold.set()
        assert w.flush(HANG)
        for o in objs:
            o.ref_down()
        w.close(drain_s=HANG, join_s=HANG)


def test_refused_and_failed_stores_are_dropped_counted_and_released(pool):
    store = MemoryStore()
    store.refuse = {"r1"}
    w = writer(store, threads=1)
    objs = [chunk(pool, i) for i in range(3)]
    try:
        for i, name in enumerate(["ok", "r1"]):
            w.enqueue(name, make_key(i), objs[i])
        assert w.flush(HANG)
        assert sorted(store.values) == ["ok"]
        stats = w.stats()
        assert (stats["written"], stats["dropped_full"], stats["put_errors"]) == (1, 1, 0)
        store.fail = True
        w.enqueue("down", make_key(2), objs[2])
        assert w.flush(HANG)
        stats = w.stats()
        assert (stats["put_errors"], stats["dropped_puts"]) == (1, 2)
        assert "down" not in store.values
        assert [o.ref_count for o in objs] == [1, 1, 1]
        assert w.known(["r1", "down"], trust_written=True) == [None, None]
    finally:
        for o in objs:
            o.ref_down()
        w.close(drain_s=HANG, join_s=HANG)


def test_capacity_evicts_the_oldest_unpinned_values_from_the_store(pool):
    store = MemoryStore()
    pins = Pins()
    first = [chunk(pool, 0)]
    size = len(encoded(make_key(0), first[0]))
    first[0].ref_down()
    w = writer(store, threads=1, capacity=3 * size, pins=pins)
    try:
        for i in range(3):
            obj = chunk(pool, i)
            w.enqueue(f"c{i}", make_key(i), obj)
            obj.ref_down()
            assert w.flush(HANG)
        pins.pin_all(["c0"])
        for i in range(3, 5):
            obj = chunk(pool, i)
            w.enqueue(f"c{i}", make_key(i), obj)
            obj.ref_down()
            assert w.flush(HANG)
        assert store.deleted == ["c1", "c2"]  # oldest first; the pinned c0 spared
        assert sorted(store.values) == ["c0", "c3", "c4"]
        assert w.known(["c1", "c2"], trust_written=True) == [None, None]  # not trusted any more
        assert store.stats()["evicted"] == 2
    finally:
        w.close(drain_s=HANG, join_s=HANG)


def test_close_refuses_new_stores_and_releases_what_it_drops(pool):
    store = MemoryStore()
    store.hold.clear()
    w = writer(store, threads=1)
    objs = [chunk(pool, i) for i in range(3)]
    w.enqueue("z0", make_key(0), objs[0])
    assert store.entered.wait(HANG)
    w.enqueue("z1", make_key(1), objs[1])
    assert w.close(drain_s=0.05, join_s=0.05)  # z0 still parked in the store: z1 dropped
    assert not w.close(drain_s=0, join_s=0)  # once
    w.enqueue("z2", make_key(2), objs[2])  # after close: refused, not held
    store.hold.set()
    assert w.flush(HANG)  # z0's call ends
    assert [o.ref_count for o in objs] == [1, 1, 1]
    assert sorted(store.values) == ["z0"]
    assert w.stats()["dropped_puts"] == 1 and w.stats()["pending_writes"] == 0
    for o in objs:
        o.ref_down()


def test_submit_is_a_deprecated_alias_of_enqueue(pool):
    store = MemoryStore()
    w = writer(store)
    obj = chunk(pool, 0)
    try:
        with pytest.warns(DeprecationWarning, match="enqueue"):
            w.submit("d0", make_key(0), obj)
        assert w.flush(HANG) and sorted(store.values) == ["d0"]
    finally:
        w.close(drain_s=HANG, join_s=HANG)
        obj.ref_down()
