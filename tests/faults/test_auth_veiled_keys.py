"""With ``auth_key_env``, no stored byte lets a reader of the store confirm a guessed prompt.

A chunk hash is computable by anyone from a guessed prompt (vLLM's block hash, fixed seed): if
it (or the key string that holds it) appears anywhere in a store, a reader with no secret
confirms the guess. Keyed names hide it from names; the header must record a *veiled* key too
(``chunk_hash`` replaced by a keyed digest: :func:`kvplug.chunkfile.stored_key`). These tests
store real chunks on real tiers (posix files, resp on redis-server), then read every stored
byte and every name as an attacker would and look for the hash (hex, upper-case hex, raw bytes)
and the key string. Negative control: without auth, the hash is found (so the search works).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.keys import CacheKey
from kvplug.storage_manager import StorageManager

from tests.support import auth_attacks as aa
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def secrets(monkeypatch) -> dict[str, str]:
    return aa.set_secrets(monkeypatch.setenv)


def _key() -> CacheKey:
    """A key with a fresh random 32-byte hash (a sha256 block hash's size)."""
    return CacheKey("victim/model", "bfloat16", "LBHNC-bs16", 1, 0, os.urandom(32))


def _cfg(tier: dict, auth: bool) -> dict:
    cfg: dict = {"chunk_size": 16, "tiers": [tier]}
    if auth:
        cfg["auth_key_env"] = aa.KEY_A
    return cfg


def _posix_bytes(root: Path) -> list[bytes]:
    """Every name (relative path) and every file's bytes under ``root``, hidden ones included."""
    out: list[bytes] = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out.append(str(p.relative_to(root)).encode())
            if p.is_file() and not p.is_symlink():
                out.append(p.read_bytes())
    return out


def _redis_bytes(srv: RedisServer) -> list[bytes]:
    """Every key and every value in the server, whatever its type."""
    client = srv.client()
    out: list[bytes] = []
    try:
        for name in client.keys("*"):
            out.append(name)
            kind = client.type(name).decode()
            if kind == "string":
                out.append(client.get(name) or b"")
            elif kind == "hash":
                out.extend(b for kv in client.hgetall(name).items() for b in kv)
            elif kind == "set":
                out.extend(client.smembers(name))
            elif kind == "list":
                out.extend(client.lrange(name, 0, -1))
            elif kind == "zset":
                out.extend(client.zrange(name, 0, -1))
            else:
                out.append(client.dump(name) or b"")
    finally:
        client.close()
    return out


def _leaks(stored: list[bytes], k: CacheKey) -> list[str]:
    """Which forms of ``k``'s hash (or its key string) occur in ``stored``."""
    forms = {"hex": k.hex.encode(), "HEX": k.hex.upper().encode(), "raw": k.chunk_hash,
             "key string": k.to_string().encode(),
             "hex prefix": k.hex[:16].encode()}
    return sorted(what for what, needle in forms.items() if any(needle in b for b in stored))


def _store_and_read(mgr: StorageManager) -> tuple[CacheKey, list[CacheKey]]:
    """Store two chunks; both load back exact (whole, and one layer)."""
    ks = [_key(), _key()]
    for i, k in enumerate(ks):
        ref = aa.store(mgr, k, 40 + i)
        assert torch.equal(aa.hit(mgr, k), ref), "stored chunk not served back"
        assert torch.equal(aa.layer_hit(mgr, k, 1), ref.view(aa.SHAPE[0], -1)[1])
    return ks[0], ks


def _check(make: Callable[[bool], StorageManager], stored: Callable[[], list[bytes]],
           tier: str) -> None:
    with make(False) as mgr:  # negative control: without auth the hash is in the store
        _, ks = _store_and_read(mgr)
    found = stored()
    for k in ks:
        assert "hex" in _leaks(found, k), "negative control: plain chunk hash not found"
    with make(True) as mgr:
        _, ks = _store_and_read(mgr)
        assert mgr.stats()[tier]["auth_failures"] == 0
    found = stored()
    for k in ks:
        leaks = _leaks(found, k)
        assert not leaks, f"{tier}: with auth_key_env the store still holds the chunk hash " \
                          f"({', '.join(leaks)}): a reader confirms a guessed prompt"


def test_posix_stores_no_chunk_hash(secrets, tmp_path):
    root = tmp_path / "store"

    def make(auth: bool) -> StorageManager:
        path = root / ("auth" if auth else "plain")
        return StorageManager(_cfg({"backend": "posix", "options": {
            "path": str(path), "capacity": "64MiB"}}, auth))

    _check(make, lambda: _posix_bytes(root), "posix")


def test_resp_stores_no_chunk_hash(secrets, redis_server):  # noqa: F811 - fixture
    def make(auth: bool) -> StorageManager:
        if auth:
            redis_server.client().flushall()  # the plain run's values are not this run's
        return StorageManager(_cfg({"backend": "resp", "options": {
            "url": redis_server.url, "negative_cache_s": 0, "timeout_s": 2.0}}, auth))

    _check(make, lambda: _redis_bytes(redis_server), "resp")


def test_stored_key_is_one_keyed_rule(secrets):
    """The veil: identity without a keyring; with one, the same key but for a keyed 32-byte
    hash, stable across a rotation that keeps the old key (as names are), another one under
    another secret; the header records it and the MAC is bound to it."""
    k = _key()
    assert cf.stored_key(k, None) is k
    a = cf.Keyring.from_env(aa.KEY_A)
    veiled = cf.stored_key(k, a)
    assert veiled.namespace == k.namespace and len(veiled.chunk_hash) == 32
    assert veiled.chunk_hash != k.chunk_hash and cf.stored_key(k, a) == veiled
    assert cf.stored_key(k, cf.Keyring.from_env(aa.KEY_B, [aa.KEY_A])) == veiled
    assert cf.stored_key(k, cf.Keyring.from_env(aa.KEY_B)) != veiled
    data = aa.encoded(k, aa.random_obj(1), a)
    assert aa.public_fields(data)["chunk_hash"] == veiled.hex
    header = cf.decode_header(data, len(data), a)
    assert header.key == veiled
