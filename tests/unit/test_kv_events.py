"""KV events without an engine: a real StorageManager (local_cpu + posix on a temp dir) watched by
TierWatch, and the scheduler's TierEventBook turning worker news into vLLM's event classes for real
vLLM ``Request`` objects (block hashes from vLLM's own block hasher)."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm")

from kvplug.connector.protocol.metadata import KVPlugKVEvents, TierEvent  # noqa: E402
from kvplug.connector.scheduler.events import TierEventBook  # noqa: E402
from kvplug.connector.worker.tier_watch import TierWatch  # noqa: E402
from kvplug.keys import CacheKey  # noqa: E402
from kvplug.storage_manager import StorageManager  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

CHUNK_BYTES = 64 * 1024
BS, CS = 16, 64  # 4 vLLM blocks per kvplug chunk


def _key(i: int) -> CacheKey:
    return CacheKey("m", "uint8", "t", 1, 0, random.Random(i).randbytes(32))


def _storage(tmp_path, l1_chunks: int) -> StorageManager:
    return StorageManager({"chunk_size": 256, "tiers": [
        {"name": "ram", "backend": "local_cpu",
         "options": {"capacity": l1_chunks * CHUNK_BYTES + 1024}},
        {"name": "disk", "backend": "posix",
         "options": {"path": str(tmp_path / "chunks"), "capacity": "64MiB"}}]})


def _put(sm: StorageManager, keys: list[CacheKey]) -> None:
    objs = []
    for k in keys:
        obj = sm.allocate((CHUNK_BYTES,), num_tokens=256)
        assert obj is not None
        obj.tensor.copy_(obj.tensor.new_tensor(list(k.chunk_hash) * (CHUNK_BYTES // 32)))
        objs.append(obj)
    sm.batched_put(keys, objs)
    for o in objs:
        o.ref_down()


def _drain(watch: TierWatch, want: int, rounds: int | None = None) -> list[TierEvent]:
    """Run rounds until ``want`` events came (the deadline only guards a hang), or exactly
    ``rounds`` rounds (a control that expects nothing)."""
    got: list[TierEvent] = []
    deadline = time.monotonic() + 60
    while (len(got) < want if rounds is None else rounds > 0) and time.monotonic() < deadline:
        rounds = None if rounds is None else rounds - 1
        watch.check()
        news = watch.take()
        if news is not None:
            got.extend(news.get_all_events())
        time.sleep(0.05)
    return got


def test_watch_reports_stores_evictions_and_promotions(tmp_path):
    sm = _storage(tmp_path, l1_chunks=2)
    watch = TierWatch(sm, interval_s=3600)  # rounds driven by the test
    try:
        a, b, c = _key(1), _key(2), _key(3)
        _put(sm, [a, b])
        sm.flush()
        got = _drain(watch, 4)
        assert sorted((e.stored, e.tier, e.chunk_hash) for e in got) == sorted(
            (True, t, k.chunk_hash) for t in ("ram", "disk") for k in (a, b))
        # a third chunk pushes the least recently used one (a) out of the two-chunk RAM tier
        _put(sm, [c])
        sm.flush()
        got = _drain(watch, 3)
        assert TierEvent(False, "ram", a.chunk_hash) in got
        assert {e for e in got if e.stored} == {TierEvent(True, "ram", c.chunk_hash),
                                                TierEvent(True, "disk", c.chunk_hash)}
        assert not [e for e in got if e.tier == "disk" and not e.stored]
        assert sm.holds("disk", [a]) == [True] and sm.holds("ram", [a]) == [False]
        # reading a from disk promotes it into RAM (evicting b): both are reported
        obj = sm.get(a)
        assert obj is not None
        obj.ref_down()
        got = _drain(watch, 2)
        assert set(got) == {TierEvent(True, "ram", a.chunk_hash),
                            TierEvent(False, "ram", b.chunk_hash)}
        # nothing changed: nothing to report (a control for the rounds above)
        assert _drain(watch, 1, rounds=5) == []
    finally:
        watch.close()
        sm.close()


def test_holds_answers_per_tier_and_names_an_unknown_tier(tmp_path):
    from kvplug.errors import ConfigError

    sm = _storage(tmp_path, l1_chunks=2)
    try:
        a, b = _key(1), _key(2)
        _put(sm, [a])
        sm.flush()
        assert sm.holds("ram", [a, b]) == [True, False]
        assert sm.holds("disk", [b, a]) == [False, True]
        assert sm.holds("disk", []) == []
        with pytest.raises(ConfigError, match="'tape'.*ram"):
            sm.holds("tape", [a])
    finally:
        sm.close()


def test_watch_forgets_past_its_bound_and_announces_it(tmp_path):
    sm = _storage(tmp_path, l1_chunks=8)
    watch = TierWatch(sm, max_chunks=2, interval_s=3600)
    try:
        keys = [_key(i) for i in range(3)]
        _put(sm, keys)
        sm.flush()
        got = _drain(watch, 8)  # 3 stored per tier, and the oldest forgotten in each
        for tier in ("ram", "disk"):
            mine = [e for e in got if e.tier == tier]
            assert [e.stored for e in mine].count(True) == 3
            assert [e for e in mine if not e.stored] == [TierEvent(False, tier,
                                                                   keys[0].chunk_hash)]
    finally:
        watch.close()
        sm.close()


def test_watch_rounds_never_overlap(tmp_path):
    """A caller's check() and the watch's own thread (woken by every put) never run rounds side
    by side: both would confirm the same pending chunks, and the second would announce the chunk
    the first had just forgotten past ``max_chunks`` as stored again (``[T, T, T, F, T, F]``). Here
    a second round is started while the first is inside its tier lookup."""
    import threading

    sm = StorageManager({"chunk_size": 256, "tiers": [
        {"name": "ram", "backend": "local_cpu", "options": {"capacity": 8 * CHUNK_BYTES}}]})
    watch = TierWatch(sm, max_chunks=2, interval_s=3600)
    real_holds, second = sm.holds, []

    def holds(tier, keys):
        if not second:  # the first lookup: let another round try to run meanwhile
            second.append(threading.Thread(target=watch.check))
            second[0].start()
            second[0].join(timeout=1)  # it must wait for this round (a bound, not a check)
        return real_holds(tier, keys)

    try:
        keys = [_key(i) for i in range(3)]
        _put(sm, keys)
        sm.holds = holds
        watch.check()
        second[0].join(timeout=60)
        got = (watch.take() or KVPlugKVEvents()).get_all_events()
        assert [e.stored for e in got] == [True, True, True, False]
        assert got[3] == TierEvent(False, "ram", keys[0].chunk_hash)
    finally:
        watch.close()
        sm.close()


def test_watch_refused_store_is_never_announced(tmp_path):
    sm = StorageManager({"chunk_size": 256, "tiers": [
        {"name": "ram", "backend": "local_cpu", "options": {"capacity": CHUNK_BYTES + 1024}}]})
    watch = TierWatch(sm, interval_s=3600)
    try:
        from kvplug.memory import heap_memory_obj

        # a chunk larger than the tier is refused by the tier itself: never announced
        huge = heap_memory_obj((2 * CHUNK_BYTES,), num_tokens=256)
        sm.batched_put([_key(8)], [huge])
        assert _drain(watch, 1, rounds=3) == []
        k1 = _key(7)
        obj = sm.allocate((CHUNK_BYTES,), num_tokens=256)
        assert obj is not None
        sm.batched_put([k1], [obj])
        obj.ref_down()
        got = _drain(watch, 1)
        assert got == [TierEvent(True, "ram", k1.chunk_hash)]
        assert _drain(watch, 1, rounds=5) == []
    finally:
        watch.close()
        sm.close()


# -- the scheduler's book ------------------------------------------------------------------------
def _request(req_id: str, tokens: list[int]):
    from kvplug.tokens import sha256_cbor
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BS, sha256_cbor))


def _decode(events):
    """Through vLLM's own wire format, as a subscriber sees it."""
    import msgspec

    raw = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    return msgspec.msgpack.decode(raw, type=KVEventBatch).events


def test_book_maps_chunks_to_vllm_blocks_across_ranks_and_overlaps():
    rng = random.Random(5)
    tokens = [rng.randrange(3, 30000) for _ in range(2 * CS + 40)]
    req = _request("r", tokens)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # vLLM's own block hashes, as vLLM's own events carry them: the independent reference
    h = [maybe_convert_block_hash(x) for x in req.block_hashes]
    assert len(h) == len(tokens) // BS
    book = TierEventBook(BS, CS, num_workers=2)
    c0, c1, part = b"c0" * 16, b"c1" * 16, b"p1" * 16
    book.record(req, 0, 2 * CS, [c0, c1])
    book.record(req, CS, CS + 2 * BS, [part])  # a partial chunk: the first 2 blocks of chunk 1
    # rank 0 alone is not enough: a hit needs every rank
    book.add(KVPlugKVEvents([TierEvent(True, "ram", c0), TierEvent(True, "ram", part)]))
    assert book.take() == []
    book.add(KVPlugKVEvents([TierEvent(True, "ram", c0), TierEvent(True, "ram", part)]))
    ev = _decode(book.take())
    assert [type(e) for e in ev] == [BlockStored, BlockStored]
    assert ev[0].block_hashes == h[0:4] and ev[0].parent_block_hash is None
    assert ev[0].token_ids == tokens[0:CS] and ev[0].block_size == BS and ev[0].medium == "ram"
    assert ev[1].block_hashes == h[4:6] and ev[1].parent_block_hash == h[3]
    # the full chunk 1 over the partial one: only its 2 new blocks, parent = the last one held
    book.add(KVPlugKVEvents([TierEvent(True, "ram", c1)] * 2))
    (e,) = _decode(book.take())
    assert e.block_hashes == h[6:8] and e.parent_block_hash == h[5]
    assert e.token_ids == tokens[6 * BS:8 * BS]
    # one rank loses the partial chunk: the full chunk still covers its blocks; nothing is removed
    book.add(KVPlugKVEvents([TierEvent(False, "ram", part)]))
    assert book.take() == []
    # one rank loses chunk 1: every block of it is gone now (the partial one was withdrawn)
    book.add(KVPlugKVEvents([TierEvent(False, "ram", c1)]))
    (e,) = _decode(book.take())
    assert isinstance(e, BlockRemoved) and e.block_hashes == h[4:8] and e.medium == "ram"
    # the other rank's removal repeats nothing; a chunk nobody named is dropped and counted
    book.add(KVPlugKVEvents([TierEvent(False, "ram", c1), TierEvent(True, "disk", b"x" * 32),
                             TierEvent(True, "disk", b"x" * 32)]))
    assert book.take() == [] and book.unnamed == 1
    # the same chunk in another tier is announced there, with the tier as the medium
    book.add(KVPlugKVEvents([TierEvent(True, "disk", c0)] * 2))
    (e,) = _decode(book.take())
    assert e.medium == "disk" and e.block_hashes == h[0:4]


def test_book_ignores_other_connectors_events():
    book = TierEventBook(BS, CS, num_workers=1)
    book.add(None)
    book.add(object())
    assert book.take() == []


class LookupDownTier:
    """Takes chunks but its lookups fail (a remote store whose HEAD requests error out)."""

    def __init__(self, ctx) -> None:
        self.keys: set = set()
        self.asked = 0

    from kvplug.hookspecs import hookimpl as _hookimpl

    @_hookimpl
    def batched_submit_put(self, keys, objs):
        self.keys.update(keys)

    @_hookimpl
    def contains(self, keys):
        self.asked += 1
        raise OSError("lookups are down")

    @_hookimpl
    def get(self, key):
        return None

    @_hookimpl
    def evict(self, keys, nbytes):
        return 0


def test_watch_backs_off_a_tier_that_does_not_answer(tmp_path):
    sm = StorageManager({"chunk_size": 256, "tiers": [
        {"name": "ram", "backend": "local_cpu", "options": {"capacity": "1MiB"}},
        {"name": "far", "backend": "tests.unit.test_kv_events:LookupDownTier", "timeout_s": 5}]})
    watch = TierWatch(sm, interval_s=3600)
    try:
        k = _key(3)
        _put(sm, [k])
        got = _drain(watch, 1)
        asked = sm.backend("far").asked
        assert asked >= 1
        for _ in range(20):
            watch.check()
            got.extend((watch.take() or KVPlugKVEvents()).get_all_events())
        assert got == [TierEvent(True, "ram", k.chunk_hash)]  # nothing about the silent tier
        # not asked every round: the next try waits (at least the interval, doubling, <= 30 s)
        assert sm.backend("far").asked == asked
    finally:
        watch.close()
        sm.close()


def test_watch_reports_only_the_current_weights_epoch(tmp_path):
    """After ``reset_cache`` (a new weights epoch) a save queued under the old epoch may still
    land. Its key has the chunk hash of the new epoch's key for the same tokens, and the
    scheduler's book counts the ranks holding a chunk by that hash: news about it counted this
    rank twice (old and new key) and announced a block other ranks did not hold, a router's
    miss (simulation seed 149, I11). The watch reports the current epoch's keys only."""
    import uuid

    import torch
    from kvplug.connector.protocol.config import ConnectorConfig
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.protocol.metadata import KVPlugMetadata
    from kvplug.connector.worker.side import WorkerSide
    from kvplug.connector.worker.tier_watch import watch_tiers

    from tests.support.gpu_kv_fixture import KVFixture

    cfg = ConnectorConfig(chunk_size=256, log_every_load=False, tiers=[
        {"name": "ram", "backend": "local_cpu", "options": {"capacity": "4MiB"}}])
    w = WorkerSide(cfg, Identity("m", "LBHNC-bs16", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(KVFixture("LBHNC", torch.bfloat16, L=2, B=32).caches)
    watch = watch_tiers(w, 16)
    try:
        chunk = random.Random(7).randbytes(32)
        old = w.key(chunk)
        w.sync_epoch(KVPlugMetadata(256, 16, epoch="e1"))  # the weights changed
        new = w.key(chunk)
        assert new.chunk_hash == old.chunk_hash and new != old
        _put(w.storage, [old])  # a save of the old weights lands after the reset
        assert _drain(watch, 1, rounds=5) == []
        _put(w.storage, [new])
        assert _drain(watch, 1) == [TierEvent(True, "ram", chunk, "e1")]  # stamped with it
    finally:
        watch.close()
        w.close()


def test_book_drops_news_about_keys_of_the_weights_before_a_reset(tmp_path):
    """Asynchronous scheduling hands vLLM a step's output after the next step ran, so a rank's
    news taken before ``reset_cache`` can reach the scheduler's book after the book started
    over. Counted there, rank 0's news about its old key and then about its new key (the same
    chunk hash) stood for two ranks: the chunk was announced while rank 1 held nothing, a
    router's miss on every request it sent there (simulation seed 132014314, I11). News names
    its weights epoch; the book counts its own epoch's only."""
    import uuid

    import torch
    from kvplug.connector.connector import KVPlugConnector
    from kvplug.connector.protocol.config import ConnectorConfig, load_connector_config
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.protocol.lookup import LookupClient
    from kvplug.connector.protocol.metadata import KVPlugMetadata
    from kvplug.connector.scheduler.side import SchedulerSide
    from kvplug.connector.worker.side import WorkerSide
    from kvplug.connector.worker.tier_watch import watch_tiers
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.outputs import KVConnectorOutput

    from tests.support.gpu_kv_fixture import KVFixture

    cfg = ConnectorConfig(chunk_size=256, log_every_load=False, tiers=[
        {"name": "ram", "backend": "local_cpu", "options": {"capacity": "4MiB"}}])
    engine = f"t-{uuid.uuid4().hex[:8]}"
    workers, watches = [], []
    for rank in range(2):
        w = WorkerSide(cfg, Identity("m", "LBHNC-bs16", 2, rank, engine))
        w.register_kv_caches(KVFixture("LBHNC", torch.bfloat16, L=2, B=32).caches)
        workers.append(w)
        watches.append(watch_tiers(w, 16))
    # the connector's scheduler half (role SCHEDULER, as KVPlugConnector.__init__ builds it)
    conn = object.__new__(KVPlugConnector)
    conn._role = KVConnectorRole.SCHEDULER
    lookup = LookupClient([tmp_path / f"lookup-{rank}" for rank in range(2)], 1.0)  # no answers
    conn._sched = SchedulerSide(load_connector_config({"chunk_size": CS}), BS, "kv_both", lookup)
    conn._book = TierEventBook(BS, CS, num_workers=2)
    conn._worker = conn._watch = None

    def step_output(events: list[TierEvent]) -> None:
        conn.update_connector_output(KVConnectorOutput(kv_cache_events=KVPlugKVEvents(events)))

    try:
        rng = random.Random(11)
        req = _request("r", [rng.randrange(3, 30000) for _ in range(CS)])
        chunk = rng.randbytes(32)
        conn._book.record(req, 0, CS, [chunk])
        _put(workers[0].storage, [workers[0].key(chunk)])  # stored under the weights on disk
        late = _drain(watches[0], 1)  # taken with step N's output...
        assert [e.stored for e in late] == [True]
        conn.reset_cache()  # ...the weights change before the scheduler sees it
        metadata = KVPlugMetadata(256, 16, epoch=conn._sched.epoch)
        for w in workers:
            w.sync_epoch(metadata)  # step N+1's metadata: every rank on the new epoch
        step_output(late)
        # the scheduler plans the chunk's save again under the new weights: rank 0 stores it,
        # rank 1 does not (its tier is down)
        conn._book.record(req, 0, CS, [chunk])
        _put(workers[0].storage, [workers[0].key(chunk)])
        step_output(_drain(watches[0], 1))
        assert list(conn.take_events()) == [], "announced while rank 1 holds nothing"
        assert conn._book.stale == 1
        # control: once rank 1 holds it too, the chunk's blocks are announced, once
        _put(workers[1].storage, [workers[1].key(chunk)])
        step_output(_drain(watches[1], 1))
        (ev,) = _decode(list(conn.take_events()))
        assert isinstance(ev, BlockStored) and ev.medium == "ram"
        assert ev.block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes]
    finally:
        lookup.close()
        for watch, w in zip(watches, workers, strict=True):
            watch.close()
            w.close()


class AskedTier(LookupDownTier):
    """Holds what it is handed; ``during_contains`` runs inside its next lookup (another thread
    acting while the watch's thread waits for the tier's answer)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.during_contains = None

    from kvplug.hookspecs import hookimpl as _hookimpl

    @_hookimpl
    def contains(self, keys):
        act, self.during_contains = self.during_contains, None
        if act is not None:
            act()
        return [k in self.keys for k in keys]


def test_watch_round_that_straddles_a_new_epoch_reports_nothing(tmp_path):
    """The engine thread switches epochs (``sync_epoch`` -> ``forget``) while the watch's own
    thread waits for a tier's answer about old-epoch keys: that round's news would land after
    the forget, about keys it had just dropped (and stamped with the new epoch, counted by the
    book). It is dropped; a later store under the new epoch is reported as usual."""
    sm = StorageManager({"chunk_size": 256, "tiers": [
        {"name": "ram", "backend": "local_cpu", "options": {"capacity": "1MiB"}},
        {"name": "far", "backend": "tests.unit.test_kv_events:AskedTier", "timeout_s": 5}]})
    watch = TierWatch(sm, interval_s=3600)  # rounds driven here
    try:
        old, new = _key(21), _key(22)
        _put(sm, [old])
        sm.backend("far").during_contains = lambda: watch.forget("e1")
        assert _drain(watch, 1, rounds=3) == []
        _put(sm, [new])  # control: the new epoch's store is news
        got = _drain(watch, 2)
        assert sorted(got) == sorted([TierEvent(True, "ram", new.chunk_hash, "e1"),
                                      TierEvent(True, "far", new.chunk_hash, "e1")])
    finally:
        watch.close()
        sm.close()
