"""The scheduler->worker lookup over ZeroMQ (no engine): minimum over ranks, pins replaced on a
repeated lookup, a late worker is a miss (never a hang), the socket directory is private, socket
names never collide, malformed messages never kill the service, expired lookups are skipped, and
the scheduler never blocks on a stalled lookup."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq
from kvplug.connector.protocol.lookup import (
    MAX_LOOKUP_CHUNKS,
    Lookup,
    LookupClient,
    LookupService,
    Reply,
    private_dir,
    socket_path,
)

HANG_S = 30  # only to turn a hang into a failure; never reached when things work


class FakeWorker:
    """Answers ``tokens_per_hash`` per hash and pins them; the first lookup may wait on ``gate``."""

    def __init__(self, tokens_per_hash: int, delay: float = 0.0,
                 gate: threading.Event | None = None) -> None:
        self.tokens_per_hash = tokens_per_hash
        self.delay = delay
        self.gate = gate
        self.calls: list[str] = []
        self.pins: dict[str, int] = {}
        self.released: list[str] = []
        self.lock = threading.Lock()

    def on_lookup(self, msg):
        self.calls.append(msg.req_id)
        if self.gate is not None:
            assert self.gate.wait(HANG_S)
        time.sleep(self.delay)
        with self.lock:
            self.pins[msg.req_id] = len(msg.hashes)
        return self.tokens_per_hash * len(msg.hashes)

    def on_release(self, req_ids):
        with self.lock:
            self.released.extend(req_ids)
            for r in req_ids:
                self.pins.pop(r, None)


@pytest.fixture
def engine_id():
    return f"test-{uuid.uuid4().hex[:12]}"


def start(engine_id, workers):
    return [LookupService(socket_path(engine_id, r), w.on_lookup, w.on_release)
            for r, w in enumerate(workers)]


def ask(client, req_id, hashes, tails=()):
    """Ask until the lookup is answered (a hit, or a miss past its deadline)."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        got = client.lookup(req_id, list(hashes), list(tails))
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError(f"lookup of {req_id} never completed")


def test_minimum_over_ranks_and_release(engine_id):
    workers = [FakeWorker(256), FakeWorker(128)]
    services = start(engine_id, workers)
    client = LookupClient([socket_path(engine_id, r) for r in range(2)], timeout_s=5)
    try:
        assert ask(client, "a", [b"x" * 32] * 3) == 384
        assert ask(client, "a", [b"x" * 32] * 3) == 384  # repeatable
        assert client.lookup("b", [], []) == 0  # nothing to ask
        client.release(["a"])
        assert ask(client, "barrier", [b"x" * 32]) == 128  # the release was handled before it
        assert all("a" in w.released and "a" not in w.pins for w in workers)
    finally:
        client.close()
        for s in services:
            s.close()


def test_late_worker_is_a_miss_not_a_hang(engine_id):
    gate = threading.Event()  # rank 1 answers only once the client has given up on it
    workers = [FakeWorker(256), FakeWorker(256, gate=gate)]
    services = start(engine_id, workers)
    client = LookupClient([socket_path(engine_id, r) for r in range(2)], timeout_s=1.0)
    try:
        assert ask(client, "slow", [b"y" * 32]) == 0
        assert client.timeouts == 1
        gate.set()  # rank 1 finishes "slow" too late: it releases the pins, sends no answer
        end = time.monotonic() + HANG_S
        while services[1].expired < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert workers[1].calls == ["slow"] and "slow" in workers[1].released
        assert services[1].expired == 1
        assert ask(client, "next", [b"y" * 32] * 2) == 512
    finally:
        client.close()
        for s in services:
            s.close()


def test_absent_worker_is_a_miss(engine_id):
    client = LookupClient([socket_path(engine_id, 0)], timeout_s=0.2)
    try:
        assert ask(client, "r", [b"z" * 32]) == 0
    finally:
        client.close()


def test_socket_directory_is_private(engine_id):
    d = private_dir()
    st = d.stat()
    assert st.st_uid == os.getuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    service = LookupService(socket_path(engine_id, 0), lambda m: 0, lambda r: None)
    try:
        assert socket_path(engine_id, 0).parent == d
        assert stat.S_IMODE(socket_path(engine_id, 0).stat().st_mode) & 0o077 == 0
    finally:
        service.close()
    assert not socket_path(engine_id, 0).exists()


# -- names that cannot collide, sockets that are never stolen ----------------------------------

def test_dp_pp_tp_ranks_and_long_ids_never_share_a_socket():
    base = str(uuid.uuid4())  # vLLM's engine id: a uuid, "_dp<rank>" appended per DP replica
    paths = {socket_path(f"{base}_dp{dp}", 0) for dp in range(20)}
    assert len(paths) == 20, "data-parallel ranks share a lookup socket"
    grid = {socket_path(base, tp, pp_rank=pp, dp_rank=dp)
            for tp in range(3) for pp in range(3) for dp in range(3)}
    assert len(grid) == 27
    assert socket_path(base, 1, pp_rank=2, dp_rank=3) == socket_path(base, 1, pp_rank=2, dp_rank=3)


def test_a_live_socket_is_never_taken_over(engine_id):
    first = FakeWorker(256)
    (service,) = start(engine_id, [first])
    client = LookupClient([socket_path(engine_id, 0)], timeout_s=5)
    try:
        with pytest.raises(RuntimeError, match="in use"):
            LookupService(socket_path(engine_id, 0), lambda m: 0, lambda r: None)
        assert ask(client, "a", [b"x" * 32]) == 256  # the first worker still answers
        assert first.calls == ["a"]
    finally:
        client.close()
        service.close()


def assert_one_worker_answers(engine_id, path):
    """A worker started for ``engine_id`` (rank 0) binds ``path`` and answers a lookup there."""
    (service,) = start(engine_id, [FakeWorker(256)])
    client = LookupClient([path], timeout_s=5)
    try:
        assert ask(client, "a", [b"x" * 32]) == 256
    finally:
        client.close()
        service.close()


def test_a_stale_socket_is_replaced(engine_id):
    path = socket_path(engine_id, 0)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # a crashed worker's socket file: nobody accepts on it
    dead.close()
    assert path.exists()
    assert_one_worker_answers(engine_id, path)


def test_long_tmpdir_falls_back_to_a_short_private_dir(engine_id, monkeypatch, tmp_path):
    long_dir = tmp_path / ("t" * 60) / ("u" * 60)
    long_dir.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    path = socket_path(engine_id, 0)
    assert len(str(path)) <= 107
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.parent.stat().st_uid == os.getuid()
    assert_one_worker_answers(engine_id, path)


# -- a service that never dies, lookups that expire --------------------------------------------

def test_malformed_messages_are_dropped_and_the_service_keeps_answering(engine_id):
    (service,) = start(engine_id, [FakeWorker(256)])
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"ipc://{socket_path(engine_id, 0)}")
    try:
        raw.send_multipart([b"one", b"frame too many"])  # 3 frames at the ROUTER
        raw.send_multipart([b"a", b"b", b"c"])  # 4 frames
        raw.send(b"")  # empty payload
        raw.send(os.urandom(64))  # random bytes
        raw.send(msgspec.msgpack.encode(Reply(1, 2)))  # valid msgpack, wrong message type
        raw.send(msgspec.msgpack.encode(Lookup(7, "ok", [b"x" * 32] * 2)))
        assert raw.poll(HANG_S * 1000), "the lookup service died on a malformed message"
        assert msgspec.msgpack.decode(raw.recv(), type=Reply) == Reply(7, 512)
        assert service.dropped == 5
    finally:
        raw.close(0)
        ctx.term()
        service.close()


def test_expired_lookups_are_skipped_by_the_worker(engine_id):
    gate = threading.Event()
    worker = FakeWorker(256, gate=gate)
    (service,) = start(engine_id, [worker])
    client = LookupClient([socket_path(engine_id, 0)], timeout_s=0.3, wait_s=0)
    try:
        client.lookup("A", [b"a" * 32], [])  # stalls in the worker
        assert ask(client, "B", [b"b" * 32]) == 0  # queued behind A: the caller gives up
        assert ask(client, "C", [b"c" * 32]) == 0
        assert ask(client, "A", [b"a" * 32]) == 0
        gate.set()
        worker.gate = None
        assert ask(client, "D", [b"d" * 32] * 2) == 512
        assert worker.calls == ["A", "D"], "the worker spent its tier on abandoned lookups"
        assert service.expired == 3  # A answered too late (its pins dropped), B and C skipped
        assert "A" in worker.released and "A" not in worker.pins
        assert client.timeouts == 3
    finally:
        gate.set()
        client.close()
        service.close()


# -- the scheduler side: never blocks on a stalled lookup; pins of a hit not taken are dropped ---

def scheduler_with(model_dir, engine_id, worker, timeout_s, wait_s=0.0):
    """A real vLLM Scheduler whose kvplug connector asks a real lookup service over zmq."""
    from tests.support.vllm_helpers import make_scheduler

    s = make_scheduler(model_dir)
    side = s.connector.scheduler_side
    side.lookup.close()
    (service,) = start(engine_id, [worker])
    side.lookup = LookupClient([socket_path(engine_id, 0)], timeout_s=timeout_s, wait_s=wait_s)
    return s, side, service


def test_scheduler_returns_none_while_the_lookup_stalls_then_the_hit(model_dir, engine_id):
    from tests.support.vllm_helpers import make_request, prompt

    gate = threading.Event()
    worker = FakeWorker(256, gate=gate)
    s, side, service = scheduler_with(model_dir, engine_id, worker, timeout_s=HANG_S * 2)
    r = make_request("s", prompt(1100, 1))
    got: list = []
    caller = threading.Thread(
        target=lambda: got.append((side.get_num_new_matched_tokens(r, 0), gate.is_set())))
    try:
        caller.start()
        caller.join(HANG_S / 2)
        assert not caller.is_alive(), "get_num_new_matched_tokens blocked on a stalled lookup"
        assert got == [((None, False), False)]  # "ask again", returned while the worker stalls
        gate.set()
        end = time.monotonic() + HANG_S
        while (answer := side.get_num_new_matched_tokens(r, 0)) == (None, False):
            assert time.monotonic() < end, "the answer was never picked up"
            time.sleep(0.01)
        assert answer == (1024, False)
        assert worker.calls == ["s"]  # asking again did not start a second lookup
        assert side.stats.totals()["lookups"] == 1
    finally:
        gate.set()
        caller.join(HANG_S)
        side.lookup.close()
        service.close()


def test_lookup_timeouts_are_counted(model_dir, engine_id):
    from tests.support.vllm_helpers import make_request, prompt

    gate = threading.Event()
    s, side, service = scheduler_with(model_dir, engine_id, FakeWorker(256, gate=gate), 0.2)
    r = make_request("t", prompt(1100, 2))
    try:
        end = time.monotonic() + HANG_S
        while (answer := side.get_num_new_matched_tokens(r, 0)) == (None, False):
            assert time.monotonic() < end
            time.sleep(0.01)
        assert answer == (0, False)
        assert side.stats.totals().get("lookup_timeouts", 0) == 1
    finally:
        gate.set()
        side.lookup.close()
        service.close()


def test_a_hit_vllm_does_not_take_releases_its_pins_at_once(model_dir, engine_id):
    """vLLM drops the connector's hit for a request with prompt logprobs (it must compute every
    prompt token): update_state_after_alloc gets 0 tokens, and the pins go at once, while the
    request runs. The control, a request that takes its hit, keeps its pins for the load."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from tests.support.vllm_helpers import make_request, prompt

    worker = FakeWorker(256)
    s, side, service = scheduler_with(model_dir, engine_id, worker, HANG_S, wait_s=HANG_S)
    try:
        s.add_request(Request("p", prompt(1100, 3), SamplingParams(
            max_tokens=4, ignore_eos=True, prompt_logprobs=1), None))
        s.add_request(make_request("n", prompt(1100, 4)))
        scheduler_output = s.schedule()
        assert scheduler_output.num_scheduled_tokens == {"p": 1100, "n": 1100 - 1024}
        assert ask(side.lookup, "barrier", [b"x" * 32]) == 256  # releases sent before are done
        assert "p" in worker.released and "p" not in worker.pins
        assert "n" not in worker.released and worker.pins["n"] == 4
    finally:
        side.lookup.close()
        service.close()


# -- a hostile local user: a pre-created directory, a flood of pins ----------------------------

@pytest.fixture
def short_tmp(monkeypatch):
    """A private, short ``$TMPDIR`` of this test (the real ``/tmp/kvplug-<uid>`` is shared with
    every other test run on the machine): ``tempfile`` and the lookup module both use it."""
    base = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    os.chmod(base, 0o1777)  # like /tmp: anyone may create entries in it
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("hostile", ["other-owner", "world-writable", "symlink", "file"])
def test_a_precreated_socket_directory_is_not_an_outage(engine_id, short_tmp, hostile, caplog):
    squatted = short_tmp / f"kvplug-{os.getuid()}"
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    if hostile == "other-owner":  # another local user made it first (uid 65534: nobody)
        squatted.mkdir(mode=0o700)
        os.chown(squatted, 65534, 65534)
    elif hostile == "world-writable":
        squatted.mkdir()
        os.chmod(squatted, 0o777)
    elif hostile == "symlink":
        os.symlink(elsewhere, squatted)
    else:
        squatted.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="kvplug.connector"):
        (service,) = start(engine_id, [FakeWorker(256)])
    # the scheduler (another process: it shares nothing but the file system) finds the socket
    client = LookupClient([socket_path(engine_id, 0)], timeout_s=5)
    try:
        assert ask(client, "a", [b"x" * 32]) == 256
        d = service.path.parent
        assert d != squatted and d.parent == short_tmp
        st = d.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
        assert stat.S_IMODE(st.st_mode) == 0o700
        assert not any(elsewhere.iterdir()), "a socket was made through the squatted path"
        assert any(str(squatted) in r.getMessage() for r in caplog.records), "not logged"
    finally:
        client.close()
        service.close()


def test_two_ranks_behind_a_squatted_directory_are_both_found(engine_id, short_tmp):
    squatted = short_tmp / f"kvplug-{os.getuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)
    services = start(engine_id, [FakeWorker(256), FakeWorker(512)])
    client = LookupClient([socket_path(engine_id, r) for r in range(2)], timeout_s=5)
    try:
        assert ask(client, "a", [b"x" * 32, b"y" * 32]) == 512  # the minimum over both ranks
    finally:
        client.close()
        for s in services:
            s.close()


def test_pins_per_request_are_bounded(engine_id):
    worker = FakeWorker(256)
    (service,) = start(engine_id, [worker])
    client = LookupClient([socket_path(engine_id, 0)], timeout_s=5)
    flood = [os.urandom(32) for _ in range(MAX_LOOKUP_CHUNKS + 1000)]
    try:
        got = ask(client, "flood", flood, tails=[(1, os.urandom(32))])
        assert worker.pins["flood"] == MAX_LOOKUP_CHUNKS, "a request pinned past the bound"
        assert got == 256 * MAX_LOOKUP_CHUNKS
        assert service.refused == 1000 + 1
        assert ask(client, "small", [b"x" * 32]) == 256  # a normal request is untouched
        assert worker.pins["small"] == 1 and service.refused == 1001
    finally:
        client.close()
        service.close()


class TieredWorker(FakeWorker):
    """Answers every hash, with the chunks it says only a remote tier (``slow``) or only a local
    medium (``local``) holds."""

    def __init__(self, slow: list[int], local: list[int]) -> None:
        super().__init__(16)
        self.slow, self.local = slow, local

    def on_lookup(self, msg):
        return super().on_lookup(msg), self.slow, self.local


def test_slow_and_local_chunks_are_merged_over_ranks(engine_id):
    """A chunk remote on any rank is slow (a background load); a chunk local on some rank and
    remote on none is local (in the step while its budget lasts)."""
    workers = [TieredWorker([3], [0, 1]), TieredWorker([], [1, 2, 3])]
    services = start(engine_id, workers)
    client = LookupClient([socket_path(engine_id, r) for r in range(2)], timeout_s=5)
    try:
        assert ask(client, "a", [b"x" * 32] * 4) == 64
        assert client.take_slow("a") == {3}
        assert client.take_local("a") == {0, 1, 2}
        assert client.take_local("a") == frozenset()  # taken once
    finally:
        client.close()
        for s in services:
            s.close()
