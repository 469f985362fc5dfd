"""Encryption at rest (``encrypt: true``) checked against any tier through an attacker's raw access.

Each ``check_*`` stores real chunks of random bytes through a real StorageManager configured
with ``auth_key_env`` and ``encrypt: true``, reads or rewrites the store behind its back (an
:class:`~tests.support.auth_attacks.Raw`), and asserts: what is served is exactly what was
stored (whole and layer by layer); the store holds no plaintext byte run and no readable key
field; every forgery (another secret, another tenant's chunk, a changed byte, swapped layers, a
downgrade to an unencrypted chunk) is a miss, counted as ``auth_failures``, and the next store
replaces it. Used by tests/faults/test_encrypt_chunks.py (posix, fsspec on moto's S3, resp on
redis-server, a third-party-style tier) and tests/faults/test_auth_chunks_netns.py (Mooncake).
"""

from __future__ import annotations

import json
import os

import torch
from kvplug import chunkfile as cf
from kvplug.keys import CacheKey
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

from tests.support import auth_attacks as aa

#: Two tenants' ids (16 hex, what ``tenant_id`` gives for their salts).
TENANT_A, TENANT_B = "a" * 16, "b" * 16
#: What a readable header shows of the chunks stored here (model, KV dtype and layout,
#: parallelism, the object's shape, dtype and token count): no encrypted store may show it (the
#: safetensors tensor table's own ``"shape":[...]`` and ``"dtype":"U8"`` are not these).
READABLE = (make_key(0).model.split("/")[0].encode(), b"bfloat16", b"LBHNC", b'"world_size"',
            b'"shape":"', b'"dtype":"uint8"', b'"num_tokens"', b'"model"')


def tenant_key(i: int, tenant: str) -> CacheKey:
    """``make_key(i)`` of ``tenant``: the same chunk hash, another tenant."""
    return make_key(i, tenant=tenant)


def plaintext_runs(ref: torch.Tensor, width: int = 32, step: int = 997) -> list[bytes]:
    """Runs of ``width`` plaintext bytes from all over ``ref`` (every layer, unaligned offsets):
    none of them may appear in a store that encrypts."""
    data = bytes(ref.numpy())
    return [data[i : i + width] for i in range(0, len(data) - width, step)]


def assert_no_plaintext(stored: bytes, ref: torch.Tensor, what: str) -> None:
    runs = plaintext_runs(ref)
    assert runs and not any(run in stored for run in runs), f"{what}: plaintext in the store"
    for word in READABLE:
        assert word not in stored, f"{what}: {word!r} readable in the store"


def check_round_trip_ciphertext(mgr: StorageManager, tier: str, raw: aa.Raw) -> None:
    """Random chunks of two tenants and of none come back exact, whole and by layer (a reference
    check); the stored value is ``1+enc`` ciphertext: no plaintext run, no readable key field
    or meta; the same chunk stored twice gives unrelated ciphertexts (a fresh key per write)."""
    keys = [make_key(40), tenant_key(41, TENANT_A), tenant_key(41, TENANT_B)]
    for i, k in enumerate(keys):
        ref = aa.store(mgr, k, 40 + i)
        got = aa.hit(mgr, k)
        assert got is not None and torch.equal(got, ref), f"{tier}: {k} round trip"
        rows = ref.view(aa.SHAPE[0], -1)
        for layer in range(aa.SHAPE[0] if mgr.reads_layers(tier) else 0):  # mooncake: whole only
            part = aa.layer_hit(mgr, k, layer)
            assert part is not None and torch.equal(part, rows[layer]), f"{tier}: layer {layer}"
        stored = raw.read(raw.name_of(k))
        assert stored is not None
        fields = aa.public_fields(stored)
        assert fields["format_version"] == "1+enc" and fields["checksum_algo"] == "aes256-gcm"
        assert set(fields) == {"header_mac", "format", "format_version", "num_layers",
                               "num_blocks", "page_bytes", "mac_key_id", "mac_salt", "tenant",
                               "sealed", "checksum_algo", "checksums"}, sorted(fields)
        assert fields["tenant"] == k.tenant
        assert_no_plaintext(stored, ref, f"{tier}: {k}")
    assert aa.failures(mgr, tier) == 0
    # The same key stored again (deleted first, so the tier writes it anew): another salt, so
    # another key: no 16-byte block of ciphertext repeats at the same place. Not on Mooncake,
    # which refuses to remove an object for 10 s after any read or lookup of it (its lease);
    # the salt is drawn by the chunk library, the same for every tier.
    if tier == "mooncake":
        return
    k = keys[0]
    first = raw.read(raw.name_of(k))
    mgr.evict([k])
    assert aa.hit(mgr, k) is None
    aa.store(mgr, k, 40)
    second = raw.read(raw.name_of(k))
    hb = aa.header_bytes(first)
    assert len(first) == len(second) and aa.header_bytes(second) == hb
    same = [i for i in range(hb, len(first), 16) if first[i : i + 16] == second[i : i + 16]]
    assert not same, f"{tier}: a rewrite repeated ciphertext blocks {same[:4]}"
    assert aa.public_fields(first)["mac_salt"] != aa.public_fields(second)["mac_salt"]


def _swap_layers(chunk: bytes, a: int, b: int) -> bytes:
    hb, n = aa.header_bytes(chunk), aa.LAYER
    out = bytearray(chunk)
    out[hb + a * n : hb + (a + 1) * n] = chunk[hb + b * n : hb + (b + 1) * n]
    out[hb + b * n : hb + (b + 1) * n] = chunk[hb + a * n : hb + (a + 1) * n]
    return bytes(out)


def _retag_tenant(chunk: bytes, tenant: str) -> bytes:
    """``chunk`` with the readable tenant id replaced (same length, so the layout holds)."""
    old = aa.public_fields(chunk)["tenant"]
    return chunk.replace(f'"tenant":"{old}"'.encode(), f'"tenant":"{tenant}"'.encode(), 1)


def forgeries(mgr: StorageManager, raw: aa.Raw, victim: CacheKey, secret_env: str
              ) -> dict[str, bytes]:
    """What an attacker makes for ``victim`` (of tenant B), from the public library, another
    secret and the real chunks in the store (``victim``'s own and tenant A's of the same hash)."""
    evil = aa.random_obj(666)
    other_tenant = tenant_key(int.from_bytes(victim.chunk_hash[:4], "big"), TENANT_A)
    aa.store(mgr, other_tenant, 7)
    theirs = raw.read(raw.name_of(other_tenant))
    real = raw.read(raw.name_of(victim))
    assert theirs is not None and real is not None
    same_secret_mac = cf.Keyring.from_env(secret_env)  # the deployment's secret, no encryption
    hb = aa.header_bytes(real)
    sealed = bytearray(real)
    at = sealed.index(b'"sealed":"') + len(b'"sealed":"') + 5
    sealed[at] = ord("0") if sealed[at] != ord("0") else ord("1")
    return {
        "downgrade: plain chunk, valid xxh3": aa.encoded(victim, evil),
        "downgrade: MAC'd with the deployment's own secret, not encrypted":
            aa.encoded(victim, evil, same_secret_mac),
        "encrypted under another secret": aa.encoded(
            victim, evil, cf.Keyring(os.urandom(32), encrypt=True)),
        "another tenant's real chunk of the same hash": theirs,
        "another tenant's real chunk, its tenant id rewritten": _retag_tenant(
            theirs, victim.tenant),
        "the victim's chunk, layers 0 and 1 swapped": _swap_layers(real, 0, 1),
        "the victim's chunk, a layer byte flipped": real[: hb + 5] + bytes(
            [real[hb + 5] ^ 1]) + real[hb + 6 :],
        "the victim's chunk, a sealed header byte changed": bytes(sealed),
        "the victim's chunk, a layer tag changed": real.replace(
            json.loads(aa.public_fields(real)["checksums"])[2].encode(),
            b"0" * cf.auth.TAG_HEX, 1),
    }


def check_forgeries_never_served(mgr: StorageManager, tier: str, raw: aa.Raw,
                                 secret_env: str) -> None:
    """Each forgery written over the victim's chunk: the whole chunk and every layer miss,
    each counted as an authentication failure, never served; the next store replaces it."""
    victim = tenant_key(50, TENANT_B)
    ref = aa.store(mgr, victim, 50)
    for what, data in forgeries(mgr, raw, victim, secret_env).items():
        before = aa.failures(mgr, tier)
        raw.write(raw.name_of(victim), data)
        got = aa.hit(mgr, victim)
        assert got is None, f"{tier}: forgery served ({what})"
        assert aa.failures(mgr, tier) > before, f"{tier}: forgery not counted ({what})"
        if "layer" in what:  # the altered layer itself, read alone
            raw.write(raw.name_of(victim), data)
            bad = 0 if "swapped" in what else (2 if "tag" in what else 0)
            assert aa.layer_hit(mgr, victim, bad) is None, f"{tier}: {what}, layer-wise"
        aa.store(mgr, victim, 50)
        got = aa.hit(mgr, victim)
        assert got is not None and torch.equal(got, ref), f"{tier}: not replaced after {what}"


def check_rotation(make, tier: str, raw_of) -> None:  # noqa: ANN001
    """Encrypted under the previous secret: decrypts with it in ``auth_previous_key_envs`` and
    the new writes are encrypted under the current one; without it, a miss, counted."""
    k = tenant_key(60, TENANT_A)
    with make(aa.KEY_A, []) as old:
        ref = aa.store(old, k, 60)
        chunk = raw_of(old).read(raw_of(old).name_of(k))
    with make(aa.KEY_B, [aa.KEY_A]) as rotated:
        got = aa.hit(rotated, k)
        assert got is not None and torch.equal(got, ref), f"{tier}: previous key not accepted"
        assert aa.failures(rotated, tier) == 0
        k2 = tenant_key(61, TENANT_A)
        aa.store(rotated, k2, 61)
        raw = raw_of(rotated)
        written = aa.public_fields(raw.read(raw.name_of(k2)))
        assert written["mac_key_id"] == rotated.auth.key_id != aa.public_fields(chunk)[
            "mac_key_id"]
    with make(aa.KEY_B, []) as dropped:
        raw = raw_of(dropped)
        raw.write(raw.name_of(k), chunk)
        assert aa.hit(dropped, k) is None, f"{tier}: a chunk of a dropped key served"
        assert aa.failures(dropped, tier) >= 1
