"""The management wire (``kvplug.connector.protocol.manage``): its messages as msgpack, a
:class:`ManageService` on a real unix socket answering each message with what its handler
returns (or an error naming what went wrong, the service living on), and a
:class:`ManageClient` asking every rank at once: one reply per rank in rank order, a rank that
does not answer an error naming its socket."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq

pytest.importorskip("vllm")

from kvplug.connector.protocol.manage import (  # noqa: E402
    MAX_MANAGE_HASHES,
    ManageClear,
    ManageClient,
    ManageLookup,
    ManagePin,
    ManageReply,
    ManageService,
    ManageStatus,
    client_for,
    manage_path,
)

HANG = 30.0  # seconds: a reply that never comes (a hang, not a speed check)


@pytest.fixture
def sock_dir():
    """A short private directory for sockets (a unix socket path is at most ~107 bytes; pytest's
    tmp_path can be longer)."""
    d = Path(tempfile.mkdtemp(prefix="kvm-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Echo:
    """A worker's handler: what it was asked, with its rank; records every message."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen: list[object] = []

    def __call__(self, msg):
        self.seen.append(msg)
        if isinstance(msg, ManageClear) and msg.tenant == "boom":
            raise ValueError("no such tier 'x'")
        return {"rank": self.rank, "kind": type(msg).__name__,
                "hashes": [h.hex() for h in getattr(msg, "hashes", None) or []]}


def random_hashes(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(n)]


def test_each_message_crosses_the_socket_whole_and_is_answered_in_rank_order(sock_dir):
    rng = random.Random(1)
    handlers = [Echo(r) for r in range(3)]
    services = [ManageService(sock_dir / f"r{r}.sock", h) for r, h in enumerate(handlers)]
    try:
        client = ManageClient([s.path for s in services], timeout_s=HANG)
        hashes = random_hashes(rng, 5)
        msgs = [ManageLookup(hashes, [(3, hashes[0])], tenant="t1"),
                ManageClear(["ram"], hashes[:2], tenant="t2"),
                ManagePin(hashes[1:], optional=[hashes[0]], tiers=None, pin=False),
                ManageStatus(),
                ManageClear(by_tenant=True, tenant="t3")]
        for msg in msgs:
            replies = client.ask(msg)
            assert [r.ok for r in replies] == [True] * 3, replies
            assert [r.body["rank"] for r in replies] == [0, 1, 2]
            assert {r.body["kind"] for r in replies} == {type(msg).__name__}
        for h in handlers:  # each rank got each message once, in order, field for field
            assert h.seen == msgs
    finally:
        for s in services:
            s.close()
    assert not any(s.path.exists() for s in services)  # close removes the socket


def test_a_handler_error_is_an_error_reply_and_the_service_lives_on(sock_dir):
    h = Echo(0)
    service = ManageService(sock_dir / "m.sock", h)
    try:
        client = ManageClient([service.path], timeout_s=HANG)
        (bad,) = client.ask(ManageClear(tenant="boom"))
        assert not bad.ok and bad.error == "ValueError: no such tier 'x'" and bad.body == {}
        (good,) = client.ask(ManageStatus())
        assert good.ok and good.body["kind"] == "ManageStatus"
    finally:
        service.close()


def test_malformed_and_oversized_messages_are_error_replies_never_handled(sock_dir):
    h = Echo(0)
    service = ManageService(sock_dir / "m.sock", h)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{service.path}")
        rng = random.Random(2)
        garbage = [rng.randbytes(40), msgspec.msgpack.encode({"type": "ManageDrop"}),
                   msgspec.msgpack.encode({"type": "ManageLookup", "hashes": "nope"})]
        for payload in garbage:
            s.send(payload)
            assert s.poll(HANG * 1000), "no answer to a malformed message"
            reply = msgspec.msgpack.decode(s.recv(), type=ManageReply)
            assert not reply.ok and reply.error.startswith("malformed management message")
        too_many = ManageLookup([b"h" * 32] * (MAX_MANAGE_HASHES - 1), [(1, b"t" * 32)] * 2)
        s.send(msgspec.msgpack.encode(too_many))
        assert s.poll(HANG * 1000)
        reply = msgspec.msgpack.decode(s.recv(), type=ManageReply)
        assert not reply.ok and f"{MAX_MANAGE_HASHES + 1} chunk hashes" in reply.error
        assert h.seen == []  # none reached the handler
        # the negative control: exactly the bound is handled
        (ok,) = ManageClient([service.path], timeout_s=HANG).ask(
            ManageLookup([b"h" * 32] * MAX_MANAGE_HASHES))
        assert ok.ok and len(h.seen) == 1
    finally:
        s.close(0)
        ctx.term()
        service.close()


def test_a_rank_that_does_not_answer_is_an_error_naming_it_the_others_answer(sock_dir):
    live = [ManageService(sock_dir / "r0.sock", Echo(0)), None,
            ManageService(sock_dir / "r2.sock", Echo(2))]
    # rank 1: a socket nobody serves (bound, never read: as a worker stuck in a long call)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"ipc://{sock_dir / 'r1.sock'}")
    paths = [sock_dir / f"r{r}.sock" for r in range(3)]
    try:
        start = time.monotonic()
        replies = ManageClient(paths, timeout_s=3.0).ask(ManageStatus())  # the live: at once
        assert time.monotonic() - start < HANG  # bounded by the client's timeout
        assert [r.ok for r in replies] == [True, False, True]
        assert replies[0].body["rank"] == 0 and replies[2].body["rank"] == 2
        assert str(paths[1]) in replies[1].error and "no answer" in replies[1].error
        assert str(paths[0]) not in replies[1].error
    finally:
        silent.close(0)
        ctx.term()
        for s in live:
            if s is not None:
                s.close()


def test_a_client_of_an_engine_asks_every_tp_and_pp_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    engine = f"e-{os.getpid()}-{random.Random().randrange(1 << 30)}"
    c = client_for(engine, tp=2, pp=3, timeout_s=5)
    assert c.timeout_s == 5
    assert c.paths == [manage_path(engine, r, p) for p in range(3) for r in range(2)]
    assert len(set(c.paths)) == 6
    assert all(p.name.startswith("manage-") for p in c.paths)
    assert manage_path(engine, 0).name != manage_path(engine + "x", 0).name
