"""The ``resp`` tier (entry point ``kvplug.backends.resp:RespBackend``): chunks in Valkey or Redis
(standalone or cluster; ``redis://``, ``rediss://``, ``unix://``), shared by many hosts.

* :mod:`.backend` — :class:`RespBackend`: the hooks, naming, verified loads, pins, eviction;
* :mod:`.writer`  — :class:`~.writer.RespWriter`: the bounded write queue, pipelined batches;
* :mod:`.client`  — the client (timeouts, no retries, auth) and the calls behind the breaker.

The breaker, lookup caches and redaction are :mod:`kvplug.backends.common` (shared with fsspec).
Needs the ``redis`` package: ``pip install 'kvplug[resp]'``.
"""

from .backend import RespBackend

__all__ = ["RespBackend"]
