"""The backend conformance suite: pytest tests any backend package runs against itself.

Subclass :class:`BackendConformance` in a test module and provide the ``make_tiers`` fixture::

    from kvplug.testing import BackendConformance

    class TestMyStore(BackendConformance):
        persistent = True   # entries survive close() and a new StorageManager

        @pytest.fixture
        def make_tiers(self, tmp_path):
            return lambda capacity: [
                {"backend": "mystore", "options": {"path": str(tmp_path), "capacity": capacity}}
            ]

Optionally override ``corrupt_entry`` (damage a stored entry; the backend must then miss it).
Needs only pytest and kvplug — no test extras. Each test says in its docstring what it checks.

The StorageManager turns every exception a backend raises into a miss, so the tests also call
each tier's hooks directly (:func:`call_hook`), where an exception surfaces, and every test ends
by asserting that no tier had a fault or a timeout (:meth:`BackendConformance.assert_no_faults`).
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from kvplug.hookspecs import PROJECT
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.storage_manager import StorageManager

SHAPES = [((2, 1, 4096), torch.uint8), ((4, 2, 8192), torch.uint8), ((3, 1, 1024), torch.int32)]
CHUNK_SHAPE = (2, 2, 4096)  # 16 KiB per chunk
CHUNK_BYTES = 2 * 2 * 4096
_SECRET_ENV = "CONFORMANCE_KIT_SECRET"
#: How long a test waits for a condition it means (a store landing) before calling it a hang.
HANG_S = 60.0


def make_key(i: int, *, model: str = "conformance/model", rank: int = 0, ws: int = 1,
             dtype: str = "bfloat16", tenant: str = "") -> CacheKey:
    """A deterministic key for chunk ``i`` (the other fields: an engine's, by default one that
    every test shares; ``tenant``: the tenant id the key is stored under)."""
    return CacheKey(model, dtype, "LBHNC-bs16", ws, rank, i.to_bytes(4, "big") * 8,
                    tenant=tenant)


def fill_random(manager: StorageManager, shape=CHUNK_SHAPE, dtype=torch.uint8, seed: int = 0,
                num_tokens: int = 32) -> MemoryObj:
    """A freshly allocated object filled with random bytes (caller owns one reference)."""
    obj = manager.allocate(shape, dtype=dtype, fmt=MemoryFormat.KV_PAGES, num_tokens=num_tokens)
    assert obj is not None, "allocate returned None with plenty of memory free"
    gen = torch.Generator().manual_seed(seed)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def _bytes(obj: MemoryObj) -> torch.Tensor:
    return obj.byte_view.clone()


def implements(backend: object, hook: str) -> bool:
    """Whether ``backend`` has an ``@hookimpl`` for ``hook``."""
    return hasattr(getattr(backend, hook, None), f"{PROJECT}_impl")


def call_hook(backend: object, hook: str, **kwargs: Any) -> Any:
    """Call ``backend``'s ``hook`` directly, as pluggy would (keyword arguments, only those its
    implementation declares), so that an exception surfaces instead of becoming a miss."""
    fn = getattr(backend, hook)
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def tiers_of(mgr: StorageManager) -> list[tuple[str, object]]:
    """``(tier name, backend instance)`` of every tier, fastest first."""
    return [(name, mgr.backend(name)) for name in mgr.tier_names]


def _class_flag(backend: object, flag: str) -> bool:
    return bool(getattr(type(backend), flag, False))


class BackendConformance:
    """The contract of ``kvplug.hookspecs``, checked through a real StorageManager."""

    #: Whether entries survive ``close()`` and a new manager over the same tier config.
    persistent: bool = False
    #: Capacity used by tests that do not exercise eviction.
    roomy: int = 64 << 20

    @pytest.fixture
    def make_tiers(self) -> Callable[[int], list[dict]]:  # pragma: no cover - must be overridden
        raise NotImplementedError("override the make_tiers fixture: capacity -> list of tiers")

    @pytest.fixture
    def corrupt_entry(self) -> Callable[[StorageManager, CacheKey], None] | None:
        return None

    @pytest.fixture
    def manager(self, make_tiers):
        """A roomy manager for a subclass's own tests; its teardown fails on any tier fault or
        timeout, as :meth:`opened` does."""
        with self.opened(make_tiers) as mgr:
            yield mgr

    @contextmanager
    def opened(self, make_tiers, capacity: int | None = None,
               **settings: Any) -> Iterator[StorageManager]:
        """A manager over ``make_tiers(capacity)`` (roomy by default; ``settings``: more of the
        config), closed on exit; a clean exit also asserts that no tier had a fault or a
        timeout, close included."""
        mgr = StorageManager({"tiers": make_tiers(capacity or self.roomy), "chunk_size": 16,
                              **settings})
        try:
            yield mgr
        except BaseException:
            mgr.close()
            raise
        mgr.close()
        self.assert_no_faults(mgr)

    @staticmethod
    def assert_no_faults(mgr: StorageManager) -> None:
        """No tier raised from a hook or missed its ``timeout_s``: the StorageManager counts each
        as a miss (``faults``, ``timeouts`` per tier in ``stats()``), which would hide it."""
        for tier in mgr._tiers:  # the counters themselves: a backend's stats may reuse the names
            assert tier.faults == 0 and tier.timeouts == 0, (
                f"tier {tier.name!r} had {tier.faults} fault(s) and {tier.timeouts} timeout(s): "
                "a hook raised or answered after timeout_s (the log names the first of each "
                "kind); a miss is None / False, never an exception")

    def _put(self, mgr: StorageManager, keys, objs) -> None:
        mgr.batched_put(keys, objs)
        assert mgr.flush(timeout=30), "flush did not drain queued writes within 30 s"

    def _put_until_held(self, mgr: StorageManager, key: CacheKey, tiers: list[str],
                        seed: int) -> None:
        """Store a random chunk under ``key`` until every tier of ``tiers`` holds it: a store
        a tier dropped (a remote store slow to answer on a busy machine fails the put, and its
        breaker drops the next ones) is stored again, for up to :data:`HANG_S`. A test that
        means "this much was stored" then holds on a busy machine too."""
        deadline = time.monotonic() + HANG_S
        while True:
            obj = fill_random(mgr, seed=seed)
            self._put(mgr, [key], [obj])
            obj.ref_down()
            missing = [t for t in tiers
                       if not call_hook(mgr.backend(t), "contains", keys=[key], pin=False)[0]]
            if not missing:
                return
            assert time.monotonic() < deadline, (
                f"tiers {missing} never held a chunk stored again and again for {HANG_S:g}s "
                f"(stats: {mgr.stats()})")
            time.sleep(0.1)  # let a tripped breaker cool down before storing again

    def test_round_trip_random_bytes(self, make_tiers):
        """Random bytes of several shapes/dtypes come back bit-exact with their metadata, from
        the manager and from each tier's own ``get`` (called directly)."""
        with self.opened(make_tiers) as mgr:
            for i, (shape, dtype) in enumerate(SHAPES):
                obj = fill_random(mgr, shape, dtype, seed=i, num_tokens=17 + i)
                expect = _bytes(obj)
                self._put(mgr, [make_key(i)], [obj])
                obj.ref_down()
                got = mgr.get(make_key(i))
                assert got is not None, f"stored chunk {i} was not found"
                assert torch.equal(got.byte_view, expect), f"chunk {i} bytes differ"
                assert tuple(got.tensor.shape) == shape and got.tensor.dtype == dtype
                assert got.num_tokens == 17 + i
                got.ref_down()
                for name, backend in tiers_of(mgr):
                    if not call_hook(backend, "contains", keys=[make_key(i)], pin=False)[0]:
                        continue
                    own = call_hook(backend, "get", key=make_key(i))
                    assert own is not None, f"tier {name!r} contains chunk {i} but get missed"
                    assert torch.equal(own.byte_view, expect), f"tier {name!r}: chunk {i} differs"
                    assert tuple(own.tensor.shape) == shape and own.num_tokens == 17 + i
                    own.ref_down()

    def test_caller_may_reuse_its_buffer_after_put(self, make_tiers):
        """After put+flush, overwriting the caller's buffer does not change what is stored."""
        with self.opened(make_tiers) as mgr:
            obj = fill_random(mgr, seed=7)
            expect = _bytes(obj)
            self._put(mgr, [make_key(1)], [obj])
            if obj.ref_count == 1:  # the tier copied; the caller's buffer is its own
                obj.byte_view.fill_(0xAB)
            obj.ref_down()
            got = mgr.get(make_key(1))
            assert got is not None and torch.equal(got.byte_view, expect)
            got.ref_down()

    def test_missing_key_is_none(self, make_tiers):
        """A key never stored is a miss, not an error: through the manager, and from every hook
        of every tier called directly (``get``, ``batched_get``, ``get_layers`` give ``None``,
        ``contains`` ``False``; ``evict`` and ``unpin`` of it do nothing and do not raise)."""
        missing = make_key(404)
        with self.opened(make_tiers) as mgr:
            obj = fill_random(mgr, seed=4)  # one stored chunk: the tier is not empty
            self._put(mgr, [make_key(4)], [obj])
            obj.ref_down()
            assert mgr.get(missing) is None
            assert mgr.lookup_prefix([missing]).num_chunks == 0
            assert mgr.batched_get([missing, make_key(405)]) == [None, None]
            for name, backend in tiers_of(mgr):
                assert call_hook(backend, "get", key=missing) is None, f"tier {name!r}: get"
                assert call_hook(backend, "contains", keys=[missing], pin=False) == [False], (
                    f"tier {name!r}: contains")
                assert call_hook(backend, "contains", keys=[missing], pin=True) == [False], (
                    f"tier {name!r}: contains(pin=True)")
                if implements(backend, "batched_get"):
                    assert call_hook(backend, "batched_get", keys=[missing]) == [None], (
                        f"tier {name!r}: batched_get")
                if implements(backend, "get_layers"):
                    assert call_hook(backend, "get_layers", key=missing, first_layer=0,
                                     num_layers=1) is None, f"tier {name!r}: get_layers"
                if implements(backend, "unpin"):
                    call_hook(backend, "unpin", keys=[missing])
                assert not call_hook(backend, "evict", keys=[missing], nbytes=0), (
                    f"tier {name!r}: evicting a key it never held freed bytes")
            kept = mgr.get(make_key(4))
            assert kept is not None, "evicting a missing key dropped another entry"
            kept.ref_down()

    def test_keys_never_collide(self, make_tiers):
        """Keys that differ only in model, rank or one hash byte are different entries."""
        with self.opened(make_tiers) as mgr:
            obj = fill_random(mgr, seed=3)
            self._put(mgr, [make_key(5)], [obj])
            obj.ref_down()
            base = make_key(5)
            others = [
                make_key(5, model="other/model"),
                make_key(5, rank=1, ws=2),
                base.with_hash(bytes([base.chunk_hash[0] ^ 1]) + base.chunk_hash[1:]),
            ]
            for other in others:
                assert mgr.get(other) is None, f"{other} wrongly hit {base}"
                for name, backend in tiers_of(mgr):
                    assert call_hook(backend, "contains", keys=[other], pin=False) == [False], (
                        f"tier {name!r}: {other} wrongly contained")
            hit = mgr.get(base)
            assert hit is not None
            hit.ref_down()

    def test_contains_prefix_and_pins(self, make_tiers):
        """contains answers per key; every tier implements ``unpin`` (``contains(pin=True)``
        pins, and only ``unpin`` releases a pin); a pinned entry survives ``evict`` of its key
        until unpinned as often as it was pinned, then goes."""
        with self.opened(make_tiers) as mgr:
            for name, backend in tiers_of(mgr):
                assert implements(backend, "unpin"), (
                    f"tier {name!r} has no unpin hook: contains(pin=True) must pin hits, and a "
                    "pin that nothing releases keeps its entry forever")
            keys = [make_key(i) for i in range(6)]
            objs = [fill_random(mgr, seed=i) for i in range(6)]
            self._put(mgr, keys[:3] + keys[4:], objs[:3] + objs[4:])
            for o in objs:
                o.ref_down()
            look = mgr.lookup_prefix(keys, pin=True)
            assert look.num_chunks == 3, "prefix must stop at the first missing key (index 3)"
            again = mgr.lookup_prefix(keys[:3], pin=True)  # pinned twice: needs two unpins
            assert again.tiers == look.tiers
            mgr.evict(keys[:3])
            assert mgr.lookup_prefix(keys[:3]).num_chunks == 3, "pinned entries were evicted"
            mgr.unpin(keys[:3], look.tiers)
            mgr.evict(keys[:3])
            assert mgr.lookup_prefix(keys[:3]).num_chunks == 3, (
                "an entry pinned twice was evicted after one unpin (pins count)")
            mgr.unpin(keys[:3], again.tiers)
            mgr.evict(keys[:3])
            assert mgr.lookup_prefix(keys[:1]).num_chunks == 0, "unpinned entry survived evict"

    def test_pins_hold_under_pressure(self, make_tiers):
        """A tier making room for new chunks (its capacity, ``evict(nbytes=...)``) never drops
        what ``contains(pin=True)`` pinned; once unpinned, those entries may go like any other."""
        capacity = 8 * CHUNK_BYTES + 4096
        with self.opened(make_tiers, capacity) as mgr:
            keys = [make_key(i) for i in range(40)]
            for i in range(4):
                obj = fill_random(mgr, seed=i)
                self._put(mgr, [keys[i]], [obj])
                obj.ref_down()
            look = mgr.lookup_prefix(keys[:2], pin=True)
            assert look.num_chunks == 2, "two stored chunks were not found"
            where = dict(zip(keys[:2], look.tiers))

            def held() -> list[bool]:
                return [call_hook(mgr.backend(where[k]), "contains", keys=[k], pin=False)[0]
                        for k in keys[:2]]

            for i in range(4, 40):
                obj = fill_random(mgr, seed=i)
                self._put(mgr, [keys[i]], [obj])
                obj.ref_down()
            assert held() == [True, True], (
                f"pinned entries were evicted to make room (held: {held()}, tiers {look.tiers})")
            mgr.evict(nbytes=4 * capacity)
            assert held() == [True, True], "evict(nbytes=...) dropped pinned entries"
            mgr.unpin(keys[:2], look.tiers)
            for i in range(40, 60):  # 2.5x the capacity, each chunk stored for sure
                self._put_until_held(mgr, make_key(i), sorted(set(where.values())), seed=i)
            bounded = [k for k in keys[:2] if not _class_flag(mgr.backend(where[k]), "unbounded")]
            for k in bounded:
                assert not call_hook(mgr.backend(where[k]), "contains", keys=[k], pin=False)[0], (
                    f"tier {where[k]!r} still holds an unpinned old entry after 2.5x its "
                    f"capacity was stored: does unpin release the pin? (stats: {mgr.stats()})")

    def test_capacity_is_respected(self, make_tiers):
        """Storing 4x the capacity keeps each tier's ``stats()["bytes"]`` under its bound (a tier
        without ``bytes`` fails, unless its class declares ``unbounded = True``); the most recent
        chunk is kept and the oldest was evicted."""
        capacity = 8 * CHUNK_BYTES + 4096
        with self.opened(make_tiers, capacity) as mgr:
            for i in range(32):
                obj = fill_random(mgr, seed=i)
                self._put(mgr, [make_key(i)], [obj])
                obj.ref_down()
            stats = mgr.stats()
            bounded = []
            for name, backend in tiers_of(mgr):
                if _class_flag(backend, "unbounded"):
                    continue
                bounded.append((name, backend))
                assert "bytes" in stats[name], (
                    f"tier {name!r} reports no 'bytes' in stats(): report the bytes it holds, or "
                    "set unbounded = True on the class if its store bounds itself "
                    "(kvplug.hookspecs.BackendClass)")
                assert stats[name]["bytes"] <= capacity, (
                    f"tier {name!r} holds {stats[name]['bytes']} > {capacity}")
            last = mgr.get(make_key(31))
            assert last is not None, "the most recent chunk was evicted"
            last.ref_down()
            for name, backend in bounded:
                assert call_hook(backend, "contains", keys=[make_key(0)], pin=False) == [False], (
                    f"tier {name!r} evicted nothing")

    def test_get_layers_gives_each_range(self, make_tiers):
        """Every tier with a ``get_layers`` hook gives layers ``[first, first + n)`` of a chunk
        as their own ``[n, blocks, page_bytes]`` object with the whole chunk's token count, bit
        exact, directly and through the manager; a key it does not hold is ``None``. Needs no
        optional extra (the codec test covers encoded chunks)."""
        with self.opened(make_tiers) as mgr:
            readers = [(n, b) for n, b in tiers_of(mgr) if implements(b, "get_layers")]
            if not readers:
                pytest.skip("no tier implements get_layers (it is optional)")
            shape = (4, 2, 4096)
            obj = fill_random(mgr, shape=shape, seed=44, num_tokens=29)
            want = _bytes(obj).view(shape[0], -1)
            key = make_key(44)
            self._put(mgr, [key], [obj])
            obj.ref_down()
            for name, backend in readers:
                if not call_hook(backend, "contains", keys=[key], pin=False)[0]:
                    continue
                for first, n in ((0, 1), (1, 2), (3, 1), (0, 4)):
                    direct = call_hook(backend, "get_layers", key=key, first_layer=first,
                                       num_layers=n)
                    routed = mgr.get_layers(key, first, n, tier=name)
                    for how, part in (("get_layers", direct), ("manager.get_layers", routed)):
                        assert part is not None, f"tier {name!r}: {how}({first}, {n}) missed"
                        assert tuple(part.tensor.shape) == (n, *shape[1:]), (
                            f"tier {name!r}: {how}({first}, {n}) has shape {part.tensor.shape}")
                        assert part.num_tokens == 29, f"tier {name!r}: {how} lost num_tokens"
                        assert torch.equal(part.byte_view, want[first:first + n].reshape(-1)), (
                            f"tier {name!r}: {how}({first}, {n}) gave other bytes")
                        part.ref_down()
                assert mgr.get_layers(make_key(404), 0, 1, tier=name) is None

    def test_concurrent_puts_and_gets(self, make_tiers):
        """Threads storing and reading distinct chunks never see wrong bytes or errors."""
        errors: list[str] = []
        expect: dict[int, torch.Tensor] = {}
        with self.opened(make_tiers) as manager:

            def worker(t: int) -> None:
                try:
                    for j in range(8):
                        i = t * 100 + j
                        obj = fill_random(manager, seed=i)
                        expect[i] = _bytes(obj)
                        manager.batched_put([make_key(i)], [obj])
                        obj.ref_down()
                        got = manager.get(make_key(i))
                        if got is not None:  # a slow tier may not have it yet: a miss is fine
                            if not torch.equal(got.byte_view, expect[i]):
                                errors.append(f"chunk {i}: wrong bytes")
                            got.ref_down()
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"thread {t}: {exc!r}")

            threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=120)
            assert not errors, errors
            assert manager.flush(timeout=30)
            for i, data in expect.items():
                got = manager.get(make_key(i))
                assert got is not None and torch.equal(got.byte_view, data), f"chunk {i} lost"
                got.ref_down()

    def test_close_drains_writes(self, make_tiers):
        """close() finishes queued writes and drops every reference the tiers took."""
        with self.opened(make_tiers) as mgr:
            objs = [fill_random(mgr, seed=i) for i in range(12)]
            data = [_bytes(o) for o in objs]
            mgr.batched_put([make_key(i) for i in range(12)], objs)
            mgr.close()
            for i, o in enumerate(objs):
                assert o.ref_count == 1, f"a tier still holds chunk {i} after close()"
                o.ref_down()
        if not self.persistent:
            return
        with self.opened(make_tiers) as again:
            for i in range(12):
                got = again.get(make_key(i))
                assert got is not None, f"chunk {i} queued before close() was not written"
                assert torch.equal(got.byte_view, data[i])
                got.ref_down()

    def test_corrupt_entry_is_a_miss(self, make_tiers, corrupt_entry):
        """A damaged entry is never returned (and never raises), by the manager or by any tier's
        ``get`` called directly."""
        with self.opened(make_tiers) as mgr:
            obj = fill_random(mgr, seed=11)
            self._put(mgr, [make_key(9)], [obj])
            obj.ref_down()
            if corrupt_entry is None:
                # Only memory-only tiers may omit it: their bytes never leave this process.
                assert not self.persistent, "a persistent backend must override corrupt_entry"
                return
            corrupt_entry(mgr, make_key(9))
            assert mgr.get(make_key(9)) is None, "a corrupt entry was returned"
            for name, backend in tiers_of(mgr):
                assert call_hook(backend, "get", key=make_key(9)) is None, (
                    f"tier {name!r} returned a corrupt entry")

    def test_batched_get_answers_like_get(self, make_tiers, corrupt_entry):
        """``StorageManager.batched_get`` (the connector's loads; a tier's own ``batched_get``
        hook where it has one, also called directly) gives each key's bytes in order, ``None``
        for a key never stored and for a damaged entry, over more keys than one batched call
        takes; a tier's ``batched_get_nowait`` gives, per key, those bytes or ``None`` (never a
        key not stored, never a damaged entry)."""
        n = 20
        data = {}
        with self.opened(make_tiers) as manager:
            for i in range(n):
                obj = fill_random(manager, seed=100 + i)
                data[i] = _bytes(obj)
                self._put(manager, [make_key(100 + i)], [obj])
                obj.ref_down()
            damaged = None
            if corrupt_entry is not None:
                damaged = 7
                corrupt_entry(manager, make_key(100 + damaged))
            keys = [make_key(100 + i) for i in range(n)]
            keys.insert(3, make_key(404))  # never stored
            got = manager.batched_get(keys)
            assert len(got) == len(keys)
            assert got[3] is None, "a key never stored was returned"
            got = got[:3] + got[4:]
            for i, obj in enumerate(got):
                if i == damaged:
                    assert obj is None, "a corrupt entry was returned by batched_get"
                    continue
                assert obj is not None, f"stored chunk {i} was not found by batched_get"
                assert torch.equal(obj.byte_view, data[i]), f"batched_get gave chunk {i} other bytes"
                obj.ref_down()
            for name, backend in tiers_of(manager):
                if not implements(backend, "batched_get"):
                    continue
                own = call_hook(backend, "batched_get", keys=keys[:6])
                assert isinstance(own, list) and len(own) == 6, (
                    f"tier {name!r}: batched_get of 6 keys gave {type(own).__name__} "
                    f"{len(own) if isinstance(own, list) else ''}")
                assert own[3] is None, f"tier {name!r}: batched_get returned a key never stored"
                for i, obj in zip([0, 1, 2, None, 3, 4], own):
                    if i is None or obj is None:  # a lower tier may lack a chunk L1 holds
                        continue
                    assert torch.equal(obj.byte_view, data[i]), (
                        f"tier {name!r}: batched_get gave chunk {i} other bytes")
                    obj.ref_down()
            for name, backend in tiers_of(manager):
                if not implements(backend, "batched_get_nowait"):
                    continue
                own = call_hook(backend, "batched_get_nowait", keys=keys)
                assert isinstance(own, list) and len(own) == len(keys), (
                    f"tier {name!r}: batched_get_nowait of {len(keys)} keys gave "
                    f"{type(own).__name__} {len(own) if isinstance(own, list) else ''}")
                assert own[3] is None, (
                    f"tier {name!r}: batched_get_nowait returned a key never stored")
                for i, obj in zip([*range(3), None, *range(3, n)], own):
                    if i is None or obj is None:  # not served without waiting: allowed
                        continue
                    assert i != damaged, f"tier {name!r}: batched_get_nowait gave a corrupt entry"
                    assert torch.equal(obj.byte_view, data[i]), (
                        f"tier {name!r}: batched_get_nowait gave chunk {i} other bytes")
                    obj.ref_down()

    def test_encoded_chunks_round_trip_through_a_codec(self, make_tiers):
        """With ``codec:`` on the tier, the backend stores ``ENCODED`` objects and gives back
        their shape, dtype and format (whole and by layer), so the codec wrapper decodes them
        to the original bytes (needs python-blosc2 for the ``lossless`` codec; skipped without)."""
        pytest.importorskip("blosc2")
        from kvplug.plugins import load_backend_class

        tiers = [dict(t) for t in make_tiers(self.roomy)]
        coded = []
        for t in tiers:
            if not getattr(load_backend_class(t["backend"])[0], "never_blocks", False):
                t["codec"] = "lossless"
                coded.append(t.get("name") or t["backend"])
        if not coded:
            pytest.skip("every tier never blocks: codecs apply to tiers that may block")
        with self.opened(lambda capacity: tiers) as mgr:
            for j, name in enumerate(coded):
                key = make_key(31 + j)
                obj = fill_random(mgr, shape=(3, 2, 4096), seed=21 + j)
                want = _bytes(obj)
                self._put(mgr, [key], [obj])
                obj.ref_down()
                assert mgr.stats()[name]["codec_encoded"] == j + 1
                mgr.evict([key], tiers=[n for n in mgr.tier_names if n != name])
                got = mgr.get(key, promote=False)
                assert got is not None, f"tier {name!r} lost an encoded chunk"
                assert got.meta.fmt is MemoryFormat.KV_PAGES and got.meta.shape == (3, 2, 4096), (
                    f"tier {name!r} gave back {got.meta}: keep the ENCODED object's meta")
                assert torch.equal(got.byte_view, want)
                got.ref_down()
                mgr.evict([key], tiers=[n for n in mgr.tier_names if n != name])
                both = mgr.batched_get([key, make_key(404)])
                assert both[1] is None and both[0] is not None and torch.equal(
                    both[0].byte_view, want), f"tier {name!r}: batched_get of an encoded chunk"
                both[0].ref_down()
                if mgr.reads_layers(name):
                    part = mgr.get_layers(key, 1, 1, tier=name)
                    assert part is not None and torch.equal(part.byte_view, want[8192:16384])
                    part.ref_down()

    def test_encrypted_at_rest(self, make_tiers, monkeypatch):
        """With ``encrypt: true`` (a fresh secret in the environment), each tier that may block
        and sets ``encrypts`` gives back random bytes exactly, with their meta, from its own
        ``get`` and ``get_layers`` (the chunk library decrypts what it stored); a tier that may
        block without ``encrypts`` is refused at startup, naming it (its store would hold
        plaintext). ``never_blocks`` tiers (process memory, like L1) keep plaintext."""
        from kvplug.errors import ConfigError
        from kvplug.plugins import load_backend_class

        monkeypatch.setenv(_SECRET_ENV, os.urandom(32).hex())
        settings = {"auth_key_env": _SECRET_ENV, "encrypt": True}
        tiers = make_tiers(self.roomy)
        classes = [load_backend_class(t["backend"])[0] for t in tiers]
        if any(not getattr(c, "never_blocks", False) and not getattr(c, "encrypts", False)
               for c in classes):
            with pytest.raises(ConfigError, match="does not say it encrypts"):
                StorageManager({"tiers": tiers, "chunk_size": 16, **settings})
            return
        try:  # a tier that cannot keep the bytes encrypted where it runs refuses, naming it
            StorageManager({"tiers": tiers, "chunk_size": 16, **settings}).close()
        except ConfigError as exc:  # (gds through kvikio: the CPU never sees the bytes)
            assert "encrypt" in str(exc), exc
            return
        with self.opened(make_tiers, **settings) as mgr:
            shape, key = (3, 2, 4096), make_key(47)
            obj = fill_random(mgr, shape=shape, seed=47, num_tokens=21)
            want = _bytes(obj)
            self._put(mgr, [key], [obj])
            obj.ref_down()
            for name, backend in tiers_of(mgr):
                if not call_hook(backend, "contains", keys=[key], pin=False)[0]:
                    continue
                own = call_hook(backend, "get", key=key)
                assert own is not None, f"tier {name!r} lost an encrypted chunk"
                assert torch.equal(own.byte_view, want), f"tier {name!r}: other bytes"
                assert tuple(own.tensor.shape) == shape and own.num_tokens == 21
                own.ref_down()
                if implements(backend, "get_layers"):
                    part = call_hook(backend, "get_layers", key=key, first_layer=1, num_layers=2)
                    assert part is not None and torch.equal(part.byte_view, want[8192:]), (
                        f"tier {name!r}: get_layers of an encrypted chunk")
                    part.ref_down()
