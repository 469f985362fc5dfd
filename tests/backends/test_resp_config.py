"""The resp tier's options and credentials: bad values fail at startup naming the value and the
fix; a password (in the URL or in ``password_env``) reaches no log line, stats or options repr,
also when the server rejects it."""

from __future__ import annotations

import logging

import pytest
from kvplug.errors import ConfigError
from kvplug.storage_manager import StorageManager
from kvplug.testing.conformance import fill_random, make_key

from tests.support.redis_server import RedisServer

SECRET = "pw-Zq81-never-logged"


def _mgr(**options) -> StorageManager:
    return StorageManager({"tiers": [{"backend": "resp", "options": options}], "chunk_size": 16})


@pytest.mark.parametrize(("options", "says"), [
    ({"url": "http://127.0.0.1:6379"}, "redis://host:port/db"),
    ({}, "url is required"),
    ({"url": "redis://127.0.0.1:1/0", "prefix": "kv{x}:"}, "braces"),
    ({"url": "redis://127.0.0.1:1/0", "timeout_s": True}, "not the boolean"),
    ({"url": "redis://127.0.0.1:1/0", "surprise": 1}, "surprise"),
    ({"url": "unix:///tmp/x.sock", "cluster": True}, "cluster is reached over redis://"),
])
def test_bad_options_name_the_value(options, says):
    with pytest.raises((ConfigError, ValueError)) as err:
        mgr = _mgr(**options)
        try:  # a cluster over a unix socket is refused when the client is made (first use)
            mgr.backend(0).io.client()
        finally:
            mgr.close()
    assert says in str(err.value)


def test_password_env_missing_names_the_variable(monkeypatch):
    monkeypatch.delenv("KVPLUG_TEST_NO_SUCH_VAR", raising=False)
    with pytest.raises(ConfigError, match="KVPLUG_TEST_NO_SUCH_VAR"):
        _mgr(url="redis://127.0.0.1:1/0", password_env="KVPLUG_TEST_NO_SUCH_VAR")


@pytest.mark.parametrize("where", ["url", "env", "rediss"])
def test_password_never_logged(tmp_path, caplog, monkeypatch, where):
    """The server wants another password (or, for ``rediss``, speaks no TLS, so the handshake
    fails before any password is sent): every call fails (the breaker opens), and the password
    appears nowhere."""
    caplog.set_level(logging.DEBUG, logger="kvplug")
    srv = RedisServer(tmp_path / "redis", password="the-right-one")
    try:
        if where in ("url", "rediss"):
            options = {"url": f"{where.replace('url', 'redis')}://:{SECRET}@127.0.0.1:{srv.port}/0"}
        else:
            monkeypatch.setenv("KVPLUG_TEST_REDIS_PW", SECRET)
            options = {"url": f"redis://127.0.0.1:{srv.port}/0", "password_env": "KVPLUG_TEST_REDIS_PW"}
        mgr = _mgr(**options, timeout_s=1.0, breaker_threshold=1)
        try:
            obj = fill_random(mgr)
            mgr.batched_put([make_key(1)], [obj])
            obj.ref_down()
            mgr.flush(timeout=10)
            assert mgr.lookup_prefix([make_key(1)]).num_chunks == 0
            assert mgr.get(make_key(1)) is None
            stats = mgr.stats()["resp"]
            text = caplog.text + repr(stats) + repr(mgr.backend(0).opts) + mgr.backend(0).url
        finally:
            mgr.close()
    finally:
        srv.stop()
    assert stats["breaker_trips"] >= 1 and "remote store failing" in caplog.text
    assert SECRET not in text
    if where == "rediss":  # the TLS handshake to a plain server failed: no password was sent
        assert "connecting to server" in caplog.text and "WRONGPASS" not in caplog.text, caplog.text
