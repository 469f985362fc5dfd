"""Tenants and their byte quotas per tier.

A request's tenant is its ``cache_salt``; kvplug never keeps or logs the value: :func:`tenant_id`
turns it into 16 hex digits, a BLAKE2b personalised for tenants and always keyed, so without the
key an id cannot be checked against guessed salts: by the deployment secret when ``auth_key_env``
is set, else by the deployment's tenant key (:func:`deployment_tenant_key`: 32 random bytes drawn
once and kept private in ``<kvplug cache dir>/tenant.key``, or the file
``$KVPLUG_TENANT_KEY_FILE`` names; every kvplug process of the user on the machine shares it,
and hosts sharing a store share it by being given the same file or the same secret). The id is
the key's ``tenant`` field and the last part of every object name (``.t<16 hex>``,
:mod:`kvplug.chunkfile.names`), so every process sharing a directory or a store, and ``kvplug
inspect``, can count a tenant's bytes from the names alone (:func:`tenant_of_name`).

The config's tenant names (``quotas.tenants``) are cache salts too, hashed the same way.

A tier's ``quotas: {default: SIZE, tenants: {NAME: SIZE}}`` bounds the bytes each tenant's
chunks may hold there (``default``: every tenant without a line of its own, the requests without
a tenant included; none: unbounded). A store that would take a tenant past its quota first evicts
that tenant's own entries, in the tier's eviction order; if its pinned entries leave no room, the
store is skipped (counted as ``quota_skipped_puts``). Tenant names in the config are hashed when
the tier starts and never kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Any

from ..chunkfile.atomic import make_dirs
from ..chunkfile.auth import Keyring
from ..errors import ConfigError

logger = logging.getLogger("kvplug.tenants")

_NAME_TENANT = re.compile(r"\.t([0-9a-f]{16})(?:\.[0-9a-f]+)?\.safetensors$")
_PERSON = b"kvplug-tenant"


#: Environment variable naming the file of the deployment's tenant key (instead of the default).
TENANT_KEY_FILE_ENV = "KVPLUG_TENANT_KEY_FILE"
_KEY_HEX = re.compile(r"[0-9a-f]{64}")
_keys: dict[str, bytes] = {}
_keys_lock = threading.Lock()


def tenant_key_path() -> Path:
    """Where the deployment's tenant key is kept: ``$KVPLUG_TENANT_KEY_FILE``, else
    ``tenant.key`` in kvplug's cache directory."""
    named = os.environ.get(TENANT_KEY_FILE_ENV)
    if named:
        return Path(named).expanduser()
    from ..config import default_cache_dir

    return default_cache_dir() / "tenant.key"


def deployment_tenant_key() -> bytes:
    """The key tenant ids are keyed with when no deployment secret is set: 32 random bytes drawn
    once (the first process to need it writes them, 0600 in a 0700 directory, published whole by
    a hard link so racing processes agree) and read by every later process. A file that is not
    such a key is a :class:`~kvplug.errors.ConfigError` naming it (deleting it draws a new key:
    tenant ids, and the names of salted chunks, change)."""
    path = tenant_key_path()
    with _keys_lock:
        key = _keys.get(str(path))
        if key is None:
            key = _keys[str(path)] = _load_or_draw(path)
    return key


def _load_or_draw(path: Path) -> bytes:
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    make_dirs(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # whole or not at all; another process's key wins a race
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        text = os.read(fd, 128).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not _KEY_HEX.fullmatch(text):
        raise ConfigError(f"{path} is not a kvplug tenant key (64 hex digits); delete it to draw "
                          "a new one (tenant ids, and the names of salted chunks stored without "
                          "auth_key_env, change), or set auth_key_env")
    if st.st_mode & 0o077 or st.st_uid != os.geteuid():
        logger.warning("the tenant key %s is readable by others or not this user's (mode %04o): "
                       "whoever reads it can check tenant ids against guessed salts; chmod 600 "
                       "it", path, st.st_mode & 0o777)
    return bytes.fromhex(text)


def tenant_id(value: str | bytes | None, auth: Keyring | None = None) -> str:
    """16 hex digits naming the tenant of cache salt ``value``; ``""`` for none. Keyed by the
    deployment's names key when ``auth`` is given (every engine with the secret agrees, and a
    rotation keeps the ids, as it keeps object names), else by :func:`deployment_tenant_key`."""
    if not value:
        return ""
    text = value if isinstance(value, str) else bytes(value).hex()
    if auth is not None:
        return auth.name_digest("kvplug-tenant\0" + text, 8)
    return hashlib.blake2b(text.encode(), digest_size=8, key=deployment_tenant_key(),
                           person=_PERSON).hexdigest()


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
