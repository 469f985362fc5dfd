"""Authenticated chunks (``auth_key_env``): a writer without the secret cannot plant or alter KV
on any tier, a reader of the store cannot confirm a guessed prompt from a name, the secret never
shows, and without the key nothing changes.

Real tiers: posix (real files), fsspec on moto's S3 server, resp on redis-server; Mooncake runs
the same checks in a private network namespace (tests/faults/test_auth_chunks_netns.py). The attacks
themselves are in tests/support/auth_attacks.py. The negative control
(:func:`test_without_auth_a_forged_chunk_is_served`) shows the attack is real: the same forged
chunk is served, and counted healthy, when no secret is configured.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError, ChunkVersionError, ConfigError
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

from tests.support import auth_attacks as aa
from tests.support.mooncake_store import run_in_private_netns
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 - fixture
from tests.support.s3_server import S3Env, moto_server, s3  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(180)
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def secrets(monkeypatch) -> dict[str, str]:
    return aa.set_secrets(monkeypatch.setenv)


def _cfg(tier: dict, current: str | None = aa.KEY_A, previous: list[str] | None = None) -> dict:
    cfg = {"chunk_size": 16, "tiers": [tier]}
    if current:
        cfg["auth_key_env"] = current
    if previous:
        cfg["auth_previous_key_envs"] = previous
    return cfg


# -- the keyring and the format ------------------------------------------------------------------

def test_config_errors_name_the_variable_never_the_secret(monkeypatch, tmp_path):
    posix = {"backend": "posix", "options": {"path": str(tmp_path)}}
    short = os.urandom(16).hex()
    monkeypatch.setenv("KVPLUG_TEST_SHORT", short)
    monkeypatch.setenv("KVPLUG_TEST_JUNK", "not a secret at all!!")
    monkeypatch.delenv("KVPLUG_TEST_UNSET", raising=False)
    for var, words in (("KVPLUG_TEST_UNSET", "not set"), ("KVPLUG_TEST_SHORT", "16 bytes"),
                       ("KVPLUG_TEST_JUNK", "neither hex nor base64")):
        with pytest.raises(ConfigError) as err:
            StorageManager(_cfg(posix, var))
        assert var in str(err.value) and words in str(err.value), err.value
        assert short not in str(err.value) and "not a secret" not in str(err.value)
    for pasted in ("abc def", os.urandom(32).hex(), "d" + os.urandom(32).hex(),
                   "a2V5" * 12 + "==="):  # a secret pasted where its variable's name belongs
        with pytest.raises(ConfigError, match="environment variable name") as err:
            StorageManager(_cfg(posix, pasted))
        assert pasted not in str(err.value) and pasted[:12] not in str(err.value)
        with pytest.raises(ConfigError, match="environment variable name") as err:
            StorageManager(_cfg(posix, "GOOD_NAME", [pasted]))
        assert pasted[:12] not in str(err.value)
    with pytest.raises(ConfigError, match="needs auth_key_env"):
        StorageManager({"tiers": [posix], "auth_previous_key_envs": ["X"]})


def test_secret_never_in_repr_logs_or_stats(secrets, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    posix = {"backend": "posix", "options": {"path": str(tmp_path)}}
    with StorageManager(_cfg(posix, aa.KEY_B, [aa.KEY_A, aa.KEY_C])) as mgr:
        k = make_key(1)
        aa.store(mgr, k, 1)
        raw = _posix_raw(mgr)
        raw.write(raw.name_of(k), aa.forgeries(k)["plain chunk, valid xxh3"])
        assert aa.hit(mgr, k) is None
        shown = " ".join([repr(mgr.auth), str(mgr.auth), repr(mgr.backend(0)._auth),
                          repr(mgr.stats()), caplog.text])
    assert "failed authentication" in caplog.text
    for value in secrets.values():
        assert value not in shown and value.lower() not in shown.lower()
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(mgr.auth)


def test_secret_variable_is_no_setting(monkeypatch, tmp_path, caplog):
    """A secret's variable may carry kvplug's own prefix: it is not read as a setting override
    nor warned about as an unknown one (that warning would name it, harmless, but noisy)."""
    monkeypatch.setenv("KVPLUG_DEPLOY_SECRET", os.urandom(32).hex())
    caplog.set_level(logging.WARNING)
    posix = {"backend": "posix", "options": {"path": str(tmp_path)}}
    with StorageManager(_cfg(posix, "KVPLUG_DEPLOY_SECRET")) as mgr:
        assert mgr.auth is not None
    assert "KVPLUG_DEPLOY_SECRET" not in caplog.text


def test_secret_forms(secrets):
    """Hex and base64 give the same key; either decodes, the key id is public and stable."""
    raw = bytes.fromhex(secrets[aa.KEY_A])
    import base64

    env = {"H": raw.hex(), "B": base64.b64encode(raw).decode(), "U": base64.urlsafe_b64encode(
        raw).decode().rstrip("=")}
    ids = {cf.Keyring.from_env(v, environ=env).key_id for v in env}
    assert len(ids) == 1 and all(len(i) == 16 for i in ids)


def test_format_layer_wise_and_rotation(secrets):
    """Chunk-file level: an authenticated chunk round-trips and verifies layer by layer (only
    the layers read); each layer's tag is bound to its position; a previous key verifies only
    while it is in the ring; a reader without a keyring sees another format version."""
    a = cf.Keyring.from_env(aa.KEY_A)
    b_only = cf.Keyring.from_env(aa.KEY_B).for_tier("t")
    b_then_a = cf.Keyring.from_env(aa.KEY_B, [aa.KEY_A]).for_tier("t")
    k, obj = make_key(1), aa.random_obj(1)
    data = aa.encoded(k, obj, a)
    head = cf.decode_header(data[: cf.HEADER_PROBE], len(data), a)
    assert head.version == "1+mac" and head.mac is not None
    assert head.key == cf.stored_key(k, a) and head.key.hex != k.hex  # a veiled hash
    layers = [data[off : off + head.layer_nbytes] for off in head.data_offsets]
    assert all(cf.verify_layer(head, i, layer) for i, layer in enumerate(layers))
    assert cf.verify_layers(head, 2, layers[2] + layers[3])
    assert not cf.verify_layer(head, 1, layers[2]), "a layer moved to another index verified"
    assert not cf.verify_layers(head, 0, layers[1] + layers[0])
    assert cf.decode_header(data[: cf.HEADER_PROBE], len(data), b_then_a).mac.key_id == a.key_id
    with pytest.raises(cf.AuthError, match="unknown key id"):
        cf.decode_header(data[: cf.HEADER_PROBE], len(data), b_only)
    assert b_only.failures == 1
    with pytest.raises(ChunkVersionError):  # a reader without the secret leaves it alone
        cf.decode_header(data[: cf.HEADER_PROBE], len(data))
    plain = aa.encoded(k, obj)
    with pytest.raises(cf.AuthError, match="carries no MAC"):
        cf.decode_header(plain[: cf.HEADER_PROBE], len(plain), a)
    # a chunk moved under another key's name: the header names its own key, verified
    other = aa.encoded(make_key(2), obj, a)
    assert cf.decode_header(other[: cf.HEADER_PROBE], len(other), a).key != cf.stored_key(k, a)
    # a header byte changed (the salt: the per-chunk key changes, every tag fails)
    bad = bytearray(data)
    at = bad.index(b'"mac_salt":"') + len(b'"mac_salt":"')
    bad[at] = ord("0") if bad[at] != ord("0") else ord("1")
    with pytest.raises(ChunkFormatError):
        cf.decode_header(bytes(bad[: cf.HEADER_PROBE]), len(bad), a)


def test_without_auth_format_and_names_are_unchanged(tmp_path):
    """No keyring: the file is byte for byte what encode_chunk wrote before (version "1", xxh3,
    readable names), so existing stores and tests are untouched."""
    k, obj = make_key(1), aa.random_obj(1)
    data = aa.encoded(k, obj)
    fields = aa.public_fields(data)
    assert fields["format_version"] == "1" and fields["checksum_algo"] == "xxh3_64"
    assert "mac_key_id" not in fields and "header_xxh3" in fields
    assert cf.relative_chunk_path(k) == f"{k.hex[:2]}/{k.namespace}.{k.hex}.safetensors"


# -- posix: real files ---------------------------------------------------------------------------

def _posix(path: Path) -> dict:
    return {"backend": "posix", "options": {"path": str(path), "capacity": "64MiB"}}


def _posix_raw(mgr: StorageManager) -> aa.Raw:
    backend = mgr.backend(0)
    root = Path(backend.root)
    auth = getattr(backend, "_auth", None)

    def rel(k) -> str:  # noqa: ANN001
        return cf.relative_chunk_path(k, auth) if auth else cf.relative_chunk_path(k)

    def write(path: str, data: bytes) -> None:  # a new file renamed over the old: new inode
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".evil")
        tmp.write_bytes(data)
        os.replace(tmp, p)

    def read(path: str) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    return aa.Raw(
        name_of=lambda k: str(root / rel(k)),
        read=read, write=write,
        names=lambda: [str(p.relative_to(root)) for p in root.rglob("*.safetensors")])


def test_without_auth_a_forged_chunk_is_served(tmp_path):
    """Negative control (the finding): with no secret, a chunk anyone encodes with the public
    library under the victim's key, or writes over the victim's chunk, is served and counted
    healthy. With auth_key_env the same forgeries are misses (the tests below)."""
    with StorageManager(_cfg(_posix(tmp_path), None)) as mgr:
        raw = _posix_raw(mgr)
        planted, victim = make_key(1), make_key(2)
        aa.store(mgr, victim, 2)
        evil = aa.random_obj(666).byte_view.clone()
        for k in (planted, victim):
            raw.write(raw.name_of(k), aa.encoded(k, aa.random_obj(666)))  # the public library
            assert torch.equal(aa.hit(mgr, k), evil), "the forged chunk was not served"
        assert mgr.stats()["posix"]["corrupt"] == 0 and "auth_failures" not in mgr.stats()["posix"]


def test_posix_forged_chunks_never_served(secrets, tmp_path):
    with StorageManager(_cfg(_posix(tmp_path))) as mgr:
        aa.check_forged_never_served(mgr, "posix", _posix_raw(mgr))


def test_posix_altered_bytes_miss(secrets, tmp_path):
    with StorageManager(_cfg(_posix(tmp_path))) as mgr:
        aa.check_altered_bytes_miss(mgr, "posix", _posix_raw(mgr))


def test_posix_names_keyed(secrets, tmp_path):
    with StorageManager(_cfg(_posix(tmp_path))) as mgr:
        aa.check_names_keyed(mgr, _posix_raw(mgr), cf.relative_chunk_path)


def test_posix_rotation(secrets, tmp_path):
    aa.check_rotation(lambda cur, prev: StorageManager(_cfg(_posix(tmp_path), cur, prev)),
                      "posix", _posix_raw)


def test_posix_overwrite_found_by_a_fresh_process(secrets, tmp_path):
    """A file replaced while no kvplug process runs: the next process's startup scan indexes
    it; its first read is a miss, counted, the file deleted; the next store writes it again."""
    k = make_key(5)
    with StorageManager(_cfg(_posix(tmp_path))) as mgr:
        ref = aa.store(mgr, k, 5)
        raw = _posix_raw(mgr)
        path = raw.name_of(k)
        real = raw.read(path)
    raw.write(path, aa.forgeries(k, real)["real key id and salt, own MACs"])
    with StorageManager(_cfg(_posix(tmp_path))) as mgr:
        mgr.backend(0).wait_indexed(30)
        assert mgr.lookup_prefix([k]).num_chunks == 1  # the file is there...
        assert aa.hit(mgr, k) is None  # ...but never served
        assert aa.failures(mgr, "posix") == 1
        aa.store(mgr, k, 5)
        assert torch.equal(aa.hit(mgr, k), ref)


def test_inspect_verifies_with_the_key(secrets, tmp_path):
    """``kvplug inspect`` with a config naming auth_key_env authenticates every chunk: a
    forged one is reported, the real ones verify; without the config they are another
    format version."""
    from click.testing import CliRunner
    from kvplug.cli.main import main

    store_dir = tmp_path / "store"
    with StorageManager(_cfg(_posix(store_dir))) as mgr:
        for i in range(3):
            aa.store(mgr, make_key(i), i)
        raw = _posix_raw(mgr)
        raw.write(raw.name_of(make_key(1)), aa.forgeries(make_key(1))["own secret"])
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text(f"auth_key_env: {aa.KEY_A}\ntiers: [{{backend: posix, options: {{path: "
                   f"{store_dir}}}}}]\n")
    out = CliRunner().invoke(main, ["inspect", "--verify", "--json", "-c", str(cfg),
                                    str(store_dir)])
    assert out.exit_code == 1, out.output  # inspect fails when a chunk is corrupt
    import json

    report = json.JSONDecoder().raw_decode(out.output[out.output.index("{"):])[0]
    assert report["chunks"] == 2 and len(report["corrupt"]) == 1
    assert "authentication failed" in report["corrupt"][0]["problem"]
    assert all(v not in out.output for v in secrets.values())
    plain = CliRunner().invoke(main, ["inspect", "--json", str(store_dir)])
    assert json.JSONDecoder().raw_decode(plain.output[plain.output.index("{"):])[0][
        "chunks"] == 0


# -- fsspec on moto's S3 server ------------------------------------------------------------------

def _fsspec(s3env: S3Env, namespace_dirs: bool = False) -> dict:
    return {"backend": "fsspec", "options": {
        "url": s3env.url("auth"), "storage_options": s3env.storage_options,
        "negative_cache_s": 0.0, "namespace_dirs": namespace_dirs}}


def _fsspec_raw(s3env: S3Env) -> callable:
    def raw_of(mgr: StorageManager) -> aa.Raw:
        backend, fs = mgr.backend(0), s3env.filesystem()

        def read(path: str) -> bytes | None:
            try:
                return fs.cat_file(path)
            except FileNotFoundError:
                return None

        def names() -> list[str]:
            root = f"{s3env.bucket}/auth/"
            return [p.removeprefix(root) for p in fs.find(root)]

        return aa.Raw(name_of=backend.path_of, read=read,
                      write=lambda path, data: fs.pipe_file(path, data), names=names)

    return raw_of


def test_fsspec_s3_attacks(secrets, s3):  # noqa: F811 - fixture
    with StorageManager(_cfg(_fsspec(s3))) as mgr:
        raw = _fsspec_raw(s3)(mgr)
        aa.check_forged_never_served(mgr, "fsspec", raw)
        aa.check_altered_bytes_miss(mgr, "fsspec", raw)
        aa.check_names_keyed(mgr, raw, cf.relative_chunk_path)


def test_fsspec_s3_namespace_dirs_keyed(secrets, s3):  # noqa: F811 - fixture
    with StorageManager(_cfg(_fsspec(s3, namespace_dirs=True))) as mgr:
        raw = _fsspec_raw(s3)(mgr)
        aa.store(mgr, make_key(1), 1)
        (name,) = raw.names()
        ns_dir, shard, _ = name.split("/")
        assert len(ns_dir) == 32 and int(ns_dir, 16) >= 0 and "victim" not in name


def test_fsspec_s3_rotation(secrets, s3):  # noqa: F811 - fixture
    aa.check_rotation(lambda cur, prev: StorageManager(_cfg(_fsspec(s3), cur, prev)),
                      "fsspec", _fsspec_raw(s3))


# -- resp on redis-server ------------------------------------------------------------------------

def _resp(srv: RedisServer) -> dict:
    return {"backend": "resp", "options": {"url": srv.url, "negative_cache_s": 0,
                                           "timeout_s": 2.0}}


def _resp_raw(srv: RedisServer) -> callable:
    def raw_of(mgr: StorageManager) -> aa.Raw:
        backend, client = mgr.backend(0), srv.client()
        return aa.Raw(name_of=backend.name_of, read=client.get,
                      write=lambda name, data: client.set(name, data),
                      names=lambda: [n.decode().removeprefix(backend.opts.prefix)
                                     for n in client.keys("*")])

    return raw_of


def test_resp_redis_attacks(secrets, redis_server):  # noqa: F811 - fixture
    with StorageManager(_cfg(_resp(redis_server))) as mgr:
        raw = _resp_raw(redis_server)(mgr)
        aa.check_forged_never_served(mgr, "resp", raw)
        aa.check_altered_bytes_miss(mgr, "resp", raw)
        aa.check_names_keyed(mgr, raw, cf.chunk_name)


def test_resp_redis_rotation(secrets, redis_server):  # noqa: F811 - fixture
    aa.check_rotation(lambda cur, prev: StorageManager(_cfg(_resp(redis_server), cur, prev)),
                      "resp", _resp_raw(redis_server))


# -- Mooncake, in a private network namespace ----------------------------------------------------

def test_mooncake_attacks_in_private_netns(secrets, tmp_path):
    run_in_private_netns(TESTS / "test_auth_chunks_netns.py", tmp_path / "inner")


def test_posix_codec_chunks_authenticated(secrets, tmp_path):
    """A tier with a codec stores ENCODED chunks as ``1+codec+mac``: they round-trip, and a
    plain encoded forgery with a valid xxh3 is a miss, counted."""
    pytest.importorskip("blosc2")
    tier = {**_posix(tmp_path), "codec": "lossless"}
    with StorageManager(_cfg(tier)) as mgr:
        k = make_key(7)
        ref = aa.store(mgr, k, 7)
        raw = _posix_raw(mgr)
        real = raw.read(raw.name_of(k))
        fields = aa.public_fields(real)
        assert fields["format_version"] == "1+codec+mac" and "codec" in fields
        assert torch.equal(aa.hit(mgr, k), ref)
        plain = bytearray(real)  # the attacker re-signs the same header with xxh3: no MAC
        forged = aa.encoded(make_key(8), aa.random_obj(8))
        raw.write(raw.name_of(make_key(8)), forged)
        assert aa.hit(mgr, make_key(8)) is None and aa.failures(mgr, "posix") == 1
        plain[aa.header_bytes(real) + 10] ^= 1  # the encoded payload's first layer
        raw.write(raw.name_of(k), bytes(plain))
        assert aa.hit(mgr, k) is None and aa.failures(mgr, "posix") == 2


def test_auth_failures_reach_prometheus_by_tier(secrets, tmp_path):
    """A real manager's auth_failures, sampled as the connector samples tier stats, become
    ``vllm:kvplug_auth_failures_total{tier=...}``."""
    pytest.importorskip("vllm")
    from functools import partial
    from types import SimpleNamespace

    from kvplug.connector.prom import KVPlugPromMetrics
    from kvplug.connector.protocol.stats import StatsRecorder
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    rec = StatsRecorder()
    with StorageManager(_cfg({**_posix(tmp_path), "name": "disk"})) as mgr:
        rec.sample_tiers(mgr.stats())
        raw = _posix_raw(mgr)
        for i in range(3):
            raw.write(raw.name_of(make_key(i)), aa.forgeries(make_key(i))["own secret"])
            assert aa.hit(mgr, make_key(i)) is None
        rec.sample_tiers(mgr.stats())
    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVPlugPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(rec.take().to_dict(), 0)
    assert reg.get_sample_value("vllm:kvplug_auth_failures_total",
                                {"model_name": "m", "engine": "0", "tier": "disk"}) == 3


def test_one_header_verifies_from_many_threads(secrets):
    """A parsed header (cached by tiers, shared by their reader threads) verifies every layer
    right from several threads at once, and refuses a wrong one in each."""
    import threading

    ring = cf.Keyring.from_env(aa.KEY_A)
    k, obj = make_key(1), aa.random_obj(1)
    data = aa.encoded(k, obj, ring)
    head = cf.decode_header(data[: cf.HEADER_PROBE], len(data), ring)
    layers = [data[off : off + head.layer_nbytes] for off in head.data_offsets]
    wrong: list[str] = []

    def run() -> None:
        for _ in range(50):
            for i, layer in enumerate(layers):
                if not cf.verify_layer(head, i, layer):
                    wrong.append(f"layer {i} refused")
                if cf.verify_layer(head, (i + 1) % len(layers), layer):
                    wrong.append(f"layer {i} accepted at {(i + 1) % len(layers)}")

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not wrong, wrong[:5]
