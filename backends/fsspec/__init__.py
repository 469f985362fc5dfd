"""The ``fsspec`` tier (entry point ``kvplug.backends.fsspec:FsspecBackend``): chunk files on any
fsspec filesystem — S3/MinIO/Ceph, GCS, ``memory://``, ``file://`` — shared by many hosts.

* :mod:`.backend` — :class:`FsspecBackend`: options, object names, the listing at start;
* :mod:`.io`      — :class:`~.io.FsspecIO`: bounded remote calls behind the breaker, the
  value-store interface resp and mooncake implement too, credential scrubbing;
* the hooks — verified loads, lookups, the write queue, pins, eviction, the corrupt and
  other-version policy — are the remote tiers' one path in :mod:`kvplug.backends.common`
  (:class:`~kvplug.backends.common.value_tier.ValueStoreTier`); credentials are masked by
  :mod:`kvplug.redact`.
"""

from .backend import FsspecBackend

__all__ = ["FsspecBackend"]
