"""Encryption at rest (``encrypt: true``): every tier stores ciphertext, serves exact plaintext,
and never serves a forgery.

Real tiers: posix (real files), fsspec on moto's S3 server, resp on redis-server, a third-party
tier written against the public chunk-file library (:class:`ValueDictTier`), the gds tier in its
posix fallback; Mooncake in tests/faults/test_auth_chunks_netns.py. The checks are in
tests/support/encrypt_attacks.py; the raw accesses are test_auth_chunks.py's. Negative controls:
without ``encrypt`` the same store holds the plaintext (:func:`test_negative_control_plaintext`)
and the same downgrade is served (:func:`test_format_level`).
"""

from __future__ import annotations

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.errors import ConfigError
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.memory import MemoryFormat, heap_memory_obj
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

from tests.faults.test_auth_chunks import _fsspec, _fsspec_raw, _posix, _posix_raw, _resp, _resp_raw
from tests.support import auth_attacks as aa
from tests.support import encrypt_attacks as ea
from tests.support.redis_server import redis_server  # noqa: F401 - fixture
from tests.support.s3_server import moto_server, s3  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def secrets(monkeypatch) -> dict[str, str]:
    return aa.set_secrets(monkeypatch.setenv)


def _cfg(tier: dict, current: str | None = aa.KEY_A, previous: list[str] | None = None,
         encrypt: bool = True) -> dict:
    cfg: dict = {"chunk_size": 16, "tiers": [tier], "encrypt": encrypt}
    if current:
        cfg["auth_key_env"] = current
    if previous:
        cfg["auth_previous_key_envs"] = previous
    return cfg


# -- the format ----------------------------------------------------------------------------------

def test_format_level(secrets):
    """Chunk-file level: an encrypted chunk decrypts layer by layer in place, exactly; a layer
    at another index, a reader without encryption (same secret) and a plain or MAC'd chunk
    under an encrypting reader are authentication failures; the negative control: the MAC'd
    chunk a downgrade writes is served by a reader that does not encrypt."""
    enc = cf.Keyring.from_env(aa.KEY_A, encrypt=True).for_tier("t")
    mac = cf.Keyring.from_env(aa.KEY_A).for_tier("t")
    k, obj = ea.tenant_key(1, ea.TENANT_A), aa.random_obj(1)
    ref = bytes(obj.byte_view.numpy())
    data = aa.encoded(k, obj, enc)
    head = cf.decode_header(data[: cf.HEADER_PROBE], len(data), enc)
    assert head.version == "1+enc" and cf.holds(head, k, enc)
    assert head.meta == obj.meta and head.key.tenant == ea.TENANT_A
    payload = bytearray(data[head.header_bytes :])
    assert bytes(payload) != ref
    assert cf.verify_layers(head, 0, memoryview(payload)) and bytes(payload) == ref
    layer2 = bytearray(data[head.data_offsets[2] : head.data_offsets[2] + head.layer_nbytes])
    assert not cf.verify_layer(head, 1, layer2), "a layer decrypted at another index"
    assert layer2 == bytes(len(layer2)), "a refused layer was left for the caller"
    assert cf.verify_layer(head, 3, data[head.data_offsets[3] :])  # read-only: checked only
    assert enc.failures == 1
    with pytest.raises(cf.AuthError, match="carries no MAC"):
        cf.decode_header(data[: cf.HEADER_PROBE], len(data), mac)
    downgraded = aa.encoded(k, obj, mac)
    mac_head = cf.decode_header(downgraded[: cf.HEADER_PROBE], len(downgraded), mac)
    assert cf.holds(mac_head, k, mac)  # the negative control: a MAC'd chunk is fine there
    with pytest.raises(cf.AuthError, match="not encrypted"):
        cf.decode_header(downgraded[: cf.HEADER_PROBE], len(downgraded), enc)
    with pytest.raises(cf.AuthError, match="not encrypted"):
        plain = aa.encoded(k, obj)
        cf.decode_header(plain[: cf.HEADER_PROBE], len(plain), enc)
    # layers past the scratch size are decrypted through a GCM context: the same rules
    big = heap_memory_obj((2, 1, 96 << 10), torch.uint8, MemoryFormat.KV_PAGES, 16)
    big.byte_view.copy_(torch.randint(0, 256, (big.nbytes,), dtype=torch.uint8))
    data = aa.encoded(k, big, enc)
    head = cf.decode_header(data[: cf.HEADER_PROBE], len(data), enc)
    payload = bytearray(data[head.header_bytes :])
    payload[-1] ^= 1
    assert not cf.verify_layers(head, 0, memoryview(payload)), "a flipped byte decrypted"
    payload = bytearray(data[head.header_bytes :])
    assert cf.verify_layers(head, 0, memoryview(payload))
    assert bytes(payload) == bytes(big.byte_view.numpy())
    other = aa.encoded(ea.tenant_key(1, ea.TENANT_B), obj, enc)  # the same hash, tenant B
    other_head = cf.decode_header(other[: cf.HEADER_PROBE], len(other), enc)
    before = enc.failures
    assert not cf.holds(other_head, k, enc) and enc.failures == before + 1


def test_config_needs_auth_and_declared_tiers(secrets, tmp_path):
    """``encrypt: true`` without ``auth_key_env`` names both settings; a tier that may block
    and does not declare ``encrypts`` is refused, naming it; L1 (never blocks) is fine."""
    with pytest.raises(ConfigError, match="encrypt: true needs auth_key_env"):
        StorageManager(_cfg(_posix(tmp_path), current=None))
    refused = {"backend": f"{__name__}:PlainDictTier", "name": "third"}
    with pytest.raises(ConfigError, match=r"tier 'third'.*does not say it encrypts"):
        StorageManager(_cfg(refused))
    with StorageManager(_cfg(refused, encrypt=False)):
        pass  # the same tier without encryption starts
    l1 = {"backend": "local_cpu", "options": {"capacity": "16MiB"}}
    with StorageManager({**_cfg(_posix(tmp_path)), "tiers": [l1, _posix(tmp_path)]}) as mgr:
        k = make_key(1)
        ref = aa.store(mgr, k, 1)
        assert torch.equal(aa.hit(mgr, k), ref)  # L1 holds it in the clear, as it must
        mgr.evict([k], tiers=["local_cpu"])
        assert torch.equal(aa.hit(mgr, k), ref)  # read from disk, decrypted


def test_gds_refuses_kvikio_and_encrypts_as_posix(secrets, tmp_path, monkeypatch):
    """gds through kvikio refuses ``encrypt`` at startup with what to do (the probe replaced:
    no CUDA here); in its posix fallback it encrypts as posix does."""
    from kvplug.backends.gds import backend as gds
    from kvplug.backends.gds.probe import Probe

    tier = {"backend": "gds", "options": {"path": str(tmp_path / "g"), "fallback": "posix"}}
    monkeypatch.setattr(gds, "probe", lambda: Probe(driver=True, kvikio_version="26.10.00",
                                                   cuda_device=True, gds=False))
    with pytest.raises(ConfigError, match="encrypt: true cannot be kept through kvikio.*'posix'"):
        StorageManager(_cfg(tier))
    monkeypatch.setattr(gds, "probe", lambda: Probe(driver=False, driver_error="none here"))
    with StorageManager(_cfg(tier)) as mgr:
        k = make_key(2)
        ref = aa.store(mgr, k, 2)
        assert torch.equal(aa.hit(mgr, k), ref)
        (path,) = (tmp_path / "g").rglob("*.safetensors")
        ea.assert_no_plaintext(path.read_bytes(), ref, "gds (posix fallback)")


# -- posix ---------------------------------------------------------------------------------------

def test_negative_control_plaintext(secrets, tmp_path):
    """Without ``encrypt`` (auth only) the stored file holds the plaintext runs and the readable
    fields the encrypted checks look for: the search finds what it looks for."""
    with StorageManager(_cfg(_posix(tmp_path), encrypt=False)) as mgr:
        k = ea.tenant_key(1, ea.TENANT_A)
        ref = aa.store(mgr, k, 1)
        raw = _posix_raw(mgr)
        stored = raw.read(raw.name_of(k))
    assert all(run in stored for run in ea.plaintext_runs(ref))
    assert all(word in stored for word in ea.READABLE)


def test_posix(secrets, tmp_path):
    with StorageManager(_cfg(_posix(tmp_path))) as mgr:
        raw = _posix_raw(mgr)
        ea.check_round_trip_ciphertext(mgr, "posix", raw)
        ea.check_forgeries_never_served(mgr, "posix", raw, aa.KEY_A)


def test_posix_rotation(secrets, tmp_path):
    ea.check_rotation(lambda cur, prev: StorageManager(_cfg(_posix(tmp_path), cur, prev)),
                      "posix", _posix_raw)


def test_posix_codec_chunks_encrypted(secrets, tmp_path):
    """A codec's ENCODED chunks are compressed, then encrypted (the codec is sealed too)."""
    pytest.importorskip("blosc2")
    with StorageManager(_cfg({**_posix(tmp_path), "codec": "lossless"})) as mgr:
        k = make_key(7)
        ref = aa.store(mgr, k, 7)
        assert torch.equal(aa.hit(mgr, k), ref)
        raw = _posix_raw(mgr)
        stored = raw.read(raw.name_of(k))
        assert aa.public_fields(stored)["format_version"] == "1+enc" and b"lossless" not in stored


# -- fsspec on moto's S3, resp on redis-server ---------------------------------------------------

def test_fsspec_s3(secrets, s3):  # noqa: F811 - fixture
    with StorageManager(_cfg(_fsspec(s3))) as mgr:
        raw = _fsspec_raw(s3)(mgr)
        ea.check_round_trip_ciphertext(mgr, "fsspec", raw)
        ea.check_forgeries_never_served(mgr, "fsspec", raw, aa.KEY_A)


def test_resp_redis(secrets, redis_server):  # noqa: F811 - fixture
    with StorageManager(_cfg(_resp(redis_server))) as mgr:
        raw = _resp_raw(redis_server)(mgr)
        ea.check_round_trip_ciphertext(mgr, "resp", raw)
        ea.check_forgeries_never_served(mgr, "resp", raw, aa.KEY_A)


def test_resp_rotation(secrets, redis_server):  # noqa: F811 - fixture
    ea.check_rotation(lambda cur, prev: StorageManager(_cfg(_resp(redis_server), cur, prev)),
                      "resp", _resp_raw(redis_server))


# -- a third-party tier: the public chunk-file library through TierContext ----------------------

_VALUES: dict[str, bytes] = {}


class ValueDictTier:
    """A third party's tier: each chunk one value of the public chunk format, built and read
    with ``kvplug.chunkfile`` and ``ctx.auth`` only (it knows nothing of encryption)."""

    encrypts = True

    def __init__(self, ctx: TierContext) -> None:
        self.auth, self.allocate = ctx.auth, ctx.allocate
        self.failures = 0

    def name_of(self, key) -> str:  # noqa: ANN001
        return cf.chunk_name(key, self.auth)

    @hookimpl
    def batched_submit_put(self, keys, objs) -> None:  # noqa: ANN001
        for key, obj in zip(keys, objs, strict=True):
            header, bufs = cf.encode_chunk(key, obj, self.auth)
            _VALUES[self.name_of(key)] = header + b"".join(bytes(b) for b in bufs)

    @hookimpl
    def get(self, key):  # noqa: ANN001, ANN201
        data = _VALUES.get(self.name_of(key))
        if data is None:
            return None
        try:
            header, _ = cf.read_header(lambda off, n: data[off : off + n], len(data), self.auth)
        except cf.AuthError:
            return None
        if not cf.holds(header, key, self.auth):
            return None
        obj = self.allocate(header.shape, header.dtype, header.fmt, header.num_tokens)
        if obj is None:
            return None
        view = obj.byte_view.numpy()
        view[:] = memoryview(data)[header.header_bytes : header.header_bytes + header.nbytes]
        if not cf.verify_layers(header, 0, view.data):
            obj.ref_down()
            return None
        return obj

    @hookimpl
    def contains(self, keys):  # noqa: ANN001, ANN201
        return [self.name_of(k) in _VALUES for k in keys]

    @hookimpl
    def evict(self, keys):  # noqa: ANN001, ANN201
        return sum(len(_VALUES.pop(self.name_of(k), b"")) for k in keys or ())

    @hookimpl
    def stats(self) -> dict[str, float]:
        return {"auth_failures": float(self.auth.failures if self.auth else 0)}


class PlainDictTier(ValueDictTier):
    """The same tier, not declaring that it encrypts (it would, but says nothing)."""

    encrypts = False


def test_third_party_tier_through_the_chunk_library(secrets):
    """A tier built only on ``kvplug.chunkfile`` + ``ctx.auth`` stores ciphertext and serves
    exact plaintext with no code of its own for encryption; a forged value is a miss."""
    _VALUES.clear()
    tier = {"backend": f"{__name__}:ValueDictTier", "name": "third"}
    with StorageManager(_cfg(tier)) as mgr:
        raw = aa.Raw(name_of=mgr.backend(0).name_of, read=_VALUES.get,
                     write=_VALUES.__setitem__, names=lambda: list(_VALUES))
        for i, k in enumerate([make_key(1), ea.tenant_key(2, ea.TENANT_A)]):
            ref = aa.store(mgr, k, i)
            assert torch.equal(aa.hit(mgr, k), ref)
            ea.assert_no_plaintext(raw.read(raw.name_of(k)), ref, "third-party tier")
        victim = make_key(1)
        raw.write(raw.name_of(victim), aa.encoded(victim, aa.random_obj(666)))
        assert aa.hit(mgr, victim) is None and aa.failures(mgr, "third") == 1
