"""The ``mooncake`` tier (entry point ``kvplug.backends.mooncake:MooncakeBackend``): chunks in a
Mooncake Store, shared by many hosts.

* :mod:`.backend` — :class:`MooncakeBackend`: its options and how it reaches the store;
* :mod:`.client`  — Mooncake's client: bounded calls, error codes told apart, registered reads.

The hooks are the value-store tier of :mod:`kvplug.backends.common` (shared with resp). Needs
``pip install 'kvplug[mooncake]'`` and ``libibverbs1`` (Debian), even without RDMA hardware.
"""

from .backend import MooncakeBackend

__all__ = ["MooncakeBackend"]
