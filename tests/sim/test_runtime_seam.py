"""Backend threads and clocks come from ``TierContext.runtime`` (kvplug.runtime): under the
simulation's runtime a tier starts no thread of its own, its background work is a task the
simulation runs when it says so, and the clocks it reads are the simulation's. Every thread
started is recorded (short-lived ones too), every real clock kvplug reads during a seed."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

import pytest
from kvplug.connector.sim.runtime import SimRuntime


@pytest.fixture
def started(monkeypatch):
    names: list[str] = []
    real_start = threading.Thread.start

    def start(self):
        names.append(self.name)
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return names


def test_l1_pool_prefault_is_a_runtime_task(started):
    from kvplug.pool import HostMemoryPool

    runtime = SimRuntime()
    pool = HostMemoryPool(1 << 20, pin_memory=False, runtime=runtime)
    assert not pool.populated.is_set() and len(runtime.queue) == 1  # queued, not run
    runtime.drain()
    assert pool.populated.is_set() and pool._frontier.backed == 1 << 20
    obj = pool.allocate((4096,))
    assert obj is not None and not runtime.queue  # the whole pool is backed: nothing more to do
    obj.ref_down()
    assert started == []


def test_mooncake_client_setup_is_a_runtime_task(started, monkeypatch):
    """Mooncake's client is set up as the tier starts, off the caller's thread (its first
    request must not pay the set-up): a daemon task of the tier's runtime."""
    from kvplug.backends.common.breaker import CircuitBreaker
    from kvplug.backends.mooncake import client
    from kvplug.backends.mooncake.backend import MooncakeBackend
    from kvplug.redact import Redactor

    calls: list[str] = []

    class FakeStore:  # stands for MooncakeDistributedStore: records the set-up
        def setup(self, *args):
            calls.append("setup")
            return 0

        def register_buffer(self, address, nbytes):
            return 0

    monkeypatch.setattr(client, "_store_class", lambda: FakeStore)
    opts = MooncakeBackend.Options(master="127.0.0.1:50051")
    runtime = SimRuntime()
    io = client.MooncakeIO("mc", opts, CircuitBreaker("mc"), Redactor({}), runtime=runtime)
    assert calls == [] and not io.set_up and len(runtime.queue) == 1
    runtime.drain()
    assert calls == ["setup"] and io.set_up
    assert started == []


def test_step_stats_never_wait_on_a_hung_tier(tmp_path):
    """vLLM asks the workers for their stats in every step (``get_kv_connector_stats``). The
    tiers' bytes per tenant are sampled on a thread of their own: a disk tier that does not
    answer (its pool gated, every call timing out) costs the engine thread nothing; the sampler's
    thread waits it out. Before, ``take_stats`` asked each tier on the engine thread: 5 s
    (posix's ``timeout_s``) of the step (simulation seed 1, I10)."""
    import uuid

    import torch
    from kvplug.connector.protocol.config import ConnectorConfig
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.worker.side import WorkerSide

    from tests.support.gpu_kv_fixture import KVFixture

    pytest.importorskip("vllm")
    runtime = SimRuntime()
    cfg = ConnectorConfig(chunk_size=8, log_every_load=False, tiers=[
        {"backend": "local_cpu", "options": {"capacity": "1MiB", "prefault": True}},
        {"backend": "posix", "options": {"path": str(tmp_path / "disk"), "io_threads": 1}}])
    w = WorkerSide(cfg, Identity("m", "LBHNC-bs4", 1, 0, f"t-{uuid.uuid4().hex[:8]}"),
                   runtime=runtime)
    w.register_kv_caches(KVFixture("LBHNC", torch.bfloat16, L=2, B=8).caches)
    runtime.drain()
    disk = next(t for t in w.storage._tiers if t.name == "posix")
    disk.pool.gated = True  # the disk hangs
    try:
        with runtime.engine_thread(0, "get_kv_connector_stats"):
            w.take_stats()
        assert runtime.engine_waited == 0.0 and runtime.engine_waits == []
        sampler = [f for f in runtime.queue if f.pool.name == "kvplug-tenant-stats"]
        assert len(sampler) == 1  # the sample is the sampler's task
        clock = runtime.clock
        runtime.drain()  # its own thread waits out the hung disk
        assert runtime.clock == clock + disk.config.timeout_s and disk.timeouts == 1
        assert runtime.engine_waited == 0.0
    finally:
        disk.pool.gated = False
        runtime.drain()
        w.close()


#: the clocks that order or time out what kvplug does (perf_counter and thread_time measure
#: durations for stats, and a rescan's CPU cost)
CLOCKS = ("time", "monotonic", "time_ns", "monotonic_ns")


def test_kvplug_reads_no_real_clock_under_the_simulation(monkeypatch):
    """While seeds run, no kvplug module outside the simulation reads a real clock: one would
    make a seed's outcome depend on how fast the machine runs, so a seed found in a long
    search might not replay alone (posix stamped its LRU with ``time.time()``: ties in the
    same millisecond decided what a rescan evicted). Calls are recorded, the real value
    returned; a clock bound before the test (a default argument) is not seen."""
    pytest.importorskip("vllm")
    from kvplug.connector.sim.schedule import run_seed

    reads: Counter[str] = Counter()
    for name in CLOCKS:
        real = getattr(time, name)

        def read(real=real, name=name):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("kvplug.") and not module.startswith("kvplug.connector.sim"):
                reads[f"{module}:{caller.f_lineno} time.{name}()"] += 1
            return real()

        monkeypatch.setattr(time, name, read)
    runs = [run_seed(seed, n=20) for seed in range(12)]
    assert sum(o.counts.get("posix rescans", 0) for o in runs) > 0  # the path that read one
    assert not reads, dict(reads)
