"""StorageManager across tiers: write-through, promotion, prefix lookup, faults, wrappers."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from kvplug.errors import ConfigError
from kvplug.hookspecs import hookimpl
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

from tests.support.tiers_for_tests import DictTier

L1 = {"backend": "local_cpu", "name": "l1", "options": {"capacity": "4MiB"}}


def two_tiers(lower: str = "DictTier", **opts):
    tier = {"backend": f"tests.support.tiers_for_tests:{lower}", "name": "lower", "options": opts}
    if "timeout_s" in opts:
        tier["timeout_s"] = opts.pop("timeout_s")
    return StorageManager({"tiers": [L1, tier]})


def test_write_through_and_promotion_into_l1():
    with two_tiers() as mgr:
        obj = fill_random(mgr, seed=1)
        expect = obj.byte_view.clone()
        mgr.batched_put([make_key(1)], [obj])
        obj.ref_down()
        assert mgr.stats()["lower"]["entries"] == 1, "write-through did not reach the lower tier"
        mgr.evict([make_key(1)])  # gone from L1 (and from the dict tier too)...
        assert mgr.get(make_key(1)) is None
        obj = fill_random(mgr, seed=1)
        mgr.batched_put([make_key(1)], [obj])
        obj.ref_down()
        mgr.evict([make_key(1)], tiers=["l1"])  # ...now only from L1
        assert mgr.lookup_prefix([make_key(1)]).tiers == ["lower"]
        got = mgr.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, expect)
        got.ref_down()
        assert mgr.lookup_prefix([make_key(1)]).tiers == ["l1"], "lower-tier hit not promoted"
        assert mgr.stats()["lower"]["hits"] == 1


def test_prefix_spans_tiers_and_stops_at_first_gap():
    with two_tiers() as mgr:
        keys = [make_key(i) for i in range(4)]
        for i in (0, 1, 3):
            obj = fill_random(mgr, seed=i)
            mgr.batched_put([keys[i]], [obj])
            obj.ref_down()
        mgr.evict([keys[1]], tiers=["l1"])
        look = mgr.lookup_prefix(keys, pin=True)
        assert look.num_chunks == 2 and look.tiers == ["l1", "lower"]
        # the pin on key 3 (beyond the gap) was released at once; keys 0 stays pinned in L1
        assert mgr.stats()["l1"]["pinned"] == 1
        mgr.unpin(keys[:2], look.tiers)
        assert mgr.stats()["l1"]["pinned"] == 0


def test_raising_tier_is_a_counted_miss_logged_once(caplog):
    with two_tiers("RaisingTier") as mgr, caplog.at_level(logging.WARNING, "kvplug.storage"):
        for i in range(3):
            obj = fill_random(mgr, seed=i)
            mgr.batched_put([make_key(i)], [obj])
            obj.ref_down()
        hit = mgr.get(make_key(0))  # L1 still serves
        assert hit is not None
        hit.ref_down()
        assert mgr.get(make_key(99)) is None
        assert mgr.lookup_prefix([make_key(0), make_key(50)]).num_chunks == 1
        assert mgr.stats()["lower"]["faults"] >= 5
        msgs = [r.message for r in caplog.records if "batched_submit_put" in r.message]
        assert len(msgs) == 1 and "disk went away" in msgs[0]


def test_stalling_tier_times_out_instead_of_hanging():
    with two_tiers("StallingTier", stall_s=120, timeout_s=0.2) as mgr:
        tier = mgr.backend("lower")
        try:
            assert mgr.get(make_key(7)) is None
            assert mgr.lookup_prefix([make_key(7)]).num_chunks == 0
            # both calls came back while the tier was still stalled (no call has left it yet)
            assert tier.left == 0, "a stalled tier blocked the caller"
            assert mgr.stats()["lower"]["timeouts"] == 2
        finally:
            tier.release.set()


def test_allocation_falls_back_to_heap_without_a_pool_owner():
    with StorageManager({"tiers": [{"backend": "tests.support.tiers_for_tests:DictTier"}]}) as mgr:
        obj = mgr.allocate((2, 3, 4096))
        assert obj is not None and obj.address == -1
        obj.ref_down()


def test_wrapper_applies_to_chosen_tier_only():
    seen: list[str] = []

    class Spy:
        @hookimpl(wrapper=True)
        def get(self, key):
            seen.append("get")
            return (yield)

    with two_tiers() as mgr:
        mgr.add_wrapper(Spy(), tiers=["lower"])
        mgr.get(make_key(3))  # misses both tiers: the spy sees only the lower tier's call
        assert seen == ["get"]
        with pytest.raises(ConfigError, match="unknown tier"):
            mgr.add_wrapper(Spy(), tiers=["nope"])


def test_duplicate_tier_names_and_bad_options():
    with pytest.raises(ConfigError, match="appear more than once"):
        StorageManager({"tiers": [L1, L1]})
    with pytest.raises(ConfigError, match="tier 'l1'.*capacty.*Allowed options: capacity"):
        StorageManager({"tiers": [{**L1, "options": {"capacty": "1GiB"}}]})
    with pytest.raises(ConfigError, match="capacity"):
        StorageManager({"tiers": [{**L1, "options": {"capacity": "lots"}}]})


def test_close_is_idempotent_and_releases_l1():
    mgr = two_tiers()
    obj = fill_random(mgr)
    mgr.batched_put([make_key(0)], [obj])
    mgr.close()
    mgr.close()
    assert obj.ref_count == 1
    obj.ref_down()


def test_batched_get_over_many_keys_with_a_slow_tier_does_not_starve():
    with two_tiers(timeout_s=2.0) as mgr:
        keys = [make_key(i) for i in range(24)]
        for k in keys:
            obj = fill_random(mgr, seed=k.chunk_hash[3])
            mgr.batched_put([k], [obj])
            obj.ref_down()
        mgr.evict(keys, tiers=["l1"])
        got = mgr.batched_get(keys)
        assert all(g is not None for g in got), "some reads timed out waiting for a thread"
        for g in got:
            g.ref_down()
        assert mgr.stats()["lower"]["timeouts"] == 0


def test_option_errors_never_echo_mappings():
    tier = {"backend": "local_cpu", "options": {"capacity": {"secret": "hunter2"}}}
    with pytest.raises(ConfigError) as err:
        StorageManager({"tiers": [tier]})
    assert "hunter2" not in str(err.value) and "capacity" in str(err.value)


def test_a_lone_stalling_tier_is_bounded_too():
    """Even as the first (only) tier, a backend that may block is called under its timeout."""
    tier = {"backend": "tests.support.tiers_for_tests:StallingTier", "options": {"stall_s": 120},
            "timeout_s": 0.2}
    with StorageManager({"tiers": [tier]}) as mgr:
        stalling = mgr.backend(0)
        try:
            assert mgr.get(make_key(1)) is None
            assert stalling.left == 0  # back while the tier still stalls
            assert mgr.stats()["tests.support.tiers_for_tests:StallingTier"]["timeouts"] == 1
        finally:
            stalling.release.set()


# -- pins that are always released; a stalled tier that starves no other ------------------------

HANG_S = 30  # only turns a hang into a failure
STALL = threading.Event()  # BlockingTier's reads wait on it (set: they return)


class BlockingTier(DictTier):
    """A tier whose get/contains block until ``STALL`` is set (a hung NFS mount)."""

    @hookimpl
    def get(self, key):
        STALL.wait(HANG_S)
        return super().get(key)

    @hookimpl
    def contains(self, keys):
        STALL.wait(HANG_S)
        return super().contains(keys)


def test_a_late_pinned_contains_releases_its_pins(tmp_path):
    """posix tier, a contains(pin=True) that answers after its timeout: its pin goes when it
    finishes (a late get's object is dropped the same way)."""
    gate = threading.Event()

    class SlowContains:
        @hookimpl(wrapper=True)
        def contains(self, keys, pin):
            res = yield  # the backend pinned what it found...
            gate.wait(HANG_S)  # ...and answers after the caller gave up
            return res

    tier = {"backend": "posix", "name": "disk", "options": {"path": str(tmp_path)},
            "timeout_s": 0.2}
    with StorageManager({"tiers": [tier]}) as mgr:
        obj = fill_random(mgr, seed=3)
        mgr.batched_put([make_key(3)], [obj])
        obj.ref_down()
        assert mgr.flush()
        mgr.add_wrapper(SlowContains(), tiers=["disk"])
        assert mgr.lookup_prefix([make_key(3)], pin=True).num_chunks == 0  # timed out: a miss
        assert mgr.stats()["disk"]["pinned"] == 1  # control: the late call did pin
        gate.set()
        end = time.monotonic() + HANG_S
        while mgr.stats()["disk"]["pinned"] and time.monotonic() < end:
            time.sleep(0.01)
        assert mgr.stats()["disk"]["pinned"] == 0, "the pin of a late contains was never released"
        assert mgr.stats()["disk"]["timeouts"] == 1


def test_a_stalled_tier_does_not_starve_the_others():
    """Many lookups through a tier that never answers: threads stay bounded, and the next tier
    answers every one of them."""
    STALL.clear()
    stalled = {"backend": "tests.unit.test_storage_manager:BlockingTier", "name": "stalled",
               "timeout_s": 0.05}
    lower = {"backend": "tests.support.tiers_for_tests:DictTier", "name": "lower", "timeout_s": 10}
    before = threading.active_count()
    try:
        with StorageManager({"tiers": [stalled, lower]}) as mgr:
            obj = fill_random(mgr, seed=5)
            mgr.batched_put([make_key(5)], [obj])
            obj.ref_down()
            for i in range(40):
                look = mgr.lookup_prefix([make_key(5)])
                assert (look.num_chunks, look.tiers) == (1, ["lower"]), f"lookup {i} starved"
                got = mgr.get(make_key(5), promote=False)
                assert got is not None, f"read {i} starved"
                got.ref_down()
                assert threading.active_count() <= before + 16, "tier threads pile up"
            assert mgr.stats()["stalled"]["timeouts"] == 80
            assert mgr.stats()["lower"]["timeouts"] == 0
    finally:
        STALL.set()


def test_a_key_given_twice_in_one_put_is_stored_once():
    """Two requests finishing the same prefix in one step hand the same key twice; every tier
    receives it once (the contract says a call's keys are distinct), with the first object."""
    with two_tiers("PutRecordingTier") as mgr:
        objs = [fill_random(mgr, seed=s) for s in (1, 2, 3)]
        expect = objs[0].byte_view.clone()
        mgr.batched_put([make_key(1), make_key(2), make_key(1)], objs)
        for obj in objs:
            obj.ref_down()
        assert mgr.backend("lower").put_calls == [[make_key(1), make_key(2)]]
        mgr.evict([make_key(1)], tiers=["l1"])
        got = mgr.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, expect), "not the first object's bytes"
        got.ref_down()


def test_batched_get_asks_a_batching_tier_only_for_l1_misses_in_bounded_groups():
    """A tier with a ``batched_get`` hook gets the keys L1 missed, in calls of at most
    BATCH_GET_KEYS keys, and its hits come back in the caller's order and are promoted."""
    from kvplug.tier_calls import BATCH_GET_KEYS

    with two_tiers("BatchTier") as mgr:
        keys = [make_key(i) for i in range(BATCH_GET_KEYS + 5)]
        want = {}
        for k in keys:
            obj = fill_random(mgr, seed=k.chunk_hash[3])
            want[k] = obj.byte_view.clone()
            mgr.batched_put([k], [obj])
            obj.ref_down()
        mgr.evict(keys[2:], tiers=["l1"])  # keys 0 and 1 stay in L1
        asked = [*keys, make_key(999)]
        got = mgr.batched_get(asked)
        assert got[-1] is None
        for k, g in zip(keys, got):
            assert g is not None and torch.equal(g.byte_view, want[k])
            g.ref_down()
        calls = mgr.backend("lower").calls
        assert sorted(len(c) for c in calls) == [len(asked) - 2 - BATCH_GET_KEYS, BATCH_GET_KEYS]
        assert sorted(k.chunk_hash for c in calls for k in c) == sorted(
            k.chunk_hash for k in [*keys[2:], make_key(999)])
        assert mgr.lookup_prefix(keys).tiers == ["l1"] * len(keys), "hits not promoted"


def test_a_batched_get_of_the_wrong_length_is_a_fault_and_its_objects_released():
    with two_tiers("BatchTier", short=True) as mgr:
        keys = [make_key(i) for i in range(3)]
        for k in keys:
            obj = fill_random(mgr, seed=1)
            mgr.batched_put([k], [obj])
            obj.ref_down()
        mgr.evict(keys, tiers=["l1"])
        assert mgr.batched_get(keys) == [None, None, None]
        lower = mgr.backend("lower")
        assert len(lower.handed) == 2 and all(o.is_freed for o in lower.handed)
        assert mgr.stats()["lower"]["faults"] == 1


class ThreadRecordingTier(DictTier):
    """A tier that records the thread each ``get`` runs on; ``call_bound_s`` from its options
    (the longest one of its calls can wait, as a tier whose client bounds every call says)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.threads: list[threading.Thread] = []
        bound = ctx.options.get("call_bound_s")
        if bound is not None:
            self.call_bound_s = bound

    @hookimpl
    def get(self, key):
        self.threads.append(threading.current_thread())
        return super().get(key)


@pytest.mark.parametrize("bound, on_caller_thread", [(1.0, True), (10.0, False), (None, False)])
def test_a_tier_whose_calls_are_bounded_within_timeout_is_called_on_the_callers_thread(
        bound, on_caller_thread):
    """A tier that declares every call bounded within its ``timeout_s`` (``call_bound_s``) is
    called on the caller's thread, without the hand-off to its pool; one whose bound is longer
    than ``timeout_s``, or that declares none, is still called on its pool (bounded there). The
    answer is the same either way, and the tier still may block (its loads run off the step)."""
    options = {} if bound is None else {"call_bound_s": bound}
    tier = {"backend": f"{__name__}:ThreadRecordingTier", "options": options,
            "timeout_s": 5.0}
    with StorageManager({"tiers": [tier]}) as mgr:
        obj = fill_random(mgr, seed=1)
        mgr.batched_put([make_key(1)], [obj])
        got = mgr.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, obj.byte_view)
        got.ref_down()
        obj.ref_down()
        threads = mgr.backend(0).threads
        assert threads and all((t is threading.current_thread()) == on_caller_thread for t in threads), \
            [t.name for t in threads]
        assert not mgr.never_blocks(f"{__name__}:ThreadRecordingTier")


def test_a_local_mediums_small_values_are_read_in_sequence_and_large_ones_spread(tmp_path):
    """Reads from the page cache are mostly Python under the GIL, so a batch of a
    local tier's small values is read one bounded call after another from the caller's thread
    (spread over reader threads they queued on the GIL: 1.8-1.9x slower at 256 KiB); values of
    SEQUENTIAL_READ_BYTES or more are spread (their copies run in parallel). Every byte is
    checked either way."""
    from kvplug.memory import heap_memory_obj
    from kvplug.tier_calls import BATCH_GET_KEYS, SEQUENTIAL_READ_BYTES

    mgr = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(tmp_path)}}]})
    mgr._tiers[0]._nowait = False  # the bounded calls (reads without waiting would come first)
    callers: list[str] = []
    real = mgr._batch_from

    def recording(tier, keys):
        callers.append(threading.current_thread().name)
        return real(tier, keys)

    mgr._batch_from = recording
    gen = torch.Generator().manual_seed(36)

    def stored(first: int, n: int, nbytes: int) -> tuple[list, list[torch.Tensor]]:
        keys, want = [make_key(i) for i in range(first, first + n)], []
        for k in keys:
            obj = heap_memory_obj((2, 1, nbytes // 2), torch.uint8, num_tokens=16)
            obj.tensor.copy_(torch.randint(0, 256, obj.tensor.shape, dtype=torch.uint8,
                                           generator=gen))
            want.append(obj.byte_view.clone())
            mgr.batched_put([k], [obj])
            obj.ref_down()
        assert mgr.flush(60)
        return keys, want

    def read(keys: list, want: list[torch.Tensor]) -> set[str]:
        callers.clear()
        got = mgr.batched_get(keys)
        for g, w in zip(got, want, strict=True):
            assert g is not None and torch.equal(g.byte_view, w)
            g.ref_down()
        assert len(callers) == -(-len(keys) // BATCH_GET_KEYS)
        return set(callers)

    try:
        small = stored(0, 2 * BATCH_GET_KEYS + 3, 256 << 10)
        main = threading.current_thread().name
        assert read(*small) == {main}
        large = stored(100, 2 * BATCH_GET_KEYS + 3, SEQUENTIAL_READ_BYTES)
        read(*large)  # learns the size (read in sequence: the last values were small)
        assert main not in read(*large), "large values of a local medium are spread"
        read(*small)  # learns the size again (spread: the last values were large)
        assert read(*small) == {main}
    finally:
        mgr.close()
