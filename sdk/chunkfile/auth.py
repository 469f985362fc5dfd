"""Authenticated chunks: the deployment secret, the per-chunk MACs and the keyed names.

With ``auth_key_env`` set, whoever can write a shared store but lacks the secret cannot plant or
alter KV, and whoever can list it cannot confirm a guessed prompt from a name:

* **Keys.** The secret (>= 32 bytes, hex or base64, from the environment variable the config
  names) is the *master key*; its key id is 16 hex of a keyed BLAKE2b of nothing (no secret can
  be learned from it). Previous keys (``auth_previous_key_envs``) only verify.
* **MACs.** Each write draws a fresh 16-byte salt and derives a per-chunk key
  ``K_c = BLAKE2b-256(key=master, person="kvplug-chunkmac1", salt || key string)``. Layer ``i``'s
  tag is AES-256-GCM under ``K_c`` with nonce ``"L" || i`` (11 bytes big-endian), empty plaintext
  and the layer's bytes as associated data: a GMAC, chosen by measurement
  (benchmarks/bench_auth.py: ~25 GB/s here, next to xxh3's ~45 and BLAKE3's ~6). Each ``K_c``
  signs each nonce once, so GMAC's nonce rule holds. The header MAC is the same GMAC (nonce
  ``"H"``) over the padded header with its own tag field zeroed; the header holds the key id, the
  salt, every layer tag, the key fields and the geometry, so a layer-wise read verifies the
  header plus only the layers it read, and a layer cannot move to another chunk or position.
* **Names.** A chunk's name is 64 hex of a keyed BLAKE2b of its key string under a names key
  derived from the *oldest* key of the ring (the last of ``auth_previous_key_envs``, else the
  current one), so a rotation that keeps the old key as previous keeps every name.
* **Encryption** (``encrypt: true``, :mod:`.crypt`): a keyring made with ``encrypt=True`` seals
  each chunk with a :class:`~.crypt.ChunkCipher` instead (each layer AES-256-GCM under a key
  derived from the secret and the chunk's tenant) and accepts only encrypted chunks.

A :class:`Keyring` has no global state: the StorageManager builds one from its config and hands
each tier a view (:meth:`Keyring.for_tier`) that counts and logs once that tier's failures.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Mapping, Sequence

from ..errors import ChunkFormatError, ConfigError
from ..keys import CacheKey
from .crypt import ChunkCipher, TenantKeys

logger = logging.getLogger("kvplug.auth")

MAC_ALGO = "aes256-gmac"
#: Hex digits of one tag (layer or header): 128-bit GMAC tags.
TAG_HEX = 32
KEY_ID_HEX = 16
SALT_BYTES = 16
MIN_SECRET = 32


class AuthError(ChunkFormatError):
    """A chunk that fails authentication: no MAC, an unknown key id, or a tag that mismatches.
    A :class:`~kvplug.errors.ChunkFormatError`, so every reader treats it as a corrupt entry."""


def decode_secret(variable: str, environ: Mapping[str, str] | None = None) -> bytes:
    """The secret held by environment variable ``variable`` (hex or base64, >= 32 bytes).
    Errors name the variable, never the value."""
    env = os.environ if environ is None else environ
    raw = env.get(variable)
    if not raw or not raw.strip():
        raise ConfigError(f"auth: environment variable {variable} (named by auth_key_env or "
                          "auth_previous_key_envs) is not set; set it to a secret of at least "
                          f"{MIN_SECRET} bytes, hex or base64 (e.g. `openssl rand -hex 32`)")
    text = raw.strip()
    secret: bytes | None = None
    if len(text) % 2 == 0 and all(c in "0123456789abcdefABCDEF" for c in text):
        secret = bytes.fromhex(text)
    else:
        std = text.replace("-", "+").replace("_", "/")  # the URL-safe alphabet too
        try:
            secret = base64.b64decode(std + "=" * (-len(std) % 4), validate=True)
        except (binascii.Error, ValueError):
            secret = None
    if secret is None:
        raise ConfigError(f"auth: environment variable {variable} is neither hex nor base64; "
                          f"set it to a secret of at least {MIN_SECRET} bytes, e.g. "
                          "`openssl rand -hex 32`")
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"auth: the secret in environment variable {variable} is "
                          f"{len(secret)} bytes; at least {MIN_SECRET} are needed "
                          "(e.g. `openssl rand -hex 32`)")
    return secret


def _key_id(master: bytes) -> str:
    return hashlib.blake2b(b"", key=master, digest_size=KEY_ID_HEX // 2,
                           person=b"kvplug-key-id-v1").hexdigest()


def _sub(master: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(b"", key=master, digest_size=32, person=person).digest()


def subkey(secret: bytes, purpose: bytes) -> bytes:
    """A 32-byte key for one ``purpose`` (a BLAKE2b personalisation, at most 16 bytes) derived
    from a deployment secret: every engine with the same secret derives the same key, and no
    purpose's key reveals the secret or another purpose's key."""
    return _sub(_normal(secret), purpose)


def _normal(secret: bytes) -> bytes:
    """A secret as a BLAKE2b key (at most 64 bytes: a longer one is hashed down)."""
    return secret if len(secret) <= 64 else hashlib.blake2b(secret, digest_size=64).digest()


@functools.lru_cache(maxsize=1024)
def _nonce(index: int) -> bytes:
    """The GMAC nonce of layer ``index`` (``"L"`` + 11 bytes big-endian)."""
    return b"L" + index.to_bytes(11, "big")


class ChunkMac:
    """The MACs of one chunk: per-chunk key from the master, the salt and the key string."""

    __slots__ = ("key_id", "salt", "_aead", "_ring")

    def __init__(self, ring: Keyring, key_id: str, master: bytes, salt: bytes,
                 key: CacheKey) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._ring = ring
        self.key_id = key_id
        self.salt = salt
        k_c = hashlib.blake2b(salt + b"\0" + key.to_string().encode(), key=master,
                              digest_size=32, person=b"kvplug-chunkmac1").digest()
        self._aead = AESGCM(k_c)

    def __repr__(self) -> str:
        return f"ChunkMac(key_id={self.key_id!r})"

    def layer_tag(self, index: int, data) -> str:  # noqa: ANN001 - any buffer
        """Layer ``index``'s tag (32 hex)."""
        return self._aead.encrypt(_nonce(index), b"", data).hex()

    def verify_layer(self, index: int, data, expected: str) -> bool:  # noqa: ANN001 - buffer
        """Whether ``data`` is layer ``index`` as signed (``expected``: its stored tag);
        a mismatch is counted and logged once."""
        try:
            want = bytes.fromhex(expected)
        except ValueError:
            want = b""
        if hmac.compare_digest(self._aead.encrypt(_nonce(index), b"", data), want):
            return True
        self._ring.failed(f"layer {index} MAC mismatch")
        return False

    def header_tag(self, raw: bytes) -> str:
        """The header's tag (32 hex) over its bytes with the tag field zeroed."""
        return self._aead.encrypt(b"H" + bytes(11), b"", raw).hex()

    def check(self, expected: str, actual: str, what: str) -> bool:
        """Whether two tags agree (constant time); a mismatch is counted and logged once."""
        if hmac.compare_digest(expected, actual):
            return True
        self._ring.failed(f"{what} MAC mismatch")
        return False


class Keyring:
    """The deployment's MAC keys: the current one signs, previous ones still verify.

    Its repr shows key ids only; the secrets never reach a log, an exception or a command's
    output. :meth:`for_tier` gives each tier a view with its own failure count."""

    def __init__(self, current: bytes, previous: Sequence[bytes] = (), tier: str = "",
                 encrypt: bool = False) -> None:
        if len(current) < MIN_SECRET or any(len(p) < MIN_SECRET for p in previous):
            raise ConfigError(f"auth: secrets need at least {MIN_SECRET} bytes")
        try:
            import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401 - checked at start
        except ImportError:
            raise ConfigError("auth_key_env needs the 'cryptography' package (a kvplug "
                              "dependency): pip install 'cryptography>=42'") from None
        current, previous = _normal(current), tuple(_normal(p) for p in previous)
        self._keys = {_key_id(current): current}
        for p in previous:
            self._keys.setdefault(_key_id(p), p)
        self.key_id = _key_id(current)
        self._current = current
        self._previous = tuple(previous)
        oldest = previous[-1] if previous else current
        self._names = _sub(oldest, b"kvplug-names-v1")
        self.tier = tier
        self._lock = threading.Lock()
        self.failures = 0
        #: ``encrypt: true``: chunks are sealed by a :class:`~.crypt.ChunkCipher` (and only
        #: encrypted chunks are accepted).
        self.encrypts = encrypt
        self._tenant_keys = TenantKeys()

    @classmethod
    def from_env(cls, variable: str, previous: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None, encrypt: bool = False) -> Keyring:
        """The keyring of the secrets held by these environment variables (``ConfigError``
        naming a variable that is unset, short or undecodable); ``encrypt``: see
        :attr:`encrypts`."""
        return cls(decode_secret(variable, environ),
                   [decode_secret(v, environ) for v in previous], encrypt=encrypt)

    def for_tier(self, tier: str) -> Keyring:
        """A view of the same keys that counts and logs (once) the failures of ``tier``."""
        view = Keyring(self._current, self._previous, tier, self.encrypts)
        view._tenant_keys = self._tenant_keys  # derived once for every tier
        return view

    def __repr__(self) -> str:
        return (f"Keyring(key_id={self.key_id!r}, previous={len(self._keys) - 1}, "
                f"tier={self.tier!r}, encrypts={self.encrypts})")

    __str__ = __repr__

    def __reduce__(self):  # noqa: ANN204 - never pickled (a secret would travel with it)
        raise TypeError("a Keyring is not picklable: build it from the config in each process")

    # -- chunks ---------------------------------------------------------------------------------
    def seal(self, key: CacheKey) -> ChunkMac | ChunkCipher:
        """The MACs for a fresh write of ``key``'s chunk (current key, new salt); with
        :attr:`encrypts`, its cipher (the current key's tenant key of ``key.tenant``)."""
        salt = secrets.token_bytes(SALT_BYTES)
        if self.encrypts:
            return ChunkCipher(self, self.key_id, self._tenant_keys.get(
                self.key_id, self._current, key.tenant), salt, key.tenant)
        return ChunkMac(self, self.key_id, self._current, salt, key)

    def _stored(self, key_id: str, salt_hex: str, what: str) -> tuple[bytes, bytes]:
        """The secret a stored chunk's key id names and its salt; :class:`AuthError` (counted)
        for an unknown key id or a malformed salt (``what``: "encrypted", "signed")."""
        master = self._keys.get(key_id)
        if master is None:
            raise self.failure(f"chunk {what} with unknown key id {key_id[:16]!r}")
        try:
            salt = bytes.fromhex(salt_hex)
        except ValueError:
            salt = b""
        if len(salt) != SALT_BYTES:
            raise self.failure(f"chunk {what} with a malformed salt")
        return master, salt

    def cipher(self, key_id: str, salt_hex: str, tenant: str) -> ChunkCipher:
        """The cipher of a stored encrypted chunk of ``tenant``; :class:`AuthError` (counted)
        for an unknown key id or a malformed salt."""
        master, salt = self._stored(key_id, salt_hex, "encrypted")
        return ChunkCipher(self, key_id, self._tenant_keys.get(key_id, master, tenant), salt,
                           tenant)

    def opener(self, key_id: str, salt_hex: str, key: CacheKey) -> ChunkMac:
        """The MACs of a stored chunk; :class:`AuthError` (counted) for an unknown key id or a
        malformed salt."""
        master, salt = self._stored(key_id, salt_hex, "signed")
        return ChunkMac(self, key_id, master, salt, key)

    def failure(self, why: str) -> AuthError:
        """Count an authentication failure and return the error to raise."""
        self.failed(why)
        return AuthError(f"authentication failed: {why}")

    def failed(self, why: str) -> None:
        """Count one failure of this tier; the first is logged (later ones only counted)."""
        with self._lock:
            self.failures += 1
            first = self.failures == 1
        if first:
            logger.warning("tier %r: a chunk failed authentication (%s): treated as a miss, "
                           "never served, replaced by the next store; further failures are "
                           "counted in stats (auth_failures), not logged", self.tier or "?", why)

    # -- names ----------------------------------------------------------------------------------
    def name_digest(self, text: str, digest_size: int = 32) -> str:
        """Keyed hex digest of ``text`` (a key string, a namespace) under the names key."""
        return hashlib.blake2b(text.encode(), key=self._names, digest_size=digest_size).hexdigest()
