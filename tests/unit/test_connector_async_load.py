"""The worker side of background (asynchronous) loads, without an engine: a load from a tier that
may block is fetched off the step, written into the blocks only from ``get_finished`` (vLLM's
thread, between forward passes), reported once in ``finished_recving``; a cancelled load never
writes a block and leaks nothing; a tier that never answers becomes load errors within its
``timeout_s``. The scheduler side marks a hit that needs such a tier asynchronous."""

from __future__ import annotations

import hashlib
import time
import uuid

import pytest
import torch

from tests.support.gpu_kv_fixture import KVFixture
from tests.support.waits import wait_until

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.lookup import Lookup  # noqa: E402
from kvplug.connector.protocol.metadata import KVPlugMetadata, LoadSpec, ReqMeta, SaveSpec  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402

BS, CHUNK = 4, 8
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
SRC, DST = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
HANG_S = 60  # only catches a hang


def _worker(tmp_path, lower: dict, fx: KVFixture) -> WorkerSide:
    cfg = ConnectorConfig(chunk_size=CHUNK, log_every_load=False, async_save=False,
                          tiers=[{"backend": "local_cpu", "options": {"capacity": "4MiB"}},
                                 {"name": "slow", **lower}])
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(fx.caches)
    w.wait_for_save(KVPlugMetadata(CHUNK, BS, [ReqMeta("a", SRC, save=SaveSpec(0, 24, 0, HASHES))]))
    w.storage.evict(tiers=["local_cpu"], nbytes=1 << 30)  # the hit is only in the slow tier
    return w


@pytest.fixture
def gated(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    fx = KVFixture("LBHNC", torch.bfloat16, L=3, B=16)
    w = _worker(tmp_path, {"backend": "tests.support.tiers_for_tests:GatedTier", "options": {"gate": str(gate)},
                           "timeout_s": HANG_S}, fx)
    want = fx.ref_obj(SRC)
    fx.poison(DST)
    try:
        yield fx, w, gate, want
    finally:
        (gate / "open").touch()
        w.close()


def start(w) -> None:
    assert w._on_lookup(Lookup(1, "b", HASHES)) == (24, [0, 1, 2], [])  # in a tier that may block
    spec = LoadSpec(0, 24, 0, HASHES, background=True)
    w.start_load_kv(KVPlugMetadata(CHUNK, BS, [ReqMeta("b", DST, load=spec)]))
    w.wait_for_save(None)  # the step's forward is over: a background load is not waited for


def poll(w, finished=frozenset()) -> set[str]:
    """get_finished each 'step' until something is reported (a hang is caught)."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        if got := w.get_finished(set(finished))[1]:
            return got
        time.sleep(0.01)
    raise AssertionError("no load was reported")


def pins(w) -> int:
    """Chunks the worker holds pinned for lookups (the tiers' own pin counts follow them)."""
    return sum(len(keys) for keys, _ in w._pins.values())


def test_background_load_writes_at_get_finished(gated):
    fx, w, gate, want = gated
    start(w)
    while not list(gate.glob("entered-*")):  # the fetch is blocked inside the tier
        time.sleep(0.005)
    for _ in range(5):  # steps go on; nothing is written or reported while the tier blocks
        assert w.get_finished(set())[1] == set()
    assert not torch.equal(fx.ref_obj(DST), want)
    assert pins(w) == 3  # lookup's pins hold while the load is in flight
    (gate / "open").touch()
    assert poll(w) == {"b"}
    assert torch.equal(fx.ref_obj(DST), want)
    assert w.take_load_errors() == set()
    assert w.take_report().loaded == {"b": {"slow": 24}}
    assert w.get_finished(set())[1] == set()  # reported once
    assert pins(w) == 0
    assert w.storage.contains(w.key(HASHES[0])) == "local_cpu"  # promoted into L1


def test_cancelled_load_never_writes_and_leaks_nothing(gated):
    fx, w, gate, want = gated
    start(w)
    wait_until(lambda: list(gate.glob("entered-*")), "the fetch to reach the tier", HANG_S)
    poisoned = fx.ref_obj(DST).clone()
    assert w.get_finished({"b"})[1] == {"b"}  # vLLM finished (aborted) it: reported at once
    assert pins(w) == 0
    (gate / "open").touch()  # the fetch ends after the abort ...
    wait_until(lambda: w.storage.stats()["local_cpu"]["entries"] >= 3,  # ... and promotes
               "the cancelled fetch to promote its chunks into L1", HANG_S)
    time.sleep(0.1)  # a late write into the blocks (the defect this checks) would show here
    assert w.get_finished(set())[1] == set()
    assert torch.equal(fx.ref_obj(DST), poisoned)  # no block written after the abort
    assert len(w._background) == 0 and w.take_load_errors() == set()
    w.storage.evict(tiers=["local_cpu"], nbytes=1 << 30)  # only L1 still holds the objects:
    l1 = w.storage.stats()["local_cpu"]  # once evicted, every byte is back in the pool
    assert (l1["entries"], l1["pool_used"]) == (0, 0)


def test_a_tier_that_never_answers_is_a_load_error(tmp_path):
    fx = KVFixture("LBHNC", torch.bfloat16, L=3, B=16)
    gate = tmp_path / "gate"
    gate.mkdir()  # never opened
    w = _worker(tmp_path, {"backend": "tests.support.tiers_for_tests:GatedTier", "timeout_s": 0.3,
                           "options": {"gate": str(gate), "max_wait_s": HANG_S}}, fx)
    try:
        fx.poison(DST)
        poisoned = fx.ref_obj(DST).clone()
        start(w)
        assert poll(w) == {"b"}  # within the tier's timeout_s (per chunk), not never
        assert w.take_load_errors() == set(DST)  # vLLM recomputes every block
        assert torch.equal(fx.ref_obj(DST), poisoned)
        assert w.take_report().num_failed_blocks == {"b": 6}
        assert pins(w) == 0
    finally:
        (gate / "open").touch()
        w.close()


def test_a_fetch_that_raises_is_a_load_error(tmp_path):
    fx = KVFixture("LBHNC", torch.bfloat16, L=3, B=16)
    w = _worker(tmp_path, {"backend": "tests.support.tiers_for_tests:DictTier"}, fx)
    try:
        def broken(keys):
            raise OSError("disk went away")

        w._background._fetch = broken  # the fetch itself raises (tier faults are misses)
        fx.poison(DST)
        start(w)
        assert poll(w) == {"b"}
        assert w.take_load_errors() == set(DST)
    finally:
        w.close()
