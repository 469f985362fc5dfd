"""The resp tier on a three-master Redis cluster (no replicas) when one master dies: the values
in its slots are misses (lookups and loads), stores to them are dropped, and the other masters
keep serving exact hits — before and after the cluster marks the master failed (its masters run
with ``cluster-require-full-coverage no``, as a cache cluster without replicas should; with
``yes`` Redis itself refuses every key once a master is marked failed). Nothing raises, every
call returns; restarted (empty), the master serves again. With every master down, the tier's
breaker opens (the tier is refused at once, as a single server that is down). A hung master
(SIGSTOP): bounded misses in its slots, hits elsewhere, hits again after SIGCONT."""

from __future__ import annotations

import json
import time

import pytest
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

from tests.faults.test_resp_faults import get_exact, manager, mgr_faults, put
from tests.support.redis_server import RedisClusterServers
from tests.support.tier_workload import HANG

pytestmark = pytest.mark.timeout(180)
N = 24  # chunks per round: every master holds some


def _marked_failed(cluster: RedisClusterServers, port: int) -> bool:
    """Whether a live master's view of the cluster marks the master on ``port`` failed."""
    client = cluster.nodes[0].client()
    try:
        line = next(ln for ln in client.execute_command("CLUSTER", "NODES").decode().splitlines()
                    if f"127.0.0.1:{port}@" in ln)
    finally:
        client.close()
    return " fail " in f" {line.split()[2].replace(',', ' ')} "


def _round(mgr: StorageManager, refs: dict, down: set[int]) -> dict:
    """Loads and lookups of every chunk in ``refs``: exactly those not on the dead master hit."""
    hits = {i: get_exact(mgr, i, refs[i]) for i in refs}
    assert {i for i, h in hits.items() if not h} == down & set(refs), hits
    found = {i: mgr.lookup_prefix([make_key(i)]).num_chunks for i in refs}
    assert {i for i, n in found.items() if n == 0} == down & set(refs), found
    order = sorted(refs)  # one batched lookup: the prefix stops at the first chunk on it
    first_down = next((j for j, i in enumerate(order) if i in down), len(order))
    assert mgr.lookup_prefix([make_key(i) for i in order]).num_chunks == first_down
    return hits


@pytest.fixture
def stored(tmp_path):
    """A 3-master cluster (no full coverage), a manager on it, N chunks stored: (cluster, mgr,
    refs); and ``on(victim, ids)``, the ids whose keys live on that master."""
    cluster = RedisClusterServers(tmp_path / "cluster", full_coverage=False)
    mgr = manager(cluster.url, cluster=True)
    try:
        refs = {i: put(mgr, i) for i in range(N)}
        assert mgr.flush(timeout=HANG)

        def on(victim, ids) -> set[int]:
            probe = cluster.client()
            try:
                return {i for i in ids if probe.get_node_from_key(
                    mgr.backend(0).name_of(make_key(i))).port == victim.port}
            finally:
                probe.close()

        yield cluster, mgr, refs, on
    finally:
        mgr.close()
        cluster.stop()


def test_one_master_killed_its_slots_miss_others_hit(stored):
    cluster, mgr, refs, on = stored
    victim = cluster.nodes[1]  # not the URL's node: a new client could not start without it
    on_victim = on(victim, range(3 * N))
    assert 0 < len(on_victim & set(range(N))) < N, on_victim  # not vacuous: both kinds exist
    late = min(on_victim - set(range(2 * N)))  # stored after the restart, on the victim
    _round(mgr, refs, set())
    victim.kill()
    _round(mgr, refs, on_victim)  # at once: the cluster has not noticed yet
    deadline = time.monotonic() + 60
    while not _marked_failed(cluster, victim.port):
        assert time.monotonic() < deadline, "the cluster never marked the master failed"
        time.sleep(0.1)
    _round(mgr, refs, on_victim)  # the cluster knows: the others still serve their slots
    for i in range(N, 2 * N):  # stores: those to the dead master are dropped
        refs[i] = put(mgr, i)
    assert mgr.flush(timeout=HANG)
    _round(mgr, refs, on_victim)
    st = mgr.stats()["resp"]
    assert st["breaker_open"] == 0.0, st  # the tier still serves the other masters
    assert st["corrupt"] == 0 and st["remote_errors"] + st["socket_timeouts"] >= 1, st
    assert st["written"] == 2 * N - len(on_victim & set(range(N, 2 * N))), st
    victim.restart()  # empty (no persistence), back in its slots (nodes.conf)
    deadline = time.monotonic() + 60
    while True:  # its slots serve again once its breaker's probe succeeds
        refs[late] = put(mgr, late)
        assert mgr.flush(timeout=HANG)
        if get_exact(mgr, late, refs[late]):
            break
        assert time.monotonic() < deadline, ("no hit after the restart", mgr.stats())
        time.sleep(0.2)
    _round(mgr, refs, on_victim - {late})  # what it held before is lost: misses
    end = mgr.stats()["resp"]
    assert end["breaker_open"] == 0.0 and end["masters_down"] == 0.0, end
    for node in cluster.nodes:  # the whole cluster down: the tier's breaker opens
        node.kill()
    deadline = time.monotonic() + 60
    while mgr.stats()["resp"]["breaker_open"] == 0.0:  # lookups reach every master
        assert mgr.lookup_prefix([make_key(i) for i in range(N)]).num_chunks == 0
        assert not any(get_exact(mgr, i, refs[i]) for i in range(4))
        assert time.monotonic() < deadline, ("the tier never gave up", mgr.stats())
        time.sleep(0.01)
    assert mgr.lookup_prefix([make_key(0)]).num_chunks == 0 and mgr_faults(mgr) == 0
    gone = mgr.stats()["resp"]
    shown = ("written", "put_errors", "dropped_full", "vanished", "remote_errors",
             "masters_down", "master_breaker_trips", "breaker_open", "breaker_trips")
    print(json.dumps({"on_victim": len(on_victim & set(range(N))), "of": N} | {
        name: {k: s[k] for k in shown} for name, s in (("down", st), ("end", end),
                                                       ("all_down", gone))}))


def test_one_master_hung_bounded_misses_others_hit(stored):
    """A master stopped with SIGSTOP (accepts connections, never answers): the values in its
    slots are misses within the bound (each call returns), the other masters keep serving exact
    hits; after SIGCONT its values hit again."""
    cluster, mgr, refs, on = stored
    victim = cluster.nodes[2]
    on_victim = on(victim, refs)
    assert 0 < len(on_victim) < N
    victim.pause()
    for _ in range(2):  # get_exact and lookup_prefix fail the test if a call hangs
        _round(mgr, refs, on_victim)
    st = mgr.stats()["resp"]
    assert st["masters_down"] == 1.0 and st["socket_timeouts"] >= 1, st
    assert st["breaker_open"] == 0.0 and mgr_faults(mgr) == 0, st
    victim.resume()
    deadline = time.monotonic() + 60
    while not all(get_exact(mgr, i, refs[i]) for i in on_victim):
        assert time.monotonic() < deadline, ("no hit after SIGCONT", mgr.stats())
        time.sleep(0.2)
    _round(mgr, refs, set())
    print(json.dumps({"on_victim": len(on_victim), "of": N, "socket_timeouts":
                      st["socket_timeouts"], "master_breaker_trips": st["master_breaker_trips"]}))
