"""Scheduler -> worker lookup over ZeroMQ: "how many leading tokens of this request are stored?".

vLLM runs the scheduler and every worker in separate processes; the tiers (and their pins) live in
the workers. Each worker runs a :class:`LookupService` thread on an ``ipc://`` socket in a private
directory (mode 0700, owned by the user), named by a hash of (engine id, DP, PP, TP rank); the
scheduler's :class:`LookupClient` asks every rank and takes the minimum. Lookups are asynchronous:
the client answers ``None`` ("ask again") until every rank replied, and a miss once the lookup's
deadline passed, so the scheduler never blocks on a slow tier. Each lookup carries its deadline;
a worker skips lookups whose caller already gave up. Messages are msgspec/msgpack structs; nothing
is pickled, and a malformed message is dropped and counted, never fatal to the service.

The directory is ``$TMPDIR/kvplug-<uid>``; if another local user created that name first (or it
is a link, or open to others), a fresh private ``kvplug-<uid>-XXXXXXXX`` beside it is used instead
(logged), and the scheduler finds each socket in whichever of this user's private directories
holds it, so a squatter is never an outage. Any process of the user can reach the socket, so one
lookup looks up and pins at most :data:`MAX_LOOKUP_CHUNKS` chunks (the excess refused, counted).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
from kvplug.logs import LogOnce

logger = logging.getLogger("kvplug.connector")

#: zmq's ipc:// limit (sockaddr_un.sun_path minus the NUL).
MAX_IPC_PATH = 107
#: the longest socket name under the directory, and what a fresh directory adds to its name
_SOCKET_NAME_LEN = len("/lookup-0123456789abcdef0123.sock")
_FRESH_SUFFIX_LEN = len("-XXXXXXXX")
#: chunks one lookup may look up and pin (4M tokens at chunk_size 256); the rest are refused
MAX_LOOKUP_CHUNKS = 16384
#: partial-chunk tails one lookup may try (one per block of a chunk in practice)
MAX_LOOKUP_TAILS = 256
_dir_warnings = LogOnce(logger)


class Lookup(msgspec.Struct, tag=True):
    """Find the leading run of ``hashes`` (full chunks) that is stored; if all are, try the
    ``tails`` (``(tokens_after, hash)`` partial chunks, longest first). Pin what is found.
    ``deadline`` is the caller's ``time.monotonic()`` (system-wide on Linux) past which it no
    longer waits for the answer."""

    id: int
    req_id: str
    hashes: list[bytes]
    tails: list[tuple[int, bytes]] = []
    pin: bool = True
    deadline: float = float("inf")
    epoch: str = ""  # the scheduler's weights epoch: keys are looked up under it
    tenant: str = ""  # the request's tenant id: keys are looked up under it
    #: chunks another engine announced it is storing (a producer's hand-off): no tier answers
    #: from a miss it remembers (StorageManager.lookup_prefix's ``fresh``)
    fresh: bool = False


class Release(msgspec.Struct, tag=True):
    """Drop the pins held for these requests."""

    req_ids: list[str]


class Reply(msgspec.Struct):
    """``tokens`` stored; ``slow``: indices of the hit's chunks (a tail is the last) found only in
    a tier that may block, whose loads the scheduler makes asynchronous; ``local``: those found
    only on a local medium (a disk tier), loaded in the step while they fit its budget."""

    id: int
    tokens: int
    slow: list[int] = []
    local: list[int] = []


_encode = msgspec.msgpack.Encoder().encode
_decode_msg = msgspec.msgpack.Decoder(Lookup | Release).decode
_decode_reply = msgspec.msgpack.Decoder(Reply).decode


def _is_private(d: Path) -> bool:
    """Whether ``d`` is a real directory (not a link) of this user that no one else can use."""
    try:
        st = d.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _base_and_name() -> tuple[Path, str]:
    """Where the socket directories go (``$TMPDIR``, or ``/tmp`` when ``$TMPDIR`` is too long
    for an ipc socket path: zmq's 107 characters) and the directory's name."""
    name = f"kvplug-{os.getuid()}"
    base = Path(tempfile.gettempdir())
    if len(str(base / name)) + _FRESH_SUFFIX_LEN + _SOCKET_NAME_LEN > MAX_IPC_PATH:
        base = Path("/tmp")
    return base, name


def _fresh_dirs(base: Path, name: str) -> list[Path]:
    """This user's private ``<name>-XXXXXXXX`` directories under ``base`` (made when ``name``
    was taken), by name; others' entries of that shape are ignored."""
    try:
        found = [base / n for n in os.listdir(base) if n.startswith(f"{name}-")]
    except OSError:
        return []
    return sorted(d for d in found if _is_private(d))


def private_dir() -> Path:
    """A directory for lookup sockets that only this user can use: ``$TMPDIR/kvplug-<uid>``
    (0700, created if missing). If that name is taken by something this user cannot trust
    (another user's directory, a link, a file, a directory others may write), an earlier fresh
    directory of this user is reused, else a fresh private one is made beside it (logged);
    never an error, so a squatter cannot stop the worker."""
    base, name = _base_and_name()
    d = base / name
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    if _is_private(d):
        return d
    fresh = _fresh_dirs(base, name)
    chosen = fresh[0] if fresh else Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    _dir_warnings(str(d), "kvplug: %s is not a private directory of uid %d (another local user "
                  "may have created it, or it is a link or open to others); lookup sockets go "
                  "to %s instead. Remove %s to go back to it", d, os.getuid(), chosen, d)
    return chosen


def socket_path(engine_id: str, rank: int, pp_rank: int = 0, dp_rank: int = 0,
                prefix: str = "lookup") -> Path:
    """The lookup socket of one worker: TP ``rank`` of PP stage ``pp_rank`` of DP replica
    ``dp_rank`` of engine ``engine_id``. A hash, so long ids never collide by truncation.
    ``prefix="manage"``: its management socket (:mod:`.manage`).

    Where a socket of that name already is, in one of this user's private directories (a
    worker bound it; the scheduler is asking), that one; else in :func:`private_dir`."""
    ident = f"{engine_id}\0dp{dp_rank}\0pp{pp_rank}\0tp{rank}".encode()
    assert len(prefix) == len("lookup"), prefix  # _SOCKET_NAME_LEN bounds the path
    sock = f"{prefix}-{hashlib.sha256(ident).hexdigest()[:20]}.sock"
    base, name = _base_and_name()
    for d in [base / name, *_fresh_dirs(base, name)]:
        if _is_private(d) and os.path.lexists(d / sock):
            return d / sock
    return private_dir() / sock


def bind_router(path: Path, what: str) -> tuple[zmq.Context, zmq.Socket]:
    """A worker's ROUTER socket bound at ``path`` (owner-only): a stale socket of a crashed run is
    replaced, one a live worker with the same engine id and ranks serves is an error."""
    if path.exists() or path.is_symlink():
        if _is_live(path):
            raise RuntimeError(f"kvplug {what} socket {path} is in use by another live worker "
                               "with the same engine id and ranks")
        path.unlink()  # a stale socket of a crashed run
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{path}")
    os.chmod(path, 0o600)
    return ctx, sock


def serve_router(sock: zmq.Socket, stop: threading.Event,
                 serve: Callable[[list[bytes]], None], what: str) -> None:
    """A service thread's loop: each message's frames to ``serve`` until ``stop`` is set, then
    the socket is closed. The service outlives any one message (an error drops only it)."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        try:
            if poller.poll(100):
                serve(sock.recv_multipart())
        except zmq.ZMQError:
            if stop.is_set():
                break
            logger.exception("kvplug %s service: socket error", what)
        except Exception:  # noqa: BLE001 - the service must outlive any one message
            logger.exception("kvplug %s service: unexpected error; message dropped", what)
    sock.close(0)


class RouterService:
    """A worker-side thread serving the ROUTER socket it binds at ``path`` (:func:`bind_router`):
    each message's frames go to :meth:`_serve` (:func:`serve_router`) until :meth:`close`, which
    also removes the socket. A subclass sets its own state before calling ``__init__``, which
    starts the thread.

    ``inproc`` (a ZeroMQ context and an ``inproc://`` endpoint: the deterministic simulation)
    binds there instead and starts no thread: whoever drives it calls :meth:`serve_pending`."""

    def __init__(self, path: Path, what: str,
                 inproc: tuple[zmq.Context, str] | None = None) -> None:
        self.path = path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if inproc is not None:
            self._ctx, endpoint = inproc
            self._owns_ctx = False
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(endpoint)
            return
        self._owns_ctx = True
        self._ctx, self._sock = bind_router(path, what)
        self._thread = threading.Thread(target=serve_router, name=f"kvplug-{what}", daemon=True,
                                        args=(self._sock, self._stop, self._serve, what))
        self._thread.start()

    def _serve(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def serve_pending(self) -> int:
        """Serve every message waiting now, in order (an unthreaded service); how many."""
        n = 0
        while self._sock.poll(0):
            self._serve(self._sock.recv_multipart())
            n += 1
        return n

    def close(self) -> None:
        self._stop.set()
        if self._thread is None:
            self._sock.close(0)
            return
        self._thread.join(timeout=2)
        self._ctx.term()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _is_live(path: Path) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        s.close()


class LookupService(RouterService):
    """A worker-side thread answering :class:`Lookup` and :class:`Release` messages.

    ``dropped`` counts malformed messages, ``expired`` lookups skipped (or answered too late)
    because their caller had given up, ``refused`` chunks (and tails) past ``max_chunks`` (and
    :data:`MAX_LOOKUP_TAILS`) of one lookup: never looked up nor pinned (the hit is the prefix
    within the bound)."""

    def __init__(
        self,
        path: Path,
        on_lookup: Callable[[Lookup], int | tuple[int, list[int], list[int]]],
        on_release: Callable[[list[str]], None],
        max_chunks: int = MAX_LOOKUP_CHUNKS,
        clock: Callable[[], float] = time.monotonic,
        inproc: tuple[zmq.Context, str] | None = None,
    ) -> None:
        self._on_lookup = on_lookup
        self._on_release = on_release
        self.max_chunks = max_chunks
        self.clock = clock  # the deadlines' clock (the client's: a simulation's own)
        self.dropped = 0
        self.expired = 0
        self.refused = 0
        self._log_once = LogOnce(logger)
        super().__init__(path, "lookup", inproc)

    def _drop(self, why: str) -> None:
        self.dropped += 1
        self._log_once(why, "kvplug lookup service dropped a malformed message (%s); further "
                       "ones are counted, not logged", why)

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return self._drop(f"{len(frames)} frames")
        ident, payload = frames
        try:
            msg = _decode_msg(payload)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bad UTF-8 in a str field
            return self._drop(type(exc).__name__)
        if isinstance(msg, Release):
            self._on_release(msg.req_ids)
            return None
        if self.clock() >= msg.deadline:  # the caller gave up: do not spend a tier on it
            self.expired += 1
            return None
        self._bound(msg)
        try:
            res = self._on_lookup(msg)  # tokens, or (tokens, slow chunks, local chunks)
            tokens, slow, local = res if isinstance(res, tuple) else (res, [], [])
        except Exception:  # a failing tier: answer a miss, keep serving
            logger.exception("kvplug lookup of %s failed; answering a miss", msg.req_id)
            tokens, slow, local = 0, [], []
        if self.clock() >= msg.deadline:  # too late: nobody will use these pins
            self.expired += 1
            self._on_release([msg.req_id])
            return None
        self._sock.send_multipart([ident, _encode(Reply(msg.id, tokens, slow, local))])
        return None

    def _bound(self, msg: Lookup) -> None:
        """Cut a lookup to ``max_chunks`` chunks and :data:`MAX_LOOKUP_TAILS` tails (tails only
        follow a complete run of chunks, so a cut drops them all); counted, logged once."""
        over = len(msg.hashes) - self.max_chunks
        tails = len(msg.tails) if over > 0 else max(0, len(msg.tails) - MAX_LOOKUP_TAILS)
        if over <= 0 and not tails:
            return
        self._log_once("bound", "kvplug lookup of %s asked for %d chunks and %d tails; only %d "
                       "and %d are looked up and pinned (further cuts are counted, not logged)",
                       msg.req_id, len(msg.hashes), len(msg.tails), self.max_chunks,
                       MAX_LOOKUP_TAILS)
        msg.hashes = msg.hashes[: self.max_chunks]
        msg.tails = [] if over > 0 else msg.tails[:MAX_LOOKUP_TAILS]
        self.refused += max(0, over) + tails


@dataclass
class _Pending:
    """One lookup in flight: its query, deadline, and the ranks' answers so far."""

    id: int
    query: tuple
    deadline: float
    answers: dict[int, int] = field(default_factory=dict)
    slow: set[int] = field(default_factory=set)  # union over ranks
    local: set[int] = field(default_factory=set)  # union over ranks
    expired: bool = False


class LookupClient:
    """The scheduler's side: ask every rank; the minimum once all answered, ``None`` before
    (ask again), 0 once the lookup is past ``timeout_s`` (counted in ``timeouts``).

    A new lookup waits up to ``wait_s`` for its answers (the usual, fast case answers at once);
    it never waits longer, and later calls only pick up answers that already arrived."""

    def __init__(self, paths: list[Path] | list[str], timeout_s: float, wait_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic,
                 context: zmq.Context | None = None) -> None:
        """``paths``: the workers' sockets (or, with ``context``, their ``inproc://`` endpoints
        in it: the simulation, whose ``clock`` the deadlines then follow)."""
        self.timeout_s = timeout_s
        self.wait_s = min(wait_s, timeout_s)
        self.clock = clock
        self._owns_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._paths = paths
        self._socks: list[zmq.Socket] = []
        for p in paths:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(p if context is not None else f"ipc://{p}")
            self._socks.append(s)
        self._poller = zmq.Poller()
        for s in self._socks:
            self._poller.register(s, zmq.POLLIN)
        self._next_id = 0
        self._pending: dict[str, _Pending] = {}  # by request id
        self._log_once = LogOnce(logger)
        self.timeouts = 0
        self._slow: dict[str, frozenset[int]] = {}  # by request id, from its last answer
        self._local: dict[str, frozenset[int]] = {}  # by request id, from its last answer
        self.epoch = ""  # the weights epoch every lookup carries (see set_epoch)

    def set_epoch(self, epoch: str) -> None:
        """Look up under the weights epoch ``epoch`` from now on: lookups in flight are dropped
        (their answers, about the old epoch, are ignored) and their pins released."""
        self.release(list(self._pending))
        self.epoch = epoch

    def lookup(self, req_id: str, hashes: list[bytes], tails: list[tuple[int, bytes]],
               tenant: str = "", fresh: bool = False) -> int | None:
        """Leading stored tokens (minimum over ranks); ``None`` while a rank has not answered;
        0 when a rank is late past the deadline or absent. ``fresh``: the tiers forget the
        misses they remember of these chunks first (:attr:`Lookup.fresh`)."""
        if not hashes and not tails:
            return 0
        query = (tuple(hashes), tuple(tails), self.epoch, tenant, fresh)
        p = self._pending.get(req_id)
        if p is None or p.query != query:
            if p is not None:
                self.release([req_id])  # the request changed: drop the old lookup and pins
            p = self._send(req_id, query)
            if p is None:
                return 0
            self._receive(min(self.wait_s, max(0.0, p.deadline - self.clock())), p)
        else:
            self._receive(0.0, None)
        if len(p.answers) == len(self._socks):
            del self._pending[req_id]
            self._slow[req_id] = frozenset(p.slow)
            self._local[req_id] = frozenset(p.local - p.slow)
            return min(p.answers.values())
        if self.clock() < p.deadline:
            return None
        del self._pending[req_id]
        self._timed_out(req_id, p)
        return 0

    def _send(self, req_id: str, query: tuple) -> _Pending | None:
        self._next_id += 1
        p = _Pending(self._next_id, query, self.clock() + self.timeout_s)
        payload = _encode(Lookup(p.id, req_id, list(query[0]), list(query[1]),
                                 deadline=p.deadline, epoch=self.epoch, tenant=query[3],
                                 fresh=query[4]))
        try:
            for s in self._socks:
                s.send(payload, zmq.NOBLOCK)
        except zmq.Again:  # a rank's queue is full: it is not reading, so it is a miss
            self._timed_out(req_id, p)
            return None
        self._pending[req_id] = p
        return p

    def _receive(self, wait_s: float, until: _Pending | None) -> None:
        """Take every reply that arrived; wait up to ``wait_s`` for ``until`` to complete."""
        by_id = {p.id: p for p in self._pending.values()}
        end = self.clock() + wait_s
        while True:
            for s, _ in self._poller.poll(0):
                while True:
                    try:
                        reply = _decode_reply(s.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    except msgspec.DecodeError:
                        continue
                    if (p := by_id.get(reply.id)) is not None:  # late, dropped ids are ignored
                        p.answers[self._socks.index(s)] = reply.tokens
                        p.slow.update(reply.slow)
                        p.local.update(reply.local)
            left = end - self.clock()
            if until is None or len(until.answers) == len(self._socks) or left <= 0:
                return
            self._poller.poll(left * 1000)

    def take_slow(self, req_id: str) -> frozenset[int]:
        """The chunks of ``req_id``'s last answered lookup that only a tier that may block holds
        (on any rank): their load runs asynchronously."""
        return self._slow.pop(req_id, frozenset())

    def take_local(self, req_id: str) -> frozenset[int]:
        """The chunks of ``req_id``'s last answered lookup that only a local medium holds (on
        any rank; none of them slow on another): loaded in the step while its budget lasts."""
        return self._local.pop(req_id, frozenset())

    def _timed_out(self, req_id: str, p: _Pending) -> None:
        self.timeouts += 1
        missing = [str(self._paths[i]) for i in range(len(self._socks)) if i not in p.answers]
        self._log_once("timeout", "kvplug lookup of %s timed out after %.2fs (no answer from %s);"
                       " treated as a miss (further timeouts are counted in stats, not logged)",
                       req_id, self.timeout_s, ", ".join(missing))
        self.release([req_id])

    def release(self, req_ids: list[str]) -> None:
        """Forget these requests' lookups in flight and tell every rank to drop their pins (fire
        and forget; a rank handles it after any lookup of theirs sent before)."""
        if not req_ids:
            return
        for r in req_ids:
            self._pending.pop(r, None)
            self._slow.pop(r, None)
            self._local.pop(r, None)
        payload = _encode(Release(list(req_ids)))
        for s in self._socks:
            try:
                s.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        if self._owns_ctx:
            self._ctx.term()
