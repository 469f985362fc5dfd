"""Config: YAML file, dict, environment overrides, sizes, and errors that name the bad key."""

from __future__ import annotations

import logging

import pytest
from kvplug.config import KVPlugConfig, load_config, parse_size
from kvplug.connector.protocol.config import ConnectorConfig, load_connector_config
from kvplug.errors import ConfigError


def test_defaults_are_local_cpu_then_posix(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLUG_CACHE_DIR", str(tmp_path))
    cfg = load_connector_config()
    assert [t.backend for t in cfg.tiers] == ["local_cpu", "posix"]
    assert cfg.tiers[1].options["path"].startswith(str(tmp_path))
    assert cfg.chunk_size == 256 and not cfg.layerwise
    assert cfg.save_decode and cfg.save_partial_chunk  # block-granular hits, answers stored


def test_precedence_file_then_dict_then_env(tmp_path, monkeypatch):
    f = tmp_path / "kv.yaml"
    f.write_text("chunk_size: 64\nlayerwise: true\nsave_decode: true\n")
    monkeypatch.setenv("KVPLUG_CONFIG", str(f))
    cfg = load_connector_config({"chunk_size": 128})
    assert (cfg.chunk_size, cfg.layerwise, cfg.save_decode) == (128, True, True)
    monkeypatch.setenv("KVPLUG_CHUNK_SIZE", "512")
    monkeypatch.setenv("KVPLUG_TIERS", "[{backend: local_cpu, options: {capacity: 1GiB}}]")
    cfg = load_config({"chunk_size": 128})
    assert cfg.chunk_size == 512 and [t.backend for t in cfg.tiers] == ["local_cpu"]


def test_config_file_key_in_dict(tmp_path):
    f = tmp_path / "kv.yaml"
    f.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 8GiB}\n")
    cfg = load_config({"config_file": str(f), "chunk_size": 32})
    assert cfg.chunk_size == 32 and cfg.tiers[0].options["capacity"] == "8GiB"


@pytest.mark.parametrize(
    "given, message",
    [
        ({"chunksize": 3}, "unknown config key 'chunksize'; allowed keys here: chunk_size"),
        ({"tiers": [{"backend": "x", "optons": {}}]}, "'tiers.0.optons'; allowed keys here: backend"),
        ({"chunk_size": -1}, "'chunk_size'=-1"),
        ({"tiers": []}, "'tiers'"),
        ({"layerwise": "sometimes"}, "'layerwise'='sometimes'"),
    ],
)
def test_bad_values_name_the_key(given, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_connector_config(given)


@pytest.fixture
def kvplug_log(caplog, monkeypatch):
    """kvplug's log lines, once each (the connector may stop them reaching the root logger)."""
    monkeypatch.setattr(logging.getLogger("kvplug"), "propagate", False)
    monkeypatch.setattr(logging.getLogger("kvplug"), "handlers", [caplog.handler])
    return caplog


def test_unknown_env_variable_warns_naming_the_closest(kvplug_log, tmp_path):
    """Like vLLM with VLLM_*: an unrelated KVPLUG_* variable is a warning, not a dead engine."""
    env = {"KVPLUG_HOME": "/opt/mine", "KVPLUG_CHUNK_SIZ": "1", "KVPLUG_CHUNK_SIZE": "64"}
    for load in (load_config, load_connector_config):
        kvplug_log.clear()
        assert load(env=env).chunk_size == 64  # the valid variable still applies
        msgs = [r.getMessage() for r in kvplug_log.records if r.levelno == logging.WARNING]
        (home,) = [m for m in msgs if "KVPLUG_HOME" in m]
        (typo,) = [m for m in msgs if "KVPLUG_CHUNK_SIZ " in m]
        assert "is not a kvplug setting" in home and "did you mean" not in home
        assert "did you mean KVPLUG_CHUNK_SIZE?" in typo
    kvplug_log.clear()
    load_connector_config(env={"KVPLUG_SAVE_DECOD": "1"})
    assert "did you mean KVPLUG_SAVE_DECODE?" in kvplug_log.text
    # a wrong key in a dict or a file stays an error
    with pytest.raises(ConfigError, match="unknown config key 'home'"):
        load_config({"home": "/opt/mine"})
    f = tmp_path / "kv.yaml"
    f.write_text("chunk_siz: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'chunk_siz'"):
        load_config(f)


def test_bad_env_and_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


def test_one_file_configures_core_and_connector(tmp_path):
    f = tmp_path / "kv.yaml"
    f.write_text("chunk_size: 64\nsave_decode: true\nlookup_timeout_s: 0.5\n")
    core = load_config(f, env={"KVPLUG_LAYERWISE": "true"})
    assert type(core) is KVPlugConfig and core.chunk_size == 64
    assert not hasattr(core, "save_decode")  # the connector's keys are not the core's business
    conn = load_connector_config(f, env={"KVPLUG_LAYERWISE": "true"})
    assert isinstance(conn, ConnectorConfig) and conn.chunk_size == 64
    assert (conn.save_decode, conn.lookup_timeout_s, conn.layerwise) == (True, 0.5, True)
    assert load_config(conn) is conn  # the StorageManager takes the connector's config as is
    for load in (load_config, load_connector_config):
        with pytest.raises(ConfigError, match="unknown config key 'save_decod'.*save_decode"):
            load({"save_decod": True})


def test_in_step_load_keys(kvplug_log, tmp_path):
    """``in_step_load_bytes`` / ``in_step_load_deadline_s`` set the connector's in-step loads."""
    cfg = load_connector_config({"in_step_load_bytes": "1MiB", "in_step_load_deadline_s": 0.2},
                                env={})
    assert (cfg.in_step_load_bytes, cfg.in_step_load_deadline_s) == (1 << 20, 0.2)
    assert not [r for r in kvplug_log.records if r.levelno >= logging.WARNING]


def test_a_renamed_key_is_read_under_its_old_name_with_a_warning(kvplug_log, tmp_path):
    """Users' configs keep working: each old name (``ConnectorConfig.deprecated_keys``) is read
    as the new one from a dict, a file and the environment, with a warning naming the new key;
    a core load of the same file ignores it like any connector key."""
    assert ConnectorConfig.deprecated_keys == {"inline_load_bytes": "in_step_load_bytes",
                                               "inline_load_deadline_s": "in_step_load_deadline_s"}
    cfg = load_connector_config({"inline_load_bytes": "1MiB", "inline_load_deadline_s": 0.2},
                                env={})
    assert (cfg.in_step_load_bytes, cfg.in_step_load_deadline_s) == (1 << 20, 0.2)
    warned = [r.getMessage() for r in kvplug_log.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "'inline_load_bytes'" in warned[0] and "'in_step_load_bytes'" \
        in warned[0] and "'in_step_load_deadline_s'" in warned[1]
    f = tmp_path / "kv.yaml"
    f.write_text("inline_load_bytes: 0\n")
    assert load_connector_config(f, env={}).in_step_load_bytes == 0
    assert type(load_config(f, env={})) is KVPlugConfig
    env = {"KVPLUG_INLINE_LOAD_DEADLINE_S": "0.3"}
    assert load_connector_config(env=env).in_step_load_deadline_s == 0.3
    assert ConnectorConfig(inline_load_bytes=7).in_step_load_bytes == 7  # built directly too


def test_a_renamed_key_and_its_new_name_together_are_an_error():
    """Both names of one setting, wherever each comes from: an error naming both."""
    with pytest.raises(ConfigError, match="'inline_load_bytes' \\(deprecated\\) and "
                                          "'in_step_load_bytes' are both given"):
        load_connector_config({"inline_load_bytes": 0, "in_step_load_bytes": 1}, env={})
    with pytest.raises(ConfigError, match="'inline_load_deadline_s'.*'in_step_load_deadline_s'"):
        # from two sources too (a file's old key, an environment variable's new one)
        load_connector_config({"inline_load_deadline_s": 1},
                              env={"KVPLUG_IN_STEP_LOAD_DEADLINE_S": "2"})


@pytest.mark.parametrize("load", [load_config, load_connector_config])
def test_unknown_keys_near_a_renamed_one_are_still_rejected(load):
    with pytest.raises(ConfigError, match="unknown config key 'inline_load_byte'"):
        load({"inline_load_byte": 1}, env={})
    with pytest.raises(ConfigError, match="unknown config key 'in_step_load_byte'"):
        load({"in_step_load_byte": 1}, env={})


def test_sizes():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("512MB") == 512_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(ConfigError, match="'eight gigs'"):
        parse_size("eight gigs")


@pytest.mark.parametrize("cfg, key", [
    ({"chunk_size": True}, "chunk_size"),
    ({"lookup_timeout_s": False}, "lookup_timeout_s"),
    ({"tiers": [{"backend": "local_cpu", "timeout_s": True}]}, "timeout_s"),
])
def test_a_boolean_is_not_a_number(cfg, key):
    """pydantic's lax mode reads YAML's ``true`` as 1; kvplug refuses it, naming the key."""
    with pytest.raises(ConfigError, match=f"{key}.*boolean"):
        load_connector_config(cfg, env={})
    assert load_connector_config({"layerwise": True}, env={}).layerwise is True  # bools stay bools


def test_backend_and_codec_options_refuse_booleans_for_numbers():
    """The rule lives in one base class (``kvplug.config.BaseOptions``) every options model uses."""
    from kvplug.backends.fsspec import FsspecBackend
    from kvplug.backends.local_cpu import LocalCPUBackend
    from kvplug.backends.posix import PosixBackend
    from kvplug.codecs.fp8 import FP8Options
    from kvplug.config import BaseOptions
    from pydantic import ValidationError

    for model, good, key in [(LocalCPUBackend.Options, {}, "capacity"),
                             (PosixBackend.Options, {"path": "/tmp/x"}, "io_threads"),
                             (FsspecBackend.Options, {"url": "memory://x"}, "capacity"),
                             (FP8Options, {}, "num_kv_heads")]:
        assert issubclass(model, BaseOptions)
        with pytest.raises(ValidationError, match=f"{key}[\\s\\S]*boolean"):
            model(**good, **{key: True})
    assert LocalCPUBackend.Options(prefault=False).prefault is False  # a real bool option
