"""The resp tier's connection and its guarded calls: every call one bounded round trip.

:func:`open_client` turns the tier's options into a ``redis`` client (standalone over
``redis://``, ``rediss://`` (TLS) or ``unix://``, or a cluster), with kvplug's rules: every
socket read, write and connect bounded by ``timeout_s``, no client-side retries (a retry would
multiply the bound; the breaker decides when to try again), a bounded connection pool whose wait
is bounded too, and the password from the URL or from an environment variable, never logged.
:class:`RespIO` runs pipelined batches behind the tier's circuit breaker: a refused, failed or
timed-out call is a miss, never an exception.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvplug.errors import ConfigError

from ..common.breaker import CircuitBreaker
from ..common.redact import Redactor

SCHEMES = ("redis", "rediss", "unix")


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
                max_connections: int) -> Any:
    """A ``redis.Redis`` (or ``RedisCluster``) for ``url``; nothing is sent yet for a standalone
    server. A cluster client asks the cluster for its slots here (may raise when unreachable)."""
    redis = _redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 0), health_check_interval=0)
    if password is not None:
        kwargs["password"] = password
    if cluster:
        if url.lower().startswith("unix://"):
            raise ConfigError("resp tier: a cluster is reached over redis:// or rediss://, not a "
                              "unix socket; set cluster: false or give a node's host:port")
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, max_connections=max_connections, **kwargs)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                 timeout=timeout_s, **kwargs)
    return redis.Redis(connection_pool=pool)


def display_url(url: str) -> str:
    """``url`` without user-info or query (what log lines name)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return f"{parts.scheme}://{host}{parts.path}"


class RespIO:
    """Pipelined calls behind the breaker. The client is made on first use (a cluster that is
    down when the tier starts is then a miss like any other outage, not a startup failure).

    A reply error from the store (``OOM`` under ``noeviction``, a wrong type) means the store
    answered: it is counted (``store_errors``) but does not count against the breaker."""

    def __init__(self, name: str, make_client: Any, breaker: CircuitBreaker, redact: Redactor,
                 ) -> None:
        self.name = name
        self._make = make_client
        self._client: Any = None
        self.breaker = breaker
        self.redact = redact
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("remote_errors", "socket_timeouts", "store_errors",
                                      "remote_lookups", "evicted"), 0)
        redis = _redis()
        self._reply_error = redis.exceptions.ResponseError
        self._timeout = redis.exceptions.TimeoutError

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make()
            return self._client

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def failed(self, exc: BaseException) -> None:
        """Record a failed call (unreachable, reset, timed out) and feed it to the breaker."""
        self._count("socket_timeouts" if isinstance(exc, (self._timeout, TimeoutError)) else "remote_errors")
        self.breaker.failure(self.redact.error(exc))

    def allow(self) -> bool:
        return self.breaker.allow()

    def forgo(self) -> None:
        self.breaker.forgo()

    def _pipeline(self, build: Any, guard: bool = True) -> list[Any] | None:
        """Run one pipeline (``build(pipe)`` queues its commands); per-command replies, reply
        errors as exception objects; ``None`` when refused or when the round trip failed."""
        if guard and not self.breaker.allow():
            return None
        try:
            pipe = self.client().pipeline(transaction=False)
            build(pipe)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - every failure is a miss, counted
            self.failed(exc)
            return None
        self.breaker.success()
        errors = sum(isinstance(r, self._reply_error) for r in replies)
        if errors:
            self._count("store_errors", errors)
        return replies

    # -- calls ----------------------------------------------------------------------------------
    def exists(self, names: Sequence[str]) -> list[bool | None]:
        """Per name: whether the store holds it (``None``: unknown, the store is unavailable)."""
        self._count("remote_lookups", len(names))
        replies = self._pipeline(lambda p: [p.exists(n) for n in names])
        if replies is None:
            return [None] * len(names)
        return [None if isinstance(r, Exception) else bool(r) for r in replies]

    def get(self, name: str) -> bytes | None:
        """The whole value (``None``: missing or unavailable)."""
        replies = self._pipeline(lambda p: p.get(name))
        return None if replies is None or not isinstance(replies[0], bytes) else replies[0]

    def get_range(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a value; ``None`` when missing (empty) or unavailable."""
        replies = self._pipeline(lambda p: p.getrange(name, start, end - 1))
        data = None if replies is None else replies[0]
        return data if isinstance(data, bytes) and data else None

    def set_many(self, items: Sequence[tuple[str, Any]]) -> list[BaseException | None] | None:
        """Store values in one round trip: per item ``None`` (stored) or the store's reply error;
        ``None`` as a whole when the round trip failed. Callers ask :meth:`allow` first."""
        replies = self._pipeline(lambda p: [p.set(n, v) for n, v in items], guard=False)
        if replies is None:
            return None
        return [r if isinstance(r, Exception) else None for r in replies]

    def delete(self, names: Sequence[str]) -> None:
        """Delete values (missing ones are fine); counted as ``evicted``."""
        if names:
            self._count("evicted", len(names))
            self._pipeline(lambda p: [p.delete(n) for n in names])

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001, S110 - closing a dead connection
                pass
