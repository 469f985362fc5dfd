"""Tenants and their byte quotas per tier.

A request's tenant is its ``cache_salt`` (or a ``tenant`` the client names); kvplug never keeps
or logs the value: :func:`tenant_id` turns it into 16 hex digits (a BLAKE2b personalised for
tenants, keyed by the deployment secret when ``auth_key_env`` is set, so without the secret an
id cannot be checked against guessed salts). The id is the key's ``tenant`` field and the last
part of every object name (``.t<16 hex>``, :mod:`kvplug.chunkfile.names`), so every process
sharing a directory or a store, and ``kvplug inspect``, can count a tenant's bytes from the names
alone (:func:`tenant_of_name`).

A tier's ``quotas: {default: SIZE, tenants: {NAME: SIZE}}`` bounds the bytes each tenant's
chunks may hold there (``default``: every tenant without a line of its own, the requests without
a tenant included; none: unbounded). A store that would take a tenant past its quota first evicts
that tenant's own entries, in the tier's eviction order; if its pinned entries leave no room, the
store is skipped (counted as ``quota_skipped_puts``). Tenant names in the config are hashed when
the tier starts and never kept.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..chunkfile.auth import Keyring

_NAME_TENANT = re.compile(r"\.t([0-9a-f]{16})(?:\.[0-9a-f]+)?\.safetensors$")
_PERSON = b"kvplug-tenant"


def tenant_id(value: str | bytes | None, auth: Keyring | None = None) -> str:
    """16 hex digits naming the tenant ``value`` (a cache salt, a tenant name); ``""`` for none.
    Keyed by the deployment's names key when ``auth`` is given (every engine with the secret
    agrees, and a rotation keeps the ids, as it keeps object names)."""
    if not value:
        return ""
    text = value if isinstance(value, str) else bytes(value).hex()
    if auth is not None:
        return auth.name_digest("kvplug-tenant\0" + text, 8)
    return hashlib.blake2b(text.encode(), digest_size=8, person=_PERSON).hexdigest()


def tenant_of_name(name: str) -> str:
    """The tenant id in a chunk object's name or relative path, ``""`` when it has none."""
    m = _NAME_TENANT.search(name)
    return m.group(1) if m else ""


class TenantQuotas:
    """One tier's quotas by tenant id (built from its ``quotas`` setting)."""

    def __init__(self, default: int | None, by_tenant: dict[str, int]) -> None:
        self.default = default
        self._by_tenant = dict(by_tenant)

    @classmethod
    def from_config(cls, cfg: Any, auth: Keyring | None = None) -> TenantQuotas:
        """From a :class:`~kvplug.config.QuotaConfig` (tenant names hashed here)."""
        return cls(None if cfg.default is None else int(cfg.default),
                   {tenant_id(name, auth): int(size) for name, size in cfg.tenants.items()})

    def limit(self, tenant: str) -> int | None:
        """The byte quota of tenant id ``tenant`` here (``None``: unbounded)."""
        return self._by_tenant.get(tenant, self.default)

    def __repr__(self) -> str:  # never the tenants' ids with their sizes in a log line
        return f"TenantQuotas(default={self.default}, tenants={len(self._by_tenant)})"
