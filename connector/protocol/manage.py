"""Management calls from the API server to the workers that hold the tiers (lookup, clear, pin,
status).

vLLM's OpenAI server, its engine core (the scheduler) and its workers are separate processes; the
tiers live in the workers. Beside its lookup socket (:mod:`.lookup`), every worker serves a
*management* socket in the same private directory (0700; the socket 0600), named by the same
hash of (engine id, PP rank, TP rank) with a ``manage-`` prefix: :class:`ManageService`, on its
own thread, so a slow clear of a remote tier never delays the scheduler's lookups. The API
server's :class:`ManageClient` asks every rank (the engine id and the TP x PP sizes come from the
``VllmConfig`` vLLM hands it) and gets one :class:`ManageReply` per rank, or an error naming the
rank that did not answer. Messages are msgspec/msgpack structs; nothing is pickled; a malformed
message is answered with an error, never fatal to the service.

This module is the wire only: what each call does to a worker's tiers is
:mod:`..worker.management` (over :mod:`kvplug.management`, one rule for the engine and for
``kvplug cache ... --config``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from .lookup import RouterService, socket_path

logger = logging.getLogger("kvplug.connector")

#: how long the API server waits for a worker's answer: under the 60 s that HTTP proxies in
#: front of vLLM commonly allow a response (nginx's ``proxy_read_timeout``) and the 120 s of
#: ``kvplug cache ... --url``, so the caller gets the API's 503 naming the rank, not a proxy's
#: 504 (a clear still running past it goes on in the worker; the 503 says so)
MANAGE_TIMEOUT_S = 20.0
#: hashes one management message may name (a clear of a prefix names a chunk per block end)
MAX_MANAGE_HASHES = 65536


class ManageLookup(msgspec.Struct, tag=True):
    """Which leading tokens each tier holds of the chunks ``hashes`` (full chunks, in order) and
    ``tails`` (``(tokens_after, hash)``: the partial chunks ending at each block end), keyed for
    tenant id ``tenant`` (the request's, as the scheduler sends it)."""

    hashes: list[bytes]
    tails: list[tuple[int, bytes]] = []
    tenant: str = ""


class ManageClear(msgspec.Struct, tag=True):
    """Drop ``hashes``' chunks (keyed for tenant id ``tenant``), or with ``hashes`` None every
    entry (with ``by_tenant``, every entry of tenant id ``tenant``), from ``tiers`` (None: every
    tier)."""

    tiers: list[str] | None = None
    hashes: list[bytes] | None = None
    tenant: str = ""
    by_tenant: bool = False


class ManagePin(msgspec.Struct, tag=True):
    """An operator's pin (``pin`` True) or unpin of ``hashes``' chunks (full chunks) and
    ``optional`` ones (partial chunks, pinned where held) on ``tiers`` (None: every tier), keyed
    for tenant id ``tenant``."""

    hashes: list[bytes]
    optional: list[bytes] = []
    tiers: list[str] | None = None
    pin: bool = True
    tenant: str = ""


class ManageStatus(msgspec.Struct, tag=True):
    """The worker's tiers: capacity, use, breakers, pins, policies."""


class ManageReply(msgspec.Struct):
    ok: bool
    body: dict[str, Any] = {}
    error: str = ""


ManageMsg = ManageLookup | ManageClear | ManagePin | ManageStatus
_encode = msgspec.msgpack.Encoder().encode
_decode_msg = msgspec.msgpack.Decoder(ManageMsg).decode
_decode_reply = msgspec.msgpack.Decoder(ManageReply).decode


def manage_path(engine_id: str, rank: int, pp_rank: int = 0) -> Path:
    """The management socket of one worker (beside its lookup socket)."""
    return socket_path(engine_id, rank, pp_rank, prefix="manage")


class ManageService(RouterService):
    """A worker-side thread answering management messages on ``path`` (a zmq ROUTER)."""

    def __init__(self, path: Path, handle: Callable[[ManageMsg], dict[str, Any]]) -> None:
        self._handle = handle
        super().__init__(path, "management")

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) == 2:  # [client identity, request]
            self._sock.send_multipart([frames[0], self._encoded(self._answer(frames[1]))])

    def _encoded(self, reply: ManageReply) -> bytes:
        """The reply's bytes; an answer msgpack cannot encode (a value that is no plain data)
        is answered as an error at once, never dropped (the caller would wait its whole
        timeout for nothing)."""
        try:
            return _encode(reply)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            logger.exception("kvplug management answer could not be encoded")
            return _encode(ManageReply(False, error=f"the worker's answer could not be encoded "
                                                    f"({type(exc).__name__}: {exc})"))

    def _answer(self, payload: bytes) -> ManageReply:
        try:
            msg = _decode_msg(payload)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            return ManageReply(False, error=f"malformed management message ({exc})")
        hashes = sum(len(getattr(msg, f, None) or ()) for f in ("hashes", "tails", "optional"))
        if hashes > MAX_MANAGE_HASHES:
            return ManageReply(False, error=f"{hashes} chunk hashes in one call; at most "
                                            f"{MAX_MANAGE_HASHES}: split the prompt")
        try:
            return ManageReply(True, self._handle(msg))
        except Exception as exc:  # noqa: BLE001 - an answer, never a dead service
            logger.exception("kvplug management call %s failed", type(msg).__name__)
            return ManageReply(False, error=f"{type(exc).__name__}: {exc}")

class ManageClient:
    """The API server's side: send one message to every rank, wait for each reply (bounded)."""

    def __init__(self, paths: list[Path], timeout_s: float = MANAGE_TIMEOUT_S) -> None:
        self.paths = paths
        self.timeout_s = timeout_s

    def ask(self, msg: ManageMsg) -> list[ManageReply]:
        """One reply per rank, in rank order; a rank that did not answer in ``timeout_s`` is an
        error reply naming its socket."""
        ctx = zmq.Context()
        socks = []
        try:
            for p in self.paths:
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"ipc://{p}")
                s.send(_encode(msg))
                socks.append(s)
            replies: dict[int, ManageReply] = {}
            poller = zmq.Poller()
            for s in socks:
                poller.register(s, zmq.POLLIN)
            end = time.monotonic() + self.timeout_s
            while len(replies) < len(socks) and (left := end - time.monotonic()) > 0:
                for s, _ in poller.poll(left * 1000):
                    i = socks.index(s)
                    try:
                        replies[i] = _decode_reply(s.recv(zmq.NOBLOCK))
                    except msgspec.DecodeError as exc:
                        replies[i] = ManageReply(False, error=f"malformed reply ({exc})")
                    poller.unregister(s)
            return [replies.get(i) or ManageReply(
                False, error=f"no answer from the worker at {p} within {self.timeout_s:g}s "
                             "(is the engine up, with kvplug's connector? A clear or pin may "
                             "still be running there: ask status again)")
                for i, p in enumerate(self.paths)]
        finally:
            for s in socks:
                s.close(0)
            ctx.term()


def client_for(engine_id: str, tp: int, pp: int,
               timeout_s: float = MANAGE_TIMEOUT_S) -> ManageClient:
    """A client of every worker (TP x PP) of engine ``engine_id``."""
    return ManageClient([manage_path(engine_id, r, p) for p in range(pp) for r in range(tp)],
                        timeout_s)


__all__ = ["MANAGE_TIMEOUT_S", "ManageClear", "ManageClient", "ManageLookup", "ManagePin", "ManageReply",
           "ManageService", "ManageStatus", "client_for", "manage_path"]
