"""Typed errors. Every message names the bad value and what would be accepted."""

from __future__ import annotations


class KVPlugError(Exception):
    """Base class of every error kvplug raises on purpose."""


class ConfigError(KVPlugError, ValueError):
    """A config key or value is wrong (unknown key, bad type, out-of-range size...)."""


class BackendNotFoundError(KVPlugError, LookupError):
    """A tier names a backend that no installed package declares."""


class BackendConflictError(KVPlugError):
    """Two installed packages declare the same backend name."""


class BackendLoadError(KVPlugError, ImportError):
    """A backend's entry point could not be imported or is not a class."""


class BackendValidationError(KVPlugError, TypeError):
    """A backend does not honour the hook contract (wrong argument names, missing hooks...)."""


class BackendContractWarning(UserWarning):
    """A plugin loads but breaks a rule that cannot be told from its code alone (``contains``
    takes ``pin`` but there is no ``unpin``: harmless where the tier ignores ``pin``, a leak of
    pins where it does not)."""


class MemoryObjFreedError(KVPlugError, RuntimeError):
    """A memory object was used after its last reference was dropped."""


class ChunkFormatError(KVPlugError, ValueError):
    """Bytes claiming to be a kvplug chunk file are truncated, corrupt or of another version."""


class ChunkVersionError(ChunkFormatError):
    """A kvplug chunk file of another format version: a miss, never deleted (rolling upgrades)."""


class CodecNotFoundError(ConfigError, LookupError):
    """A tier names a codec that no installed package declares."""


class CodecError(KVPlugError, ValueError):
    """Encoded chunk bytes cannot be decoded (wrong codec metadata, truncated or corrupt payload,
    codec not installed): a miss, never bytes."""


class CodecMissingError(CodecError):
    """A chunk was stored through a codec that is not installed in this process."""
