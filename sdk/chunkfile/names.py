"""Where chunk files live and what their names are: the one naming rule, temporary names included.

A chunk of key ``k`` is ``<root>/<2 hex of the hash>/<k's safe name>.safetensors``. A file being
written is ``.<final name>.<pid>.<8 hex>.tmp`` in the same directory and becomes visible only by
rename (:mod:`kvplug.chunkfile.atomic`); :func:`is_temp` recognises such a name for every tier, so
any process can tell a write in progress (or one a crash left behind) from a chunk.

With a keyring (``auth_key_env``, :mod:`.auth`) a chunk's name is instead 64 hex of a keyed hash
of the key string, and its shard the first two of them: a reader of the store cannot confirm a
guessed prompt (or model) from a name. Every function below takes the tier's keyring as ``auth``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from ..keys import CacheKey

if TYPE_CHECKING:  # pragma: no cover
    from .auth import Keyring

FILE_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
#: A temporary file older than this (by mtime) is a crashed writer's leftover: tiers delete it.
TEMP_MAX_AGE_S = 600.0
_MAX_HEX = 128
_MAX_NAME = 200


def chunk_name(key: CacheKey, auth: Keyring | None = None) -> str:
    """The file name of a chunk: the key's safe string form (``[A-Za-z0-9._-]`` only), with long
    parts replaced by digests so the name stays below file-system limits; with ``auth``, 64 hex
    of a keyed hash of the key string."""
    if auth is not None:  # the tenant stays countable (its id is keyed too: tenant_id)
        tenant = f".t{key.tenant}" if key.tenant else ""
        return auth.name_digest(key.to_string()) + tenant + FILE_SUFFIX
    hexpart = key.hex if len(key.hex) <= _MAX_HEX else xxhash.xxh3_128_hexdigest(key.chunk_hash)
    name = f"{key.namespace}.{hexpart}"
    if len(name) > _MAX_NAME:
        tenant = f".t{key.tenant}" if key.tenant else ""
        name = f"{xxhash.xxh3_128_hexdigest(key.namespace.encode())}{tenant}.{hexpart}"
    return name + FILE_SUFFIX


def shard_of(key: CacheKey, auth: Keyring | None = None) -> str:
    """Two hex digits from the chunk hash (uniform for sha256 hashes): 256 shard directories;
    with ``auth``, the first two of the keyed name."""
    if auth is not None:
        return chunk_name(key, auth)[:2]
    return key.hex[:2] if len(key.hex) >= 2 else "00"


def chunk_path(root: Path | str, key: CacheKey, auth: Keyring | None = None) -> Path:
    """``root/<2 hex of the hash>/<safe key name>.safetensors``; built only from hex and the key's
    safe string form, so no input can escape ``root``."""
    return Path(root) / relative_chunk_path(key, auth)


def relative_chunk_path(key: CacheKey, auth: Keyring | None = None) -> str:
    """``chunk_path`` relative to the root, with ``/`` separators (object-store keys)."""
    if auth is not None:
        name = chunk_name(key, auth)
        return f"{name[:2]}/{name}"
    return f"{shard_of(key)}/{chunk_name(key)}"


def namespace_dir(key: CacheKey, auth: Keyring | None = None) -> str:
    """A directory name per model namespace (where a tier groups chunks so): the namespace
    (a digest of it when long); with ``auth``, 32 hex of a keyed hash of it."""
    if auth is not None:
        return auth.name_digest(key.namespace, 16)
    return key.namespace if len(key.namespace) <= 120 else chunk_name(key).split(".")[0]


def is_chunk_file(name: str) -> bool:
    """Whether a directory entry's name is a (finished) chunk file."""
    return name.endswith(FILE_SUFFIX) and not name.startswith(".")


def temp_name(final_name: str) -> str:
    """A fresh temporary name for a file that will be renamed to ``final_name`` (same directory)."""
    return f".{final_name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def is_temp(name: str) -> bool:
    """Whether a directory entry's name is a write in progress, or one a crashed writer left."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def is_stale_temp(name: str, mtime: float, now: float, max_age_s: float = TEMP_MAX_AGE_S) -> bool:
    """Whether a directory entry is a temporary file a crashed writer left (no live write takes
    ``max_age_s``): safe to delete."""
    return is_temp(name) and mtime < now - max_age_s
