"""The ``resp`` tier: chunks as values in Valkey or Redis (standalone or cluster), shared by hosts.

All the tier's behaviour (naming, verified loads, batched lookups and stores, pins, eviction,
misses on the store's own eviction or loss) is :class:`~kvplug.backends.common.value_tier.
ValueStoreTier`; this module says how to reach the server: the URL (``redis://``, ``rediss://``,
``unix://``), a cluster or not, the password from the URL or an environment variable (never
logged), and ``timeout_s`` as the client's socket timeout, with no retries
(:mod:`.client`). ``get_layers`` reads a layer range with ``GETRANGE``.
"""

from __future__ import annotations

import functools

from kvplug.hookspecs import TierContext
from pydantic import Field, field_validator

from ..common.breaker import CircuitBreaker
from ..common.redact import Redactor
from ..common.value_io import ValueIO
from ..common.value_tier import ValueStoreOptions, ValueStoreTier
from .client import RespIO, check_url, display_url, open_client, password_from_env


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

        @field_validator("url")
        @classmethod
        def _url_given(cls, v: str) -> str:
            if not v:
                raise ValueError("url is required, e.g. 'redis://127.0.0.1:6379/0'")
            return check_url(v)

    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        opts: RespBackend.Options = ctx.options
        password = password_from_env(opts.password_env)
        redact = Redactor(opts.url, {"password": password} if password else {})
        make = functools.partial(open_client, opts.url, cluster=opts.cluster, password=password,
                                 timeout_s=opts.timeout_s, max_connections=opts.max_connections)
        shown = display_url(opts.url) + (" (cluster)" if opts.cluster else "")
        return RespIO(ctx.name, make, breaker, redact, cluster=opts.cluster), shown
