"""The ``resp`` tier (entry point ``kvplug.backends.resp:RespBackend``): chunks in Valkey or Redis
(standalone or cluster; ``redis://``, ``rediss://``, ``unix://``), shared by many hosts.

* :mod:`.backend` — :class:`RespBackend`: its options and how it reaches the server;
* :mod:`.client`  — the client (timeouts, no retries, auth) and the store's primitives as pipelines.

The hooks (naming, verified loads, batched lookups and stores, pins, eviction) are the value-store
tier in :mod:`kvplug.backends.common` (shared with mooncake), with the breaker and lookup caches
(shared with fsspec too); credentials are masked by :mod:`kvplug.redact`.
Needs the ``redis`` package: ``pip install 'kvplug[resp]'``.
"""

from .backend import RespBackend

__all__ = ["RespBackend"]
