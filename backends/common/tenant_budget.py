"""Per-tenant byte quotas on a tier whose store evicts by itself (resp, mooncake, fsspec).

Such a store picks its own victims, so kvplug cannot evict a tenant's own entries first, as L1 and
posix do. What it can do is count, on the store path, the bytes this process wrote per tenant
(the tenant id is in every object name, ``.t<16 hex>``) and skip a store that would take its
tenant past its quota (``quotas`` in the tier's config), counted as ``quota_skipped_puts`` and
logged once.

The count is **approximate**: it is this process's (other engines writing the same store keep
their own), it learns that a value left the store only when kvplug deleted it, found it missing
or found it corrupt (:meth:`TenantBudget.forget`: the store's own evictions go unseen until a
read misses), and it checks the quota when a store is queued but counts the bytes once written
(a burst of stores queued together may pass the quota by what is in flight). It errs towards
skipping: a tenant is never let past its quota by what this process knows.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from kvplug.logs import LogOnce
from kvplug.policies.tenants import tenant_of_name

logger = logging.getLogger("kvplug.backends.values")

#: values remembered (their tenant and size); past it the oldest are forgotten (counted less)
MAX_TRACKED = 1 << 20


class TenantBudget:
    """Bytes written per tenant id by this process to one tier, checked against its quotas
    (a :class:`~kvplug.policies.tenants.TenantQuotas`, or ``None``: nothing counted or skipped)."""

    def __init__(self, quotas: Any, tier: str, max_tracked: int = MAX_TRACKED) -> None:
        self.quotas = quotas
        self.tier = tier
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, tuple[str, int]] = OrderedDict()  # name -> tenant, bytes
        self._bytes: dict[str, int] = {}
        self.skipped = 0
        self._log_once = LogOnce(logger)

    def admit(self, name: str, tenant: str, nbytes: int) -> bool:
        """Whether a store of ``nbytes`` under ``name`` keeps ``tenant`` within its quota (a
        value already counted always is); a refusal is counted."""
        limit = self.quotas.limit(tenant) if self.quotas is not None else None
        if limit is None:
            return True
        with self._lock:
            if name in self._sizes or self._bytes.get(tenant, 0) + nbytes <= limit:
                return True
            self.skipped += 1
        self._log_once("quota", "tier %r: a tenant's stores fill its quota (counted by this "
                       "process: the store evicts by itself); its store was skipped — further "
                       "skips are counted in stats (quota_skipped_puts)", self.tier)
        return False

    def written(self, name: str, nbytes: int) -> None:
        """A value was written: count its bytes for the tenant its name carries (without quotas
        nothing is counted: no memory spent per value)."""
        if self.quotas is None:
            return
        tenant = tenant_of_name(name)
        with self._lock:
            old = self._sizes.pop(name, None)
            if old is not None:
                self._sub(*old)
            self._sizes[name] = (tenant, nbytes)
            self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
            while len(self._sizes) > self.max_tracked:
                self._sub(*self._sizes.popitem(last=False)[1])

    def forget(self, name: str) -> None:
        """The value was deleted, or found missing or corrupt: its bytes no longer count."""
        with self._lock:
            old = self._sizes.pop(name, None)
            if old is not None:
                self._sub(*old)

    def _sub(self, tenant: str, nbytes: int) -> None:
        left = self._bytes.get(tenant, 0) - nbytes
        if left > 0:
            self._bytes[tenant] = left
        else:
            self._bytes.pop(tenant, None)

    def usage(self) -> dict[str, int]:
        """Bytes per tenant id, as counted (approximate: see the module docstring)."""
        with self._lock:
            return dict(self._bytes)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {"quota_skipped_puts": float(self.skipped)}
            if self.quotas is not None:
                out["tenants"] = float(len(self._bytes))
            return out
