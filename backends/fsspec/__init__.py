"""The ``fsspec`` tier (entry point ``kvplug.backends.fsspec:FsspecBackend``): chunk files on any
fsspec filesystem — S3/MinIO/Ceph, GCS, ``memory://``, ``file://`` — shared by many hosts.

* :mod:`.backend` — :class:`FsspecBackend`, the hooks, naming, pins and eviction;
* :mod:`.reader`  — :class:`~.reader.ChunkReader`: verified loads, header and negative caches;
* :mod:`.io`      — bounded remote calls, the breaker in front of them, credential scrubbing;
* the write queue and its threads, guarded calls, the circuit breaker, lookup caches, capacity
  index live in :mod:`kvplug.backends.common` (shared with resp and mooncake); credentials are
  masked by :mod:`kvplug.redact`.
"""

from .backend import FsspecBackend

__all__ = ["FsspecBackend"]
