"""The scheduler->worker lookup over ZeroMQ (no engine): minimum over ranks, pins replaced on a
repeated lookup, a late worker is a miss (never a hang), the socket directory is private."""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid

import pytest
from kvplug.connector.lookup import LookupClient, LookupService, private_dir, socket_path


class FakeWorker:
    def __init__(self, tokens_per_hash: int, delay: float = 0.0) -> None:
        self.tokens_per_hash = tokens_per_hash
        self.delay = delay
        self.pins: dict[str, int] = {}
        self.released: list[str] = []
        self.lock = threading.Lock()

    def on_lookup(self, msg):
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


def test_minimum_over_ranks_and_release(engine_id):
    workers = [FakeWorker(256), FakeWorker(128)]
    services = start(engine_id, workers)
    client = LookupClient([socket_path(engine_id, r) for r in range(2)], timeout_s=5)
    try:
        assert client.lookup("a", [b"x" * 32] * 3, []) == 384
        assert client.lookup("a", [b"x" * 32] * 3, []) == 384  # repeatable
        assert client.lookup("b", [], []) == 0  # nothing to ask
        client.release(["a"])
        deadline = time.monotonic() + 5
        while any("a" not in w.released for w in workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all("a" in w.released and "a" not in w.pins for w in workers)
    finally:
        client.close()
        for s in services:
            s.close()


def test_late_worker_is_a_miss_not_a_hang(engine_id):
    workers = [FakeWorker(256), FakeWorker(256, delay=1.5)]
    services = start(engine_id, workers)
    client = LookupClient([socket_path(engine_id, r) for r in range(2)], timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert client.lookup("slow", [b"y" * 32], []) == 0
        assert time.monotonic() - t0 < 1.0
        assert client.timeouts == 1
        time.sleep(1.6)  # the late answer arrives and must not be taken for the next lookup
        workers[1].delay = 0
        assert client.lookup("next", [b"y" * 32] * 2, []) == 512
    finally:
        client.close()
        for s in services:
            s.close()


def test_absent_worker_is_a_miss(engine_id):
    client = LookupClient([socket_path(engine_id, 0)], timeout_s=0.2)
    try:
        assert client.lookup("r", [b"z" * 32], []) == 0
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
