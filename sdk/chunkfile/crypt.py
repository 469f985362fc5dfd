"""Encryption at rest (``encrypt: true``): each layer of a chunk AES-256-GCM, per tenant.

With ``encrypt: true`` (which needs ``auth_key_env``) every tier that stores chunks through
:mod:`kvplug.chunkfile` with its ``ctx.auth`` keeps only ciphertext; L1 (host memory) keeps
plaintext. The keys, none of them ever stored:

* **Tenant key** ``K_t = HKDF-SHA256(ikm=master, info="kvplug-encrypt-v1" || 0 || tenant id)``:
  one per tenant (the 16 hex of ``key.tenant``, i.e. of the request's ``cache_salt``), one for
  the requests without a tenant (the empty id: the *deployment key*), one set per master secret
  of the ring (the current one encrypts, previous ones still decrypt: a rotation).
* **Chunk key** ``K_c = BLAKE2b-256(key=K_t, person="kvplug-chunkenc1", salt)``, where ``salt`` is
  16 random bytes drawn for each write and recorded in the header (``mac_salt``).
* Under ``K_c``: layer ``i`` is AES-256-GCM with nonce ``"L" || i`` (11 bytes big-endian), no
  associated data; its 16-byte tag is the layer's authenticator (``checksums`` in the header,
  in place of a GMAC). The header's veiled fields (the key fields, the object's shape, dtype,
  format, token count and codec) are sealed with nonce ``"E"``; the whole header is then
  authenticated by a GMAC with nonce ``"H"``, as an authenticated chunk's is.

**Nonces.** Every ``(K_c, nonce)`` pair is used for one plaintext only: the nonces differ per
layer and per purpose, and ``K_c`` is fresh for each write (a 128-bit random salt). Storing the
same chunk twice, even with identical bytes, draws another salt, so another key: no nonce is
ever reused under a key, and the two ciphertexts are unrelated (a reader of the store cannot
tell that two files hold the same KV from their bytes). Random 96-bit nonces under the tenant
key were the alternative; they would cap a tenant at about 2^32 layer writes per key
(NIST SP 800-38D) and still need a stored nonce per layer.

A :class:`ChunkCipher` answers the calls :mod:`.format` and :mod:`.checksums` make of an
authenticated chunk's :class:`~.auth.ChunkMac` (``key_id``, ``salt``, ``header_tag``,
``verify_layer``, ``check``), so every reader that verifies layers after reading them decrypts
them by the same call, in place.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .auth import Keyring

#: ``checksum_algo`` of an encrypted chunk: one AES-256-GCM tag per layer.
ENC_ALGO = "aes256-gcm"
#: Suffix of the format version of an encrypted chunk (``"1+enc"``; codec or not: that is veiled).
ENC_VERSION_SUFFIX = "+enc"
TAG_BYTES = 16
_HKDF_INFO = b"kvplug-encrypt-v1\0"
_SEAL_NONCE = b"E" + bytes(11)
_HEADER_NONCE = b"H" + bytes(11)
_TENANT_KEYS = 4096  # tenant keys kept per keyring (derived again when dropped)
#: Layers up to this size are decrypted through a scratch copy (measured: benchmarks/
#: bench_encrypt.py --primitives), larger ones in place through a GCM context.
_SCRATCH_MAX = 64 << 10


_local = threading.local()


@functools.lru_cache(maxsize=1024)
def _layer_nonce(index: int) -> bytes:
    return b"L" + index.to_bytes(11, "big")


def _scratch(size: int) -> memoryview:
    """This thread's scratch, exactly ``size`` bytes (grown when a larger layer comes)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < size:
        buf = _local.scratch = memoryview(bytearray(size))
    return buf[:size]


def _decrypt_in_place(key: object, index: int, src: memoryview, dst: memoryview,
                      tag: bytes) -> bool:
    """:meth:`ChunkCipher._decrypt` through a GCM context (``key``: an ``algorithms.AES``)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, modes

    dec = Cipher(key, modes.GCM(_layer_nonce(index), tag)).decryptor()
    dec.update_into(src, dst)
    try:
        dec.finalize()
    except _invalid_tag():
        return False
    return True


@functools.cache
def _invalid_tag() -> type[Exception]:
    from cryptography.exceptions import InvalidTag

    return InvalidTag


def tenant_key(master: bytes, tenant: str) -> bytes:
    """The 32-byte key of ``tenant`` (16 hex, ``""`` for the deployment key) under ``master``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_HKDF_INFO + tenant.encode()).derive(master)


class TenantKeys:
    """Tenant keys by ``(key id, tenant)``, derived once and kept (bounded, thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str], bytes] = {}

    def get(self, key_id: str, master: bytes, tenant: str) -> bytes:
        with self._lock:
            found = self._keys.get((key_id, tenant))
        if found is not None:
            return found
        derived = tenant_key(master, tenant)
        with self._lock:
            if len(self._keys) >= _TENANT_KEYS:
                self._keys.clear()
            self._keys[(key_id, tenant)] = derived
        return derived

    def __repr__(self) -> str:
        return f"TenantKeys({len(self._keys)} derived)"


class ChunkCipher:
    """The keys of one encrypted chunk: ``K_c`` from its tenant key and its salt."""

    __slots__ = ("key_id", "salt", "tenant", "_aead", "_key", "_ring")

    def __init__(self, ring: Keyring, key_id: str, tenant_key_: bytes, salt: bytes,
                 tenant: str) -> None:
        from cryptography.hazmat.primitives.ciphers import algorithms
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._ring = ring
        self.key_id = key_id
        self.salt = salt
        self.tenant = tenant
        k_c = hashlib.blake2b(salt, key=tenant_key_, digest_size=32,
                              person=b"kvplug-chunkenc1").digest()
        self._aead = AESGCM(k_c)
        self._key = algorithms.AES(k_c)

    def __repr__(self) -> str:
        return f"ChunkCipher(key_id={self.key_id!r})"

    # -- layers ---------------------------------------------------------------------------------
    def encrypt_layers(self, views: Sequence[memoryview], out: np.ndarray) -> list[str]:
        """Encrypt each layer ``views[i]`` into ``out`` (``len(views) * n + TAG_BYTES`` bytes,
        the layers back to back from 0, with room for the last tag); their tags (32 hex)."""
        tags: list[str] = []
        target = memoryview(out).cast("B")
        at = 0
        for i, view in enumerate(views):
            n = len(view)
            self._aead.encrypt_into(_layer_nonce(i), view, None, target[at : at + n + TAG_BYTES])
            tags.append(bytes(target[at + n : at + n + TAG_BYTES]).hex())
            at += n
        return tags

    def verify_layer(self, index: int, data, expected: str) -> bool:  # noqa: ANN001 - buffer
        """Decrypt layer ``index`` (its ciphertext ``data``) in place, checking its tag
        (``expected``); ``data`` read-only (an inspection) is decrypted to a scratch copy only
        to check the tag. A mismatch is counted and logged once (an authentication failure),
        and writable ``data`` is zeroed (nothing a forger chose is left for a careless caller)."""
        try:
            tag = bytes.fromhex(expected)
        except ValueError:
            tag = b""
        view = memoryview(data).cast("B")
        if len(tag) != TAG_BYTES:
            ok = False
        elif view.readonly:
            ok = self._decrypt(index, view, memoryview(bytearray(len(view))), tag)
        else:
            ok = self._decrypt(index, view, view, tag)
        if not ok:
            if not view.readonly:
                view[:] = bytes(len(view))
            self._ring.failed(f"layer {index} does not decrypt (tag mismatch)")
        return ok

    def _decrypt(self, index: int, src: memoryview, dst: memoryview, tag: bytes) -> bool:
        """Layer ``index`` decrypted from ``src`` into ``dst`` (the same memory, or a throwaway
        buffer), tag checked. The AEAD call wants ciphertext and tag back to back: a small
        layer goes to this thread's scratch first (a copy costs less than a cipher context);
        a large one is decrypted where it is, through a GCM context with the tag."""
        n = len(src)
        if n > _SCRATCH_MAX:
            return _decrypt_in_place(self._key, index, src, dst, tag)
        scratch = _scratch(n + TAG_BYTES)
        scratch[:n] = src
        scratch[n:] = tag
        try:
            self._aead.decrypt_into(_layer_nonce(index), scratch, None, dst)
        except _invalid_tag():
            return False
        return True

    # -- the header -----------------------------------------------------------------------------
    def seal_fields(self, plain: bytes) -> str:
        """The veiled header fields (canonical JSON) sealed: hex of ciphertext + tag."""
        return self._aead.encrypt(_SEAL_NONCE, plain, None).hex()

    def open_fields(self, sealed: str) -> bytes:
        """The veiled header fields; :class:`~.auth.AuthError` (counted) if they do not open."""
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(_SEAL_NONCE, bytes.fromhex(sealed), None)
        except (ValueError, InvalidTag):
            raise self._ring.failure("the header's sealed fields do not decrypt") from None

    def header_tag(self, raw: bytes) -> str:
        """The header's tag (32 hex): a GMAC over its bytes with the tag field zeroed."""
        return self._aead.encrypt(_HEADER_NONCE, b"", raw).hex()

    def check(self, expected: str, actual: str, what: str) -> bool:
        """Whether two tags agree (constant time); a mismatch is counted and logged once."""
        if hmac.compare_digest(expected, actual):
            return True
        self._ring.failed(f"{what} tag mismatch")
        return False
