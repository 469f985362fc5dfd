"""Scheduler -> worker lookup over ZeroMQ: "how many leading tokens of this request are stored?".

vLLM runs the scheduler and every worker in separate processes; the tiers (and their pins) live in
the workers. Each worker runs a :class:`LookupService` thread on an ``ipc://`` socket in a private
directory (mode 0700, owned by the user); the scheduler's :class:`LookupClient` asks every TP rank
and takes the minimum. A rank that does not answer within the timeout makes the lookup a miss:
serving never waits on a slow tier. Messages are msgspec/msgpack structs; nothing is pickled.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

logger = logging.getLogger("kvplug.connector")


class Lookup(msgspec.Struct, tag=True):
    """Find the leading run of ``hashes`` (full chunks) that is stored; if all are, try the
    ``tails`` (``(tokens_after, hash)`` partial chunks, longest first). Pin what is found."""

    id: int
    req_id: str
    hashes: list[bytes]
    tails: list[tuple[int, bytes]] = []
    pin: bool = True


class Release(msgspec.Struct, tag=True):
    """Drop the pins held for these requests."""

    req_ids: list[str]


class Reply(msgspec.Struct):
    id: int
    tokens: int


_encode = msgspec.msgpack.Encoder().encode
_decode_msg = msgspec.msgpack.Decoder(Lookup | Release).decode
_decode_reply = msgspec.msgpack.Decoder(Reply).decode


def private_dir() -> Path:
    """``$TMPDIR/kvplug-<uid>``: created 0700; refused if another user owns it or others can
    enter it (a socket there must not be reachable by other users)."""
    d = Path(tempfile.gettempdir()) / f"kvplug-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{d} is not a directory owned by uid {os.getuid()}")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def socket_path(engine_id: str, rank: int) -> Path:
    """The lookup socket of one TP rank of one engine (``engine_id`` is shared by its ranks)."""
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:40] or "engine"
    return private_dir() / f"lookup-{safe}-r{rank}.sock"


class LookupService:
    """A worker-side thread answering :class:`Lookup` and :class:`Release` messages."""

    def __init__(
        self,
        path: Path,
        on_lookup: Callable[[Lookup], int],
        on_release: Callable[[list[str]], None],
    ) -> None:
        self.path = path
        self._on_lookup = on_lookup
        self._on_release = on_release
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if path.exists():
            path.unlink()  # a stale socket of a crashed run with the same engine id
        self._sock.bind(f"ipc://{path}")
        os.chmod(path, 0o600)
        self._thread = threading.Thread(target=self._run, name="kvplug-lookup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, payload = self._sock.recv_multipart()
            try:
                msg = _decode_msg(payload)
            except msgspec.DecodeError:
                logger.warning("kvplug lookup service dropped a malformed message")
                continue
            if isinstance(msg, Release):
                self._on_release(msg.req_ids)
                continue
            try:
                tokens = self._on_lookup(msg)
            except Exception:  # a failing tier: answer a miss, keep serving
                logger.exception("kvplug lookup of %s failed; answering a miss", msg.req_id)
                tokens = 0
            self._sock.send_multipart([ident, _encode(Reply(msg.id, tokens))])
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.term()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class LookupClient:
    """The scheduler's side: ask every rank, answer the minimum, or 0 past ``timeout_s``."""

    def __init__(self, paths: list[Path], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._paths = paths
        self._socks: list[zmq.Socket] = []
        for p in paths:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{p}")
            self._socks.append(s)
        self._next_id = 0
        self.timeouts = 0

    def lookup(self, req_id: str, hashes: list[bytes], tails: list[tuple[int, bytes]]) -> int:
        """Leading stored tokens (minimum over ranks); 0 when any rank is late or absent."""
        if not hashes and not tails:
            return 0
        self._next_id += 1
        mid = self._next_id
        payload = _encode(Lookup(mid, req_id, hashes, tails))
        try:
            for s in self._socks:
                s.send(payload, zmq.NOBLOCK)
        except zmq.Again:  # a rank's queue is full: it is not reading, so it is a miss
            self.timeouts += 1
            return 0
        answers: dict[int, int] = {}
        deadline = time.monotonic() + self.timeout_s
        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        while len(answers) < len(self._socks):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for s, _ in poller.poll(left * 1000):
                reply = _decode_reply(s.recv())
                if reply.id == mid:  # older, late replies are dropped here
                    answers[self._socks.index(s)] = reply.tokens
        if len(answers) < len(self._socks):
            self.timeouts += 1
            missing = [str(self._paths[i]) for i in range(len(self._socks)) if i not in answers]
            logger.warning("kvplug lookup of %s timed out after %.2fs (no answer from %s); "
                           "treating it as a miss", req_id, self.timeout_s, ", ".join(missing))
            self.release([req_id])
            return 0
        return min(answers.values())

    def release(self, req_ids: list[str]) -> None:
        """Tell every rank to drop the pins of these requests (fire and forget)."""
        if not req_ids:
            return
        payload = _encode(Release(list(req_ids)))
        for s in self._socks:
            try:
                s.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        self._ctx.term()
