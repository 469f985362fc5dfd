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
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.storage_manager import StorageManager

SHAPES = [((2, 1, 4096), torch.uint8), ((4, 2, 8192), torch.uint8), ((3, 1, 1024), torch.int32)]
CHUNK_SHAPE = (2, 2, 4096)  # 16 KiB per chunk
CHUNK_BYTES = 2 * 2 * 4096


def make_key(i: int, *, model: str = "conformance/model", rank: int = 0, ws: int = 1) -> CacheKey:
    """A deterministic key for chunk ``i``."""
    return CacheKey(model, "bfloat16", "LBHNC-bs16", ws, rank, i.to_bytes(4, "big") * 8)


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
        mgr = StorageManager({"tiers": make_tiers(self.roomy), "chunk_size": 16})
        yield mgr
        mgr.close()

    def _put(self, mgr: StorageManager, keys, objs) -> None:
        mgr.batched_put(keys, objs)
        assert mgr.flush(timeout=30), "flush did not drain queued writes within 30 s"

    def test_round_trip_random_bytes(self, manager):
        """Random bytes of several shapes/dtypes come back bit-exact with their metadata."""
        for i, (shape, dtype) in enumerate(SHAPES):
            obj = fill_random(manager, shape, dtype, seed=i, num_tokens=17 + i)
            expect = _bytes(obj)
            self._put(manager, [make_key(i)], [obj])
            obj.ref_down()
            got = manager.get(make_key(i))
            assert got is not None, f"stored chunk {i} was not found"
            assert torch.equal(got.byte_view, expect), f"chunk {i} bytes differ"
            assert tuple(got.tensor.shape) == shape and got.tensor.dtype == dtype
            assert got.num_tokens == 17 + i
            got.ref_down()

    def test_caller_may_reuse_its_buffer_after_put(self, manager):
        """After put+flush, overwriting the caller's buffer does not change what is stored."""
        obj = fill_random(manager, seed=7)
        expect = _bytes(obj)
        self._put(manager, [make_key(1)], [obj])
        if obj.ref_count == 1:  # the tier copied; the caller's buffer is its own
            obj.byte_view.fill_(0xAB)
        obj.ref_down()
        got = manager.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, expect)
        got.ref_down()

    def test_missing_key_is_none(self, manager):
        """A key never stored is a miss (None), not an error."""
        assert manager.get(make_key(404)) is None
        assert manager.lookup_prefix([make_key(404)]).num_chunks == 0

    def test_keys_never_collide(self, manager):
        """Keys that differ only in model, rank or one hash byte are different entries."""
        obj = fill_random(manager, seed=3)
        self._put(manager, [make_key(5)], [obj])
        obj.ref_down()
        base = make_key(5)
        others = [
            make_key(5, model="other/model"),
            make_key(5, rank=1, ws=2),
            base.with_hash(bytes([base.chunk_hash[0] ^ 1]) + base.chunk_hash[1:]),
        ]
        for other in others:
            assert manager.get(other) is None, f"{other} wrongly hit {base}"
        hit = manager.get(base)
        assert hit is not None
        hit.ref_down()

    def test_contains_prefix_and_pins(self, make_tiers):
        """contains answers per key; a pinned entry survives eviction until unpinned."""
        mgr = StorageManager({"tiers": make_tiers(self.roomy), "chunk_size": 16})
        try:
            keys = [make_key(i) for i in range(6)]
            objs = [fill_random(mgr, seed=i) for i in range(6)]
            self._put(mgr, keys[:3] + keys[4:], objs[:3] + objs[4:])
            for o in objs:
                o.ref_down()
            look = mgr.lookup_prefix(keys, pin=True)
            assert look.num_chunks == 3, "prefix must stop at the first missing key (index 3)"
            mgr.evict(keys[:3])
            assert mgr.lookup_prefix(keys[:3]).num_chunks == 3, "pinned entries were evicted"
            mgr.unpin(keys[:3], look.tiers)
            mgr.evict(keys[:3])
            assert mgr.lookup_prefix(keys[:1]).num_chunks == 0, "unpinned entry survived evict"
        finally:
            mgr.close()

    def test_capacity_is_respected(self, make_tiers):
        """Storing 4x the capacity keeps each tier's bytes under its bound; recent chunks stay."""
        capacity = 8 * CHUNK_BYTES + 4096
        mgr = StorageManager({"tiers": make_tiers(capacity), "chunk_size": 16})
        try:
            for i in range(32):
                obj = fill_random(mgr, seed=i)
                self._put(mgr, [make_key(i)], [obj])
                obj.ref_down()
            for name, st in mgr.stats().items():
                if "bytes" in st:
                    assert st["bytes"] <= capacity, f"tier {name} holds {st['bytes']} > {capacity}"
            last = mgr.get(make_key(31))
            assert last is not None, "the most recent chunk was evicted"
            last.ref_down()
            assert mgr.lookup_prefix([make_key(0)]).num_chunks == 0, "nothing was evicted"
        finally:
            mgr.close()

    def test_concurrent_puts_and_gets(self, manager):
        """Threads storing and reading distinct chunks never see wrong bytes or errors."""
        errors: list[str] = []
        expect: dict[int, torch.Tensor] = {}

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
        mgr = StorageManager({"tiers": make_tiers(self.roomy), "chunk_size": 16})
        objs = [fill_random(mgr, seed=i) for i in range(12)]
        data = [_bytes(o) for o in objs]
        mgr.batched_put([make_key(i) for i in range(12)], objs)
        mgr.close()
        for i, o in enumerate(objs):
            assert o.ref_count == 1, f"a tier still holds chunk {i} after close()"
            o.ref_down()
        if not self.persistent:
            return
        again = StorageManager({"tiers": make_tiers(self.roomy), "chunk_size": 16})
        try:
            for i in range(12):
                got = again.get(make_key(i))
                assert got is not None, f"chunk {i} queued before close() was not written"
                assert torch.equal(got.byte_view, data[i])
                got.ref_down()
        finally:
            again.close()

    def test_corrupt_entry_is_a_miss(self, manager, corrupt_entry):
        """A damaged entry is never returned (and never raises)."""
        obj = fill_random(manager, seed=11)
        self._put(manager, [make_key(9)], [obj])
        obj.ref_down()
        if corrupt_entry is None:
            # Only memory-only tiers may omit it: their bytes never leave this process.
            assert not self.persistent, "a persistent backend must override corrupt_entry"
            return
        corrupt_entry(manager, make_key(9))
        assert manager.get(make_key(9)) is None, "a corrupt entry was returned"

    def test_batched_get_answers_like_get(self, manager, corrupt_entry):
        """``StorageManager.batched_get`` (the connector's loads; a tier's own ``batched_get``
        hook where it has one) gives each key's bytes in order, ``None`` for a key never stored
        and for a damaged entry, over more keys than one batched call takes."""
        n = 20
        data = {}
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
        mgr = StorageManager({"tiers": tiers, "chunk_size": 16})
        try:
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
        finally:
            mgr.close()
