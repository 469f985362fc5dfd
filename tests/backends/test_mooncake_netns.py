"""The mooncake tier against a real Mooncake master: conformance and failures. Runs only inside
a private network namespace (``tests/backends/test_mooncake.py`` starts it under ``unshare -n``), where
the master and every client listen on loopback only.

Each kvplug manager here lends the store a segment of its own memory (``global_segment_size``), as
an engine would; the master only places objects. Checked besides the conformance kit: a master
killed and restarted (every object lost) gives misses, never errors, the breaker trips and the
tier serves exact hits again once it is back; a stopped master (SIGSTOP) gives bounded misses.
"""

from __future__ import annotations

import time

import pytest
import torch
from kvplug.storage_manager import StorageManager
from kvplug.testing import BackendConformance
from kvplug.testing.conformance import make_key

from tests.support import in_place_reads
from tests.support.mooncake_store import MooncakeMaster
from tests.support.tier_workload import HANG, get_exact, put_random

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def master(tmp_path):
    m = MooncakeMaster(tmp_path / "mooncake")
    yield m
    m.stop()


def tier(master: MooncakeMaster, **opts) -> dict:
    options = {"master": master.address, "global_segment_size": "128MiB",
               "local_buffer_size": "64MiB", "timeout_s": 1.0, "negative_cache_s": 0, **opts}
    return {"backend": "mooncake", "timeout_s": 10.0, "options": options}


class TestMooncakeConformance(BackendConformance):
    # Objects live in the segments that managers lend: a closed manager takes its own with it.
    persistent = False

    @pytest.fixture
    def make_tiers(self, master):
        return lambda capacity: [tier(master, capacity=capacity)]

    @pytest.fixture
    def corrupt_entry(self):
        def corrupt(manager, key) -> None:
            backend = manager.backend(0)
            name = backend.name_of(key)
            data = bytearray(backend.io.get(name))
            data[-100] ^= 0xFF
            assert backend.io.set_many([(name, bytes(data))]) == [None]

        return corrupt

    def test_get_layers_gives_each_range(self, make_tiers):
        """Mooncake has no ranged read of one object: the tier declares no ``get_layers`` (the
        kit's test would skip, which this suite's runner refuses), so layer-wise loads read its
        chunks whole."""
        with self.opened(make_tiers) as mgr:
            assert not mgr.reads_layers("mooncake")


def _put(mgr: StorageManager, i: int) -> torch.Tensor:
    return put_random(mgr, make_key(i), i)


def _exact(mgr: StorageManager, i: int, ref: torch.Tensor) -> bool:
    return get_exact(mgr, make_key(i), ref)


def _stats(mgr: StorageManager) -> dict:
    return mgr.stats()["mooncake"]


def test_master_killed_and_restarted(master):
    mgr = StorageManager({"tiers": [tier(master, breaker_backoff_s=0.2,
                                         breaker_max_backoff_s=0.5)], "chunk_size": 16})
    try:
        refs = {i: _put(mgr, i) for i in range(4)}
        assert mgr.flush(timeout=HANG)
        assert all(_exact(mgr, i, refs[i]) for i in range(4))
        master.kill()
        assert [_exact(mgr, i, refs[i]) for i in range(4)] == [False] * 4
        assert mgr.lookup_prefix([make_key(i) for i in range(4)]).num_chunks == 0
        refs[10] = _put(mgr, 10)  # dropped: the store is down
        assert mgr.flush(timeout=HANG)
        st = _stats(mgr)
        assert st["breaker_trips"] >= 1 and st["breaker_open"] == 1.0, st
        master.restart()  # a restart loses every object
        deadline = time.monotonic() + 60
        while True:  # stores go through again once the breaker's probe succeeds
            refs[11] = _put(mgr, 11)
            assert mgr.flush(timeout=HANG)
            if _exact(mgr, 11, refs[11]):
                break
            assert time.monotonic() < deadline, ("no hit after the restart", _stats(mgr))
            time.sleep(0.3)
        assert [_exact(mgr, i, refs[i]) for i in range(4)] == [False] * 4  # lost: misses
        st = _stats(mgr)
        assert st["breaker_open"] == 0.0 and st["corrupt"] == 0, st
        assert sum(t.faults for t in mgr._tiers) == 0
        print(st)
    finally:
        mgr.close()


def test_hung_master_bounded_misses(master):
    mgr = StorageManager({"tiers": [tier(master, breaker_backoff_s=0.2,
                                         breaker_max_backoff_s=0.5)], "chunk_size": 16})
    try:
        refs = {i: _put(mgr, i) for i in range(3)}
        assert mgr.flush(timeout=HANG)
        master.pause()
        t0 = time.monotonic()
        assert mgr.lookup_prefix([make_key(50)]).num_chunks == 0  # not known here: asks
        # Every load returns within the bound, exact or a miss. Mooncake may still serve an
        # object held in this client's own segment whose location it knows without the master
        # (seen once in a suite run: chunk 0 hit, exact); those that ask the master miss.
        hits = [_exact(mgr, i, refs[i]) for i in range(3)]
        assert not all(hits), hits  # (the stats below: the calls that asked met the hang)
        assert time.monotonic() - t0 < HANG
        st = _stats(mgr)
        assert st["breaker_open"] == 1.0 and st["socket_timeouts"] + st["remote_errors"] >= 2, st
        master.resume()
        deadline = time.monotonic() + 60
        while not _exact(mgr, 1, refs[1]):
            assert time.monotonic() < deadline, ("no hit after SIGCONT", _stats(mgr))
            time.sleep(0.3)
        assert sum(t.faults for t in mgr._tiers) == 0
    finally:
        mgr.close()


# -- reads straight into L1's pool (batch_get_into_multi_buffers): tests/support/in_place_reads.py -----


def test_reads_land_in_the_pool_checked(master):
    in_place_reads.reads_land_in_the_pool_checked(lambda: tier(master))


def test_damaged_short_or_vanished_values_read_in_place_are_misses(master):
    in_place_reads.damaged_short_or_vanished_values_are_misses(lambda: tier(master))


def test_encoded_chunks_are_read_whole(master):
    in_place_reads.encoded_chunks_are_read_whole(lambda: tier(master))


def test_partial_tails_keep_the_layout(master):
    in_place_reads.partial_tails_keep_the_layout(lambda: tier(master))


def test_client_set_up_at_start_before_any_call(master):
    """The client sets up as the tier starts (so an idle engine lends its segment and the first
    request does not pay the setup), with no call made; then serves exact hits."""
    mgr = StorageManager({"tiers": [tier(master)], "chunk_size": 16})
    try:
        io = mgr.backend(0).io
        deadline = time.monotonic() + HANG
        while not io.set_up:
            assert time.monotonic() < deadline, "the client was not set up at start"
            time.sleep(0.05)
        assert _stats(mgr).get("lookups", 0) == 0 and _stats(mgr).get("bytes_put", 0) == 0
        ref = _put(mgr, 1)
        assert mgr.flush(timeout=HANG) and _exact(mgr, 1, ref)
    finally:
        mgr.close()


def test_tier_alone_reads_a_batch_without_a_copy_per_value(master):
    """With no L1 in front (reads in place need registered memory), a batch is read value by
    value into the thread's registered buffer and each is copied once, verified, into its
    memory object: no ``bytes`` copy of every value held until the batch is done (the Python
    heap's peak during a batch of 8 chunks of 1 MiB stays far below one chunk; it held all 8
    before)."""
    import tracemalloc

    writer = StorageManager({"tiers": [tier(master)], "chunk_size": 16})
    reader = StorageManager({"tiers": [tier(master)], "chunk_size": 16})
    try:
        refs = in_place_reads._store(writer, {i: (4, 2, 1 << 17) for i in range(8)})  # 1 MiB
        keys = [make_key(i) for i in range(8)]
        for g in reader.backend(0).batched_get(keys):  # the thread's buffer grows once
            g.ref_down()
        tracemalloc.start()
        try:
            got = reader.backend(0).batched_get(keys)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        for i, g in enumerate(got):
            assert g is not None and torch.equal(g.byte_view, refs[i]), f"chunk {i} differs"
            g.ref_down()
        assert peak < (1 << 20) // 2, f"{peak} bytes of Python heap for a batch of 8 MiB"
    finally:
        reader.close()
        writer.close()


def test_a_remove_refused_for_a_lease_is_a_miss_at_once_and_done_later(tmp_path):
    """Mooncake's master leases an object to whoever reads it or asks whether it exists and
    refuses its remove until the lease ends (1 s here; 10 s by default). An eviction (for room,
    or an operator's clear) of a chunk a lookup just found is a miss at once, the chunk stored
    again is served with its new bytes, and the remove is asked again until Mooncake takes it.
    Before: the refusal was ignored: the tier forgot the chunk while Mooncake kept it, so the
    next lookup found it again (the conformance kit's pins test failed when its lookups fell
    within a lease of the evictions)."""
    m = MooncakeMaster(tmp_path / "mooncake", lease_ms=1000)
    try:
        with StorageManager({"tiers": [tier(m)], "chunk_size": 16}) as mgr:
            old, other = _put(mgr, 1), _put(mgr, 2)
            assert mgr.flush(10) and _exact(mgr, 1, old)  # a read: Mooncake leases it
            mgr.evict([make_key(1)])
            assert mgr.lookup_prefix([make_key(1)]).num_chunks == 0
            assert mgr.get(make_key(1)) is None
            store = mgr.backend("mooncake").io.store()
            name = mgr.backend("mooncake").name_of(make_key(1))
            deadline = time.monotonic() + HANG
            while store.batch_is_exist([name]) != [0]:  # removed once its lease ended
                assert time.monotonic() < deadline, "the refused remove was never done"
                time.sleep(1.2)  # a lease past: this check's own lease ends too
                assert _exact(mgr, 2, other)  # a tier call: the pending remove is asked again
            new = put_random(mgr, make_key(1), 101)
            assert mgr.flush(10) and _exact(mgr, 1, new) and not torch.equal(new, old)
    finally:
        m.stop()
