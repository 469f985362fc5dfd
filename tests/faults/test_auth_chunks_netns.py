"""Authenticated chunks on a real Mooncake master (tests/support/auth_attacks.py's checks). Runs only
inside a private network namespace: tests/faults/test_auth_chunks.py starts it under ``unshare -n``,
with the secrets in the environment."""

from __future__ import annotations

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

from tests.support import auth_attacks as aa
from tests.support.mooncake_store import MooncakeMaster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def master(tmp_path):
    m = MooncakeMaster(tmp_path / "mooncake")
    yield m
    m.stop()


def manager(master: MooncakeMaster, current: str | None = aa.KEY_A,
            previous: list[str] | None = None, encrypt: bool = False) -> StorageManager:
    options = {"master": master.address, "global_segment_size": "64MiB",
               "local_buffer_size": "32MiB", "timeout_s": 2.0, "negative_cache_s": 0}
    cfg: dict = {"chunk_size": 16, "tiers": [{"backend": "mooncake", "timeout_s": 10.0,
                                              "options": options}]}
    if current:
        cfg["auth_key_env"] = current
    if previous:
        cfg["auth_previous_key_envs"] = previous
    if encrypt:
        cfg["encrypt"] = True
    return StorageManager(cfg)


def raw_of(mgr: StorageManager, keys: list | None = None) -> aa.Raw:
    backend = mgr.backend(0)

    def read(name: str) -> bytes | None:
        data = backend.io.get(name)
        return None if data is None else bytes(data)

    def write(name: str, data: bytes) -> None:
        assert backend.io.set_many([(name, data)]) == [None]

    def names() -> list[str]:  # Mooncake lists nothing: the names of what was stored, checked
        out = [backend.name_of(make_key(20 + i)) for i in range(3)]
        assert all(backend.io.get(n) is not None for n in out)
        return [n.removeprefix(backend.opts.prefix) for n in out]

    return aa.Raw(name_of=backend.name_of, read=read, write=write, names=names)


def test_negative_control_forged_chunk_served_without_auth(master):
    with manager(master, None) as mgr:
        raw, k = raw_of(mgr), make_key(1)
        raw.write(raw.name_of(k), aa.forgeries(k)["plain chunk, valid xxh3"])
        assert torch.equal(aa.hit(mgr, k), aa.random_obj(666).byte_view)


def test_forged_and_altered_never_served(master):
    with manager(master) as mgr:
        raw = raw_of(mgr)
        aa.check_forged_never_served(mgr, "mooncake", raw)
        aa.check_altered_bytes_miss(mgr, "mooncake", raw)
        aa.check_names_keyed(mgr, raw, cf.chunk_name)


def test_rotation(master):
    """Objects live in the segments managers lend: the writer stays up while others read."""
    k = make_key(30)
    with manager(master, aa.KEY_A) as old:
        ref = aa.store(old, k, 30)
        chunk = raw_of(old).read(raw_of(old).name_of(k))
        with manager(master, aa.KEY_B, [aa.KEY_A]) as rotated:
            assert raw_of(rotated).name_of(k) == raw_of(old).name_of(k)
            assert torch.equal(aa.hit(rotated, k), ref)
            assert aa.failures(rotated, "mooncake") == 0
        with manager(master, aa.KEY_B) as dropped:
            raw = raw_of(dropped)
            raw.write(raw.name_of(k), chunk)
            assert aa.hit(dropped, k) is None
            assert aa.failures(dropped, "mooncake") >= 1


def test_encrypted_at_rest(master):
    """``encrypt: true`` on Mooncake: exact round trips, ciphertext in the store, every forgery
    a counted miss (tests/support/encrypt_attacks.py)."""
    from tests.support import encrypt_attacks as ea

    with manager(master, encrypt=True) as mgr:
        raw = raw_of(mgr)
        ea.check_round_trip_ciphertext(mgr, "mooncake", raw)
        ea.check_forgeries_never_served(mgr, "mooncake", raw, aa.KEY_A)
