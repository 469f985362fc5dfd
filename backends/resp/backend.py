"""The ``resp`` tier: chunks as values in Valkey or Redis (standalone or cluster), shared by hosts.

All the tier's behaviour (naming, verified loads, batched lookups and stores, pins, eviction,
misses on the store's own eviction or loss) is :class:`~kvplug.backends.common.value_tier.
ValueStoreTier`; this module says how to reach the server: the URL (``redis://``, ``rediss://``,
``unix://``), a cluster or not, the password from the URL or an environment variable (never
logged), TLS files for ``rediss://`` (the CA, a client certificate and key; checked at startup),
and ``timeout_s`` as the client's socket timeout, with no retries (:mod:`.client`).
``get_layers`` reads a layer range with ``GETRANGE``. The tier declares no ``call_bound_s``: the
socket timeout bounds each read, not a reply trickled over many reads, nor the wait for a pooled
connection, so its calls run on the tier's pool under ``timeout_s`` (:mod:`kvplug.tier_calls`).
"""

from __future__ import annotations

import functools
import os

from kvplug.bench_raw import RawTarget
from kvplug.hookspecs import TierContext
from kvplug.redact import Redactor
from pydantic import Field, field_validator, model_validator

from ..common.breaker import CircuitBreaker
from ..common.value_io import ValueIO
from ..common.value_tier import ValueStoreOptions, ValueStoreTier
from .client import (
    TLS_OPTIONS,
    RespIO,
    check_tls,
    check_url,
    display_url,
    open_client,
    password_from_env,
)
from .cluster import ClusterRespIO


class RespBackend(ValueStoreTier):
    """A remote tier over one Valkey/Redis deployment; many hosts may share it."""

    kind = "Valkey/Redis store"

    class Options(ValueStoreOptions):
        url: str = Field(default="", validate_default=True, repr=False,
                         description="redis://[user:password@]host:port/db, rediss://... (TLS), "
                         "unix:///path/to/socket; a cluster: any node's redis:// URL")
        cluster: bool = Field(default=False, description="the URL names a Redis/Valkey cluster node")
        password_env: str | None = Field(
            default=None, description="environment variable holding the password (instead of "
            "putting it in the URL)")
        max_connections: int = Field(default=16, ge=2, description="connections per process")
        ssl_ca_certs: str | None = Field(
            default=None, description="rediss://: the CA certificate(s) (PEM file) the server's "
            "certificate must be signed by; default: the system's trusted CAs")
        ssl_certfile: str | None = Field(default=None, description="rediss://: this client's "
                                         "certificate (PEM), for servers that require one")
        ssl_keyfile: str | None = Field(default=None,
                                        description="rediss://: the private key of ssl_certfile")

        @field_validator("url")
        @classmethod
        def _url_given(cls, v: str) -> str:
            if not v:
                raise ValueError("url is required, e.g. 'redis://127.0.0.1:6379/0'")
            return check_url(v)

        @model_validator(mode="after")
        def _tls_files(self) -> RespBackend.Options:
            check_tls(self.url, {k: getattr(self, k) for k in TLS_OPTIONS})
            return self

    #: ``kvplug bench`` measures no raw row for a cluster (:meth:`bench_raw`)
    bench_no_raw = "not measured for a cluster (redis-py's cluster client differs from the tier's)"

    @staticmethod
    def bench_raw(options: RespBackend.Options) -> RawTarget | None:
        """``kvplug bench``'s raw medium (:mod:`kvplug.bench_raw`): redis-py on the same server
        (.bench.RawRedis); none for a cluster."""
        if options.cluster:
            return None
        from .bench import RawRedis

        password = os.environ.get(options.password_env) if options.password_env else None
        return RawRedis(options.url, password)

    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        opts: RespBackend.Options = ctx.options
        password = password_from_env(opts.password_env)
        redact = Redactor(opts.model_dump(), {"password": password} if password else {})
        tls = check_tls(opts.url, {k: getattr(opts, k) for k in TLS_OPTIONS})
        make = functools.partial(open_client, opts.url, cluster=opts.cluster, password=password,
                                 timeout_s=opts.timeout_s, max_connections=opts.max_connections,
                                 tls=tls)
        shown = display_url(opts.url) + (" (cluster)" if opts.cluster else "")
        if not opts.cluster:
            return RespIO(ctx.name, make, breaker, redact, shown=shown,
                          client_cert="ssl_certfile" in tls), shown
        node_breaker = functools.partial(CircuitBreaker, threshold=opts.breaker_threshold,
                                         backoff_s=opts.breaker_backoff_s,
                                         max_backoff_s=opts.breaker_max_backoff_s)
        return ClusterRespIO(ctx.name, make, breaker, redact, shown=shown,
                             client_cert="ssl_certfile" in tls, node_breaker=node_breaker,
                             cluster=True), shown
