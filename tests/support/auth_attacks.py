"""What a writer of a shared store WITHOUT the deployment secret tries, run against any tier.

A :class:`Raw` is an attacker's direct access to one tier's store (files, objects, values): read
and write the bytes under a name, list the names. Each ``check_*`` function stores real chunks
through a real StorageManager configured with ``auth_key_env``, attacks the store behind its
back with the public chunk-file library, and asserts that nothing forged or altered is ever
served, that it is counted as ``auth_failures``, and that the next store replaces it. Used by
tests/faults/test_auth_chunks.py (posix, fsspec on moto's S3, resp on redis-server) and by
tests/faults/test_auth_chunks_netns.py (Mooncake, inside a private network namespace).
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvplug import chunkfile as cf
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, heap_memory_obj
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

SHAPE = (4, 2, 4096)  # 4 layers of 8 KiB: no padding, layer i at header + i * 8 KiB
LAYER = SHAPE[1] * SHAPE[2]
#: Environment variables of the secrets the tests use (set by :func:`set_secrets`).
KEY_A, KEY_B, KEY_C = "TEST_AUTH_A", "TEST_AUTH_B", "TEST_AUTH_C"


def set_secrets(setenv: Callable[[str, str], None]) -> dict[str, str]:
    """Fresh random secrets under :data:`KEY_A`, :data:`KEY_B` (hex) and :data:`KEY_C`
    (base64); returns them (so a test can check that none is ever printed)."""
    secrets = {KEY_A: os.urandom(32).hex(), KEY_B: os.urandom(48).hex(),
               KEY_C: base64.b64encode(os.urandom(32)).decode()}
    for k, v in secrets.items():
        setenv(k, v)
    return secrets


@dataclass
class Raw:
    """An attacker's access to one tier's store, by the tier's name for a key."""

    name_of: Callable[[CacheKey], str]
    read: Callable[[str], bytes | None]
    write: Callable[[str, bytes], None]
    names: Callable[[], list[str]]


def random_obj(seed: int):  # noqa: ANN201 - MemoryObj
    obj = heap_memory_obj(SHAPE, torch.uint8, MemoryFormat.KV_PAGES, 16)
    gen = torch.Generator().manual_seed(seed)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def encoded(k: CacheKey, obj, auth: cf.Keyring | None = None) -> bytes:  # noqa: ANN001
    """The whole chunk file of ``obj`` under ``k`` (what the public library writes)."""
    header, bufs = cf.encode_chunk(k, obj, auth) if auth else cf.encode_chunk(k, obj)
    return header + b"".join(bytes(b) for b in bufs)


def public_fields(chunk: bytes) -> dict[str, str]:
    """A stored chunk's header metadata, read as anyone can (no secret)."""
    (n,) = struct.unpack_from("<Q", chunk, 0)
    return json.loads(chunk[8 : 8 + n])["__metadata__"]


def header_bytes(chunk: bytes) -> int:
    return 8 + struct.unpack_from("<Q", chunk, 0)[0]


def store(mgr: StorageManager, k: CacheKey, seed: int) -> torch.Tensor:
    """Store a random chunk under ``k`` and wait for it; its bytes."""
    obj = random_obj(seed)
    ref = obj.byte_view.clone()
    mgr.batched_put([k], [obj])
    obj.ref_down()
    assert mgr.flush(timeout=30)
    return ref


def _copied(got) -> torch.Tensor | None:  # noqa: ANN001 - a MemoryObj or None
    """The bytes of what a read served (released), or ``None`` for a miss."""
    if got is None:
        return None
    try:
        return got.byte_view.clone()
    finally:
        got.ref_down()


def hit(mgr: StorageManager, k: CacheKey) -> torch.Tensor | None:
    """The bytes a whole-chunk get serves (``None``: a miss), not promoted."""
    return _copied(mgr.get(k, promote=False))


def layer_hit(mgr: StorageManager, k: CacheKey, layer: int) -> torch.Tensor | None:
    """The bytes a one-layer read serves (``None``: a miss)."""
    return _copied(mgr.get_layers(k, layer, 1))


def failures(mgr: StorageManager, tier: str) -> float:
    return mgr.stats()[tier]["auth_failures"]


def forgeries(k: CacheKey, real: bytes | None = None) -> dict[str, bytes]:
    """Chunks an attacker without the secret makes for ``k``: plain (the public library, a valid
    xxh3), signed with the attacker's own secret, a 4 KiB header claiming another format
    version (a squatter: left in place as a rolling upgrade's entry, it would block the name for
    good), and (given ``k``'s real chunk) that one's public key id and salt kept while the MACs
    are the attacker's."""
    evil = random_obj(666)
    own = encoded(k, evil, cf.Keyring(os.urandom(32)))
    squatter = own[: header_bytes(own)].replace(b'"format_version":"1+mac"',
                                                b'"format_version":"2+mac"')
    assert len(squatter) == 4096 and b'"2+mac"' in squatter
    out = {"plain chunk, valid xxh3": encoded(k, evil), "own secret": own,
           "another format version (2+mac), 4 KiB": squatter}
    if real is not None:
        fields = public_fields(real)
        forged = bytearray(encoded(k, evil, cf.Keyring(os.urandom(32))))
        for name in ("mac_key_id", "mac_salt"):
            at = forged.index(f'"{name}":"'.encode()) + len(name) + 4
            forged[at : at + len(fields[name])] = fields[name].encode()
        out["real key id and salt, own MACs"] = bytes(forged)
    return out


# -- the checks ---------------------------------------------------------------------------------

def check_forged_never_served(mgr: StorageManager, tier: str, raw: Raw) -> None:
    """Every forgery, planted where the victim stored nothing yet or written over the victim's
    real chunk, is a miss and counted; the next store replaces it with the real chunk."""
    planted, victim = make_key(1), make_key(2)
    ref = store(mgr, victim, 2)
    real = raw.read(raw.name_of(victim))
    assert real is not None and public_fields(real)["format_version"] == "1+mac"
    attacks = [(planted, what, data) for what, data in forgeries(planted).items()]
    attacks += [(victim, "overwrite: " + what, data)
                for what, data in forgeries(victim, real).items()]
    for k, what, data in attacks:
        before = failures(mgr, tier)
        raw.write(raw.name_of(k), data)
        assert hit(mgr, k) is None, f"{tier}: forged chunk ({what}) served"
        assert failures(mgr, tier) > before, f"{tier}: forgery ({what}) not counted"
        if k == victim:  # replaced by the next store of that key
            store(mgr, victim, 2)
            assert torch.equal(hit(mgr, victim), ref), f"{tier}: not replaced after {what}"
    ref2 = store(mgr, planted, 3)
    assert torch.equal(hit(mgr, planted), ref2), f"{tier}: planted chunk not replaced"


def check_altered_bytes_miss(mgr: StorageManager, tier: str, raw: Raw) -> None:
    """A changed byte in the header (a value only the header MAC protects: the token count) and
    in each layer: the whole chunk and the altered layer miss, counted; another layer of a
    layer-altered chunk still loads, exact (a layer-wise read checks only what it read); the
    next store replaces the chunk."""
    k = make_key(10)
    ref = store(mgr, k, 10)
    name = raw.name_of(k)
    real = raw.read(name)
    hb = header_bytes(real)
    targets = {"header (num_tokens)": real.index(b'"num_tokens":"16"') + 14}
    targets |= {f"layer {i}": hb + i * LAYER + 17 + i for i in range(SHAPE[0])}
    for what, offset in targets.items():
        bad = bytearray(real)
        bad[offset] ^= 0x03
        before = failures(mgr, tier)
        if what.startswith("layer"):
            i = int(what.split()[1])
            other = (i + 1) % SHAPE[0]
            raw.write(name, bytes(bad))
            got = layer_hit(mgr, k, other)
            assert got is None or torch.equal(got, ref.view(SHAPE[0], -1)[other])
            raw.write(name, bytes(bad))
            assert layer_hit(mgr, k, i) is None, f"{tier}: altered {what} served layer-wise"
        raw.write(name, bytes(bad))  # a tier may have deleted it: the attacker puts it back
        assert hit(mgr, k) is None, f"{tier}: chunk with altered {what} served"
        assert failures(mgr, tier) > before, f"{tier}: altered {what} not counted"
        store(mgr, k, 10)
        assert torch.equal(hit(mgr, k), ref), f"{tier}: not replaced after altered {what}"
        real = raw.read(name)  # the replacement (a fresh salt)
        hb = header_bytes(real)


def check_names_keyed(mgr: StorageManager, raw: Raw, plain_name: Callable[[CacheKey], str]
                      ) -> None:
    """Stored names are 64 hex under a 2-hex shard: neither the chunk hash, nor the model, nor
    the name the key has without auth appears in any of them."""
    ks = [make_key(20 + i) for i in range(3)]
    for i, k in enumerate(ks):
        store(mgr, k, 20 + i)
    names = raw.names()
    assert len(names) >= 3
    for k in ks:
        plain = plain_name(k).rsplit("/", 1)[-1].removesuffix(cf.FILE_SUFFIX)
        for n in names:
            assert k.hex[:16] not in n and "victim" not in n and plain not in n, n
    for n in names:
        parts = n.split("/")
        assert re.fullmatch(r"[0-9a-f]{64}\.safetensors", parts[-1]), n
        if len(parts) > 1:
            assert parts[-2] == parts[-1][:2], n


def check_rotation(make: Callable[[str, list[str]], StorageManager], tier: str,
                   raw_of: Callable[[StorageManager], Raw]) -> None:
    """A chunk written under the previous key loads with it in ``auth_previous_key_envs`` (the
    names stay: they are keyed by the oldest key), and does not without it: the same bytes put
    where a manager without that key looks are a miss, counted."""
    k = make_key(30)
    with make(KEY_A, []) as old:
        ref = store(old, k, 30)
        chunk = raw_of(old).read(raw_of(old).name_of(k))
    with make(KEY_B, [KEY_A]) as rotated:
        assert raw_of(rotated).name_of(k) == raw_of(old).name_of(k)
        assert torch.equal(hit(rotated, k), ref), f"{tier}: previous key not accepted"
        assert failures(rotated, tier) == 0
    with make(KEY_B, []) as dropped:
        assert hit(dropped, k) is None
        raw = raw_of(dropped)
        raw.write(raw.name_of(k), chunk)
        assert hit(dropped, k) is None, f"{tier}: a chunk of a dropped key served"
        assert failures(dropped, tier) >= 1
