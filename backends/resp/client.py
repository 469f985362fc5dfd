"""The resp tier's connection and its guarded calls: every call one bounded round trip.

:func:`open_client` turns the tier's options into a ``redis`` client (standalone over
``redis://``, ``rediss://`` (TLS) or ``unix://``, or a cluster), with kvplug's rules: every
socket read, write and connect bounded by ``timeout_s``, no client-side retries (a retry would
multiply the bound; the breaker decides when to try again), a bounded connection pool whose wait
is bounded too, and the password from the URL or from an environment variable, never logged.
TLS files (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``) are checked at startup
(:func:`check_tls`); a handshake that fails at run time is logged once with the URL and the
option that fixes it (:func:`tls_hint`).
:class:`RespIO` gives the value-store tier (:mod:`kvplug.backends.common.value_tier`) its
primitives as pipelined round trips; :class:`~kvplug.backends.common.value_io.ValueIO` puts the
breaker in front of them (a refused, failed or timed-out call is a miss, never an exception).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from kvplug.errors import ConfigError
from kvplug.redact import Redactor

from ..common.breaker import CircuitBreaker
from ..common.value_io import ValueIO
from .replies import BulkReader, ProtocolError

SCHEMES = ("redis", "rediss", "unix")
#: The tier's TLS options, passed to redis-py as they are (paths to PEM files).
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
#: Values longer than this are sent as they are, not copied into a packed command.
LARGE_VALUE = 64 << 10
logger = logging.getLogger("kvplug.backends.resp")


def _redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ConfigError("resp tier: the 'redis' package is not installed; install kvplug[resp] "
                          "(pip install 'kvplug[resp]')") from None
    return redis


def check_url(url: str) -> str:
    """``url`` if its scheme is one the tier speaks; a ``ValueError`` naming the fix otherwise."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        shown = Redactor(url, {})(url)
        raise ValueError(f"url {shown!r} is not a Valkey/Redis URL: use redis://host:port/db, "
                         "rediss://host:port (TLS) or unix:///path/to/socket")
    return url


def check_tls(url: str, files: dict[str, str | None]) -> dict[str, str]:
    """The TLS options that are set (``TLS_OPTIONS`` -> path), checked now so that a bad one
    fails at startup naming it: only with ``rediss://``, each a readable file, the CA file a PEM
    bundle, the certificate and key a matching pair (a key alone is refused)."""
    given = {k: v for k, v in files.items() if v}
    if not given:
        return given
    if not url.lower().startswith("rediss://"):
        raise ValueError(f"{', '.join(given)} set, but url {display_url(url)!r} does not use "
                         "TLS: use rediss://host:port/db, or remove the ssl_* options")
    for name, path in given.items():
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ValueError(f"{name} {path!r} is not a readable file")
    if "ssl_keyfile" in given and "ssl_certfile" not in given:
        raise ValueError("ssl_keyfile is set without ssl_certfile: a client certificate is the "
                         "pair; set ssl_certfile to its PEM certificate")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if "ssl_ca_certs" in given:
            ctx.load_verify_locations(cafile=given["ssl_ca_certs"])
    except ssl.SSLError as exc:
        raise ValueError(f"ssl_ca_certs {given['ssl_ca_certs']!r} holds no CA certificate in "
                         f"PEM ({exc})") from None
    try:
        if "ssl_certfile" in given:
            ctx.load_cert_chain(given["ssl_certfile"], given.get("ssl_keyfile"))
    except ssl.SSLError as exc:
        raise ValueError(f"ssl_certfile {given['ssl_certfile']!r} and ssl_keyfile "
                         f"{given.get('ssl_keyfile')!r} are not a PEM certificate and its private "
                         f"key ({exc})") from None
    return given


def tls_hint(exc: BaseException, client_cert: bool) -> str | None:
    """What to change when ``exc`` (a failed call) is a TLS failure the tier's options fix.
    ``client_cert``: whether the tier presents one. A server that wants a client certificate
    either says so (an alert) or, under TLS 1.3, may close the connection before the client
    reads the alert (an EOF): told apart from a dropped connection only by the options."""
    cause = exc if isinstance(exc, ssl.SSLError) else exc.__cause__ or exc.__context__
    if not isinstance(cause, ssl.SSLError):
        return None
    text = str(cause).upper()
    if isinstance(cause, ssl.SSLCertVerificationError):
        return ("the server's certificate is not trusted "
                f"({cause.verify_message or cause.reason}): set the tier's ssl_ca_certs to the "
                "CA certificate (PEM) that signed it")
    if "CERTIFICATE_REQUIRED" in text or (isinstance(cause, ssl.SSLEOFError) and not client_cert):
        return ("the server closed the connection; if it requires client certificates "
                "(redis tls-auth-clients), set the tier's ssl_certfile and ssl_keyfile to one "
                "signed by a CA it trusts (its tls-ca-cert-file)")
    if "WRONG_VERSION_NUMBER" in text:
        return "the server does not speak TLS on this port: use redis:// or its tls-port"
    return None


def password_from_env(name: str | None) -> str | None:
    """The password held by environment variable ``name`` (``None`` when no variable is named)."""
    if not name:
        return None
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"resp tier: password_env names {name!r}, which is not set in the "
                          f"environment; export {name}=... or remove password_env")
    return value


def open_client(url: str, *, cluster: bool, password: str | None, timeout_s: float,
                max_connections: int, tls: dict[str, str] | None = None) -> Any:
    """A ``redis.Redis`` (or ``RedisCluster``) for ``url``; nothing is sent yet for a standalone
    server. A cluster client asks the cluster for its slots here (may raise when unreachable).
    ``tls``: redis-py's ``ssl_*`` arguments (from :func:`check_tls`)."""
    redis = _redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 0), health_check_interval=0)
    if password is not None:
        kwargs["password"] = password
    kwargs.update(tls or {})
    if cluster:
        if url.lower().startswith("unix://"):
            raise ConfigError("resp tier: a cluster is reached over redis:// or rediss://, not a "
                              "unix socket; set cluster: false or give a node's host:port")
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, max_connections=max_connections, **kwargs)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                 timeout=timeout_s, command_packer=_packer(),
                                                 **kwargs)
    return redis.Redis(connection_pool=pool)


def _packer() -> Any:
    """Commands packed by hiredis (redis-py's default with hiredis, fast for the many small
    commands of a lookup), except those carrying a large value: redis-py's pure-Python packer
    hands such a value to the socket as it is (``sendall`` of the caller's buffer), where hiredis
    copies it twice (``bytes(memoryview)``, then into the packed command). Replies are parsed by
    hiredis either way. (A cluster client takes no packer: redis-py's default.)"""
    from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer

    small, large = HiredisRespSerializer(), PythonRespSerializer(
        6000, Encoder("utf-8", "strict", False).encode)

    class Packer:
        def pack(self, *args: Any) -> list:
            big = any(isinstance(a, (bytes, bytearray, memoryview)) and len(a) > LARGE_VALUE
                      for a in args)
            return (large if big else small).pack(*args)

    try:
        import hiredis  # noqa: F401 - redis-py's hiredis packer needs it
    except ImportError:
        return large
    return Packer()


def _packed(command: str, names: Sequence[str], *args: bytes) -> bytes:
    """``command name *args`` for each name, packed as RESP arrays (one pipeline)."""
    head = f"*{2 + len(args)}\r\n${len(command)}\r\n{command}\r\n".encode()
    tail = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    parts = []
    for name in names:
        raw = name.encode()
        parts += [head, b"$%d\r\n" % len(raw), raw, b"\r\n", tail]
    return b"".join(parts)


def display_url(url: str) -> str:
    """``url`` without user-info or query (what log lines name)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return f"{parts.scheme}://{host}{parts.path}"


class RespIO(ValueIO):
    """The store's primitives as pipelines: one round trip per batch. The client is made and a
    first connection opened in the background as the tier starts (so an engine's first lookup
    does not pay them); a server that is down then is a miss like any other outage, not a
    startup failure, and the first call tries again. Replies of a standalone server are
    received in place into any memory (heap objects too, with no L1 in front). A reply error
    from the server (``OOM`` under ``noeviction``, a wrong type) means the store answered: the
    value is refused, the breaker is not told."""

    def __init__(self, name: str, make_client: Callable[[], Any], breaker: CircuitBreaker,
                 redact: Redactor, shown: str = "", client_cert: bool = False,
                 cluster: bool = False) -> None:
        super().__init__(name, breaker, redact)
        #: A standalone server's replies are read in place (a cluster's go through redis-py).
        self.reads_into = not cluster
        self.reads_anywhere = True  # recv_into any memory
        self._local = threading.local()
        self._make = make_client
        self._shown = shown  # the URL for log lines (no credentials)
        self._client_cert = client_cert
        self._tls_told = False
        self._client: Any = None
        self._closed = False
        self._client_lock = threading.Lock()
        redis = _redis()
        self._reply_error = redis.exceptions.ResponseError
        self.timeout_types = (redis.exceptions.TimeoutError,)
        threading.Thread(target=self._connect_early, name=f"kvplug-{name}-connect",
                         daemon=True).start()

    def _connect_early(self) -> None:
        """Make the client and one pooled connection now; a failure waits for the first call
        (which counts and reports it: nothing here reaches the breaker)."""
        try:
            client = self.client()
            pool = getattr(client, "connection_pool", None)
            if pool is not None:  # standalone (a cluster client asked for its slots already)
                pool.release(pool.get_connection())
        except Exception as exc:  # noqa: BLE001 - the first call connects again and reports
            logger.info("tier %r: no connection to %s at start (%s); the first call tries again",
                        self.name, self._shown, self.redact.error(exc))

    def failed(self, exc: BaseException, breaker: CircuitBreaker | None = None) -> None:
        """As every remote tier, plus once an error naming the URL and the option to fix when
        the TLS handshake failed (a wrong CA, a missing client certificate): a misconfiguration
        that no retry mends, while the breaker's own line would only say "failing"."""
        hint = tls_hint(exc, self._client_cert)
        if hint is not None and not self._tls_told:
            self._tls_told = True
            logger.error("tier %r: TLS to %s failed: %s (%s); until then it is a miss for every "
                         "lookup and load", self.name, self._shown, hint, self.redact.error(exc))
        super().failed(exc, breaker)

    def client(self) -> Any:
        with self._client_lock:
            if self._closed:
                raise ConnectionError(f"tier {self.name!r} is closed")
            if self._client is None:
                self._client = self._make()
            return self._client

    def _pipeline(self, build: Callable[[Any], Any]) -> list[Any]:
        pipe = self.client().pipeline(transaction=False)
        build(pipe)
        return pipe.execute(raise_on_error=False)

    def _exists(self, names: Sequence[str]) -> list[bool | None]:
        if self.reads_into:  # standalone: one round trip packed and parsed here
            return self._raw(_packed("EXISTS", names),
                             lambda replies: [replies.integer() for _ in names])
        replies = self._pipeline(lambda p: [p.exists(n) for n in names])
        return [None if isinstance(r, Exception) else bool(r) for r in replies]

    def _get(self, name: str) -> bytes | None:
        return self._get_many([name])[0]

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """Whole values; with a read limit, ``GETRANGE name 0 limit`` (at most ``limit + 1``
        bytes come back, so a longer value costs no more: the tier sees it is too long)."""
        limit = self.read_limit()
        if limit is None:
            replies = self._pipeline(lambda p: [p.get(n) for n in names])
        else:
            replies = self._pipeline(lambda p: [p.getrange(n, 0, limit) for n in names])
        return [r if isinstance(r, bytes) and (limit is None or r) else None for r in replies]

    def registered(self, address: int, nbytes: int) -> bool:
        return True  # a socket receives into any memory

    def scratch(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.scratch = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
        return buf

    def _raw(self, payload: bytes, read: Callable[[BulkReader], list]) -> list:
        """Send ``payload`` (packed commands) on a connection of the client's pool and ``read``
        the replies straight off its socket (:class:`~.replies.BulkReader`). A failure part way
        drops the connection (its stream is out of step), then raises."""
        pool = self.client().connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([payload])
            replies = BulkReader(conn._sock)  # redis-py's socket once connected
            out = read(replies)
            if not replies.drained():
                raise ProtocolError("more bytes than the replies of the pipeline")
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        return out

    def _get_into_many(self, names: Sequence[str], pieces: Sequence[Sequence[tuple[int, int]]]
                       ) -> list[int | bytearray | None]:
        """One pipelined round trip of ``GET``s whose replies are received straight into the
        pieces (a value of another size: whole, returned)."""
        limit = self.read_limit()
        if limit is None:
            return self._raw(_packed("GET", names),
                             lambda replies: [replies.bulk_into(p) for p in pieces])
        return self._raw(_packed("GETRANGE", names, b"0", b"%d" % limit),
                         lambda replies: [replies.bulk_into(p, limit + 1) for p in pieces])

    def _get_range(self, name: str, start: int, end: int) -> bytes | None:
        reply = self._pipeline(lambda p: p.getrange(name, start, end - 1))[0]
        return reply if isinstance(reply, bytes) and reply else None  # missing: empty

    def _set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None]:
        replies = self._pipeline(lambda p: [p.set(n, v) for n, v in items])
        return [r if isinstance(r, self._reply_error) else None for r in replies]

    def _delete(self, names: Sequence[str]) -> None:
        self._pipeline(lambda p: [p.delete(n) for n in names])

    def close(self) -> None:
        with self._client_lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001, S110 - closing a dead connection
                pass
