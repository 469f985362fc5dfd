"""The fleet load generator (benchmarks/bench_fleet.py) replays a trace for real: against a real
redis-server, the calls, keys, hits, misses and bytes it counts are those of the trace, the store
holds what it stored, and engines share exactly the ids made common to all (so the benchmark
cannot silently measure nothing). Also the trace format's own rules (benchmarks/fleet_trace.py)."""

from __future__ import annotations

import json

import pytest
import torch
from kvplug.storage_manager import StorageManager

from benchmarks import bench_fleet, fleet_trace
from tests.support.redis_server import redis_server  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(120)

# Store chunks 0-2, look up 0-3 (3 found), load 0-2 (hits) and 3-4 (never stored: misses),
# look up 4 alone (none found).
TRACE = {"format": fleet_trace.FORMAT, "chunk_size": 256, "num_ids": 5, "events": [
    [0.0, "P", [0, 1, 2], [4096, 8192, 2048]],
    [1.0, "L", [0, 1, 2, 3], 3],
    [2.0, "G", [0, 1, 2], [4096, 8192, 2048]],
    [3.0, "G", [3, 4], [4096, 4096]],
    [4.0, "L", [4], 0],
]}


def _manager(url: str, l1: bool = True) -> StorageManager:
    tiers = [{"backend": "local_cpu", "options": {"capacity": "16MiB", "prefault": False}}] \
        if l1 else []
    return StorageManager({"tiers": [*tiers, bench_fleet.store_tier("resp", url, 5.0,
                                                                    negative_cache_s=0)]})


def _replay(mgr: StorageManager, trace: dict, engine: int, shared: set[int]) -> dict:
    rep = bench_fleet.Replayer(mgr, trace, engine, shared, seed=3)
    rep.run(duration_s=60, max_events=10**6, max_passes=1)
    assert mgr.flush(timeout=30)
    return rep.result()


def test_replay_counts_hits_misses_and_bytes(redis_server):  # noqa: F811
    with _manager(redis_server.url) as mgr:
        res = _replay(mgr, TRACE, engine=0, shared=set())
        src = bench_fleet.Replayer(mgr, TRACE, 0, set(), seed=3)._src
    n = res["n"]
    assert {k: n[k] for k in ("events", "passes", "errors", "lookup_calls", "lookup_keys",
                              "lookup_found", "get_calls", "get_keys", "get_hits", "get_bytes",
                              "put_calls", "put_keys", "put_bytes")} == {
        "events": 5, "passes": 1, "errors": 0, "lookup_calls": 2, "lookup_keys": 5,
        "lookup_found": 3, "get_calls": 2, "get_keys": 5, "get_hits": 3, "get_bytes": 14336,
        "put_calls": 1, "put_keys": 3, "put_bytes": 14336}
    assert [len(res["lat"][k]) for k in bench_fleet.KINDS] == [2, 2, 1]
    assert res["store"]["written"] == 3 and res["store"]["faults"] == 0
    # The store itself holds the three chunks, with the replayed bytes: read back by a manager
    # without L1 (nothing local) and by a plain redis client.
    client = redis_server.client()
    try:
        assert client.dbsize() == 3
    finally:
        client.close()
    with _manager(redis_server.url, l1=False) as reader:
        for i, size in zip((0, 1, 2), (4096, 8192, 2048)):
            obj = reader.get(bench_fleet.chunk_key(0, 0, i, False))
            assert obj is not None and obj.nbytes == size
            assert torch.equal(obj.byte_view, src[:size])
            obj.ref_down()
        assert reader.get(bench_fleet.chunk_key(0, 0, 3, False)) is None


def test_engines_share_only_the_shared_ids(redis_server):  # noqa: F811
    """Engine 0 stores 0-2; engine 1 (its own empty L1) looks up and loads 0-1: id 0 made common
    is found and loaded from the store, id 1 (private to each engine) is not."""
    reads = {**TRACE, "events": [[0.0, "L", [0, 1], 1], [1.0, "G", [0, 1], [4096, 8192]]]}
    with _manager(redis_server.url) as writer:
        _replay(writer, TRACE, engine=0, shared={0})
    for shared, found in (({0}, 1), (set(), 0)):  # negative control: nothing shared
        with _manager(redis_server.url) as mgr:
            n = _replay(mgr, reads, engine=1, shared=shared)["n"]
            stats = mgr.stats()
        assert (n["lookup_found"], n["get_hits"], n["found_store_shared"]) == (found, found, found)
        assert n["found_l1_shared"] == n["found_l1_private"] == n["found_store_private"] == 0
        assert (n["get_store_shared"], n["get_l1_shared"], n["get_store_private"]) == (found, 0, 0)
        assert stats["store"]["hits"] == found and stats["local_cpu"]["hits"] == 0


def test_passes_use_new_private_keys_and_the_same_shared_ones(redis_server):  # noqa: F811
    trace = {**TRACE, "events": TRACE["events"][:1]}  # store 0-2
    with _manager(redis_server.url) as mgr:
        rep = bench_fleet.Replayer(mgr, trace, 0, {0})
        rep.run(duration_s=60, max_events=10**6, max_passes=3)
        assert mgr.flush(timeout=30) and rep.n["put_keys"] == 9
    client = redis_server.client()
    try:
        assert client.dbsize() == 1 + 2 * 3  # shared id 0 once, ids 1-2 per pass
    finally:
        client.close()


def test_replay_is_bounded_by_count():
    with StorageManager({"tiers": [{"backend": "local_cpu", "options": {"capacity": "8MiB"}}]}) \
            as mgr:
        rep = bench_fleet.Replayer(mgr, TRACE, 0, set())
        rep.run(duration_s=60, max_events=12)
    assert rep.n["events"] == 12 and rep.n["passes"] == 2
    assert rep.n["trace_s"] == pytest.approx(2 * 0.004 + 0.001)  # two passes of 4 ms, then 1 ms


def test_trace_format(tmp_path):
    raw = ['[0.5, "P", ["aa", "bb"], [10, 10]]', '[1, "G", ["aa"], [10]]',
           '[2, "G", ["cc"], [0]]', '[3, "L", ["aa", "bb", "cc"], 2]', '[4, "G", ["bb"], [10]]']
    events, num_ids = fleet_trace.anonymise(raw)
    assert num_ids == 3
    assert events == [[0.5, "P", [0, 1], [10, 10]], [1, "G", [0, 2], [10, 0]],
                      [3, "L", [0, 1, 2], 2], [4, "G", [1], [10]]]
    trace = {"format": fleet_trace.FORMAT, "chunk_size": 256, "num_ids": num_ids,
             "events": events}
    assert fleet_trace.hottest(trace, 1 / 3) == {0}  # ids in lookups ranked; ties by id
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**trace, "format": "other/1"}))
    with pytest.raises(ValueError, match="other/1"):
        fleet_trace.load(path)
    path.write_text(json.dumps({**trace, "events": [[0, "G", [0, 1], [10]]]}))
    with pytest.raises(ValueError, match="bad event"):
        fleet_trace.load(path)
