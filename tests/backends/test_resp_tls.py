"""The resp tier over TLS (``rediss://``) against a real redis-server with TLS only (``--port 0
--tls-port``), which requires client certificates (redis-server's default), with certificates
made here by ``openssl``: a CA that signed the server's and the client's certificates, and another
CA. The right CA and client certificate give bit-exact round trips; a wrong or missing CA, or no
client certificate, is a miss for every call (never an exception) and one error that names the
URL (no password) and the option that fixes it; bad TLS options fail at startup naming them."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

from tests.faults.test_resp_faults import get_exact, put
from tests.support.redis_server import RedisServer
from tests.support.tier_workload import HANG

pytestmark = pytest.mark.timeout(120)
SECRET = "tls-pw-Q7x-never-logged"
OPENSSL = shutil.which("openssl")


def _openssl(*args: str) -> None:
    subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    crt, k = d / f"{name}-ca.crt", d / f"{name}-ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(k), "-out", str(crt),
             "-days", "2", "-subj", f"/CN=kvplug test {name} CA")
    return crt, k


def _issue(d: Path, name: str, ca: tuple[Path, Path], ext: str | None) -> tuple[Path, Path]:
    crt, k, csr = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(k), "-out", str(csr),
             "-subj", f"/CN={name}")
    extra = []
    if ext:
        (d / f"{name}.ext").write_text(ext + "\n")
        extra = ["-extfile", str(d / f"{name}.ext")]
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", str(crt), "-days", "2", *extra)
    return crt, k


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    if OPENSSL is None:
        pytest.skip("openssl is not installed (scripts/setup.sh installs it)")
    d = tmp_path_factory.mktemp("tls")
    ca = _ca(d, "right")
    other, _ = _ca(d, "other")
    server = _issue(d, "server", ca, "subjectAltName=IP:127.0.0.1")
    client = _issue(d, "client", ca, None)
    return {"ca": ca[0], "other_ca": other, "server_crt": server[0], "server_key": server[1],
            "client_crt": client[0], "client_key": client[1]}


class TlsRedisServer(RedisServer):
    """redis-server listening with TLS only (no plain port), a password, client certificates
    required; ``url`` is ``rediss://`` with the password in it."""

    def __init__(self, workdir: Path, certs: dict[str, Path]) -> None:
        self.certs = certs
        super().__init__(workdir, password=SECRET)

    @property
    def url(self) -> str:
        return f"rediss://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def shown(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        args = super().argv()
        at = args.index("--port")
        args[at + 1] = "0"  # no plaintext port
        c = self.certs
        return [*args, "--tls-port", str(self.port), "--tls-cert-file", str(c["server_crt"]),
                "--tls-key-file", str(c["server_key"]), "--tls-ca-cert-file", str(c["ca"])]

    def client(self):  # noqa: ANN201 - redis.Redis
        import redis

        c = self.certs
        return redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2,
                                    ssl_ca_certs=str(c["ca"]), ssl_certfile=str(c["client_crt"]),
                                    ssl_keyfile=str(c["client_key"]))


@pytest.fixture(scope="module")
def server(certs, tmp_path_factory):
    srv = TlsRedisServer(tmp_path_factory.mktemp("redis-tls"), certs)
    yield srv
    srv.stop()


def _manager(url: str, **tls) -> StorageManager:
    options = {"url": url, "timeout_s": 2.0, "negative_cache_s": 0, "breaker_threshold": 2,
               "breaker_backoff_s": 0.2, "breaker_max_backoff_s": 0.5,
               **{k: str(v) for k, v in tls.items()}}
    return StorageManager({"tiers": [{"backend": "resp", "timeout_s": 10.0, "options": options}],
                           "chunk_size": 16})


def _client_cert(certs) -> dict[str, Path]:
    return {"ssl_certfile": certs["client_crt"], "ssl_keyfile": certs["client_key"]}


def test_right_ca_exact_round_trips(server, certs):
    server.client().flushall()
    mgr = _manager(server.url, ssl_ca_certs=certs["ca"], **_client_cert(certs))
    try:
        refs = {i: put(mgr, i) for i in range(4)}
        assert mgr.flush(timeout=HANG)
        assert [get_exact(mgr, i, refs[i]) for i in range(4)] == [True] * 4
        assert mgr.lookup_prefix([make_key(i) for i in range(5)]).num_chunks == 4
        assert get_exact(mgr, 9, refs[0]) is False  # never stored: a miss
        st = mgr.stats()["resp"]
    finally:
        mgr.close()
    assert server.client().dbsize() == 4  # the server's own view, over its own TLS client
    assert st["written"] == 4 and st["breaker_trips"] == 0 and st["corrupt"] == 0, st
    assert st["remote_errors"] + st["socket_timeouts"] == 0 and st["faults"] == 0, st


@pytest.mark.parametrize(("what", "says"), [
    ("wrong_ca", "ssl_ca_certs"),  # a CA that did not sign the server's certificate
    ("system_ca", "ssl_ca_certs"),  # no CA given: the system's CAs do not know the test CA
    ("no_client_cert", "ssl_certfile"),  # the server requires one
])
def test_tls_failure_is_a_miss_and_one_clear_error(server, certs, caplog, what, says):
    caplog.set_level(logging.DEBUG, logger="kvplug")
    tls = {"wrong_ca": {"ssl_ca_certs": certs["other_ca"], **_client_cert(certs)},
           "system_ca": _client_cert(certs),
           "no_client_cert": {"ssl_ca_certs": certs["ca"]}}[what]
    mgr = _manager(server.url, **tls)
    try:
        ref = put(mgr, 1)
        assert mgr.flush(timeout=HANG)
        for _ in range(3):
            assert get_exact(mgr, 1, ref) is False
        assert mgr.lookup_prefix([make_key(1)]).num_chunks == 0
        st = mgr.stats()["resp"]
        text = caplog.text + repr(st) + repr(mgr.backend(0).opts) + mgr.backend(0).url
    finally:
        mgr.close()
    errors = [r.getMessage() for r in caplog.records
              if r.levelno == logging.ERROR and "TLS to" in r.getMessage()]
    assert len(errors) == 1, caplog.text  # once, however many calls failed
    assert server.shown in errors[0] and says in errors[0], errors[0]
    assert SECRET not in text
    assert st["breaker_trips"] >= 1 and st["written"] == 0 and st["faults"] == 0, st
    print(errors[0])


def test_plain_url_to_tls_server_misses(server):
    """``redis://`` to a TLS-only server: nothing listens in plain text there (``--port 0``
    gives it no plain port): misses, the breaker trips, no exception."""
    mgr = _manager(server.url.replace("rediss://", "redis://"))
    try:
        assert mgr.lookup_prefix([make_key(1)]).num_chunks == 0
        assert mgr.get(make_key(1), promote=False) is None
        assert mgr.stats()["resp"]["remote_errors"] >= 1
    finally:
        mgr.close()


def test_bad_tls_options_name_the_option(certs, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        ({"url": "redis://127.0.0.1:1/0", "ssl_ca_certs": certs["ca"]}, "does not use TLS"),
        ({"url": "rediss://127.0.0.1:1/0", "ssl_ca_certs": tmp_path / "missing.pem"},
         "missing.pem' is not a readable file"),
        ({"url": "rediss://127.0.0.1:1/0", "ssl_ca_certs": junk}, "holds no CA certificate"),
        ({"url": "rediss://127.0.0.1:1/0", "ssl_keyfile": certs["client_key"]},
         "ssl_keyfile is set without ssl_certfile"),
        ({"url": "rediss://127.0.0.1:1/0", "ssl_certfile": certs["client_crt"],
          "ssl_keyfile": certs["server_key"]}, "are not a PEM certificate and its private key"),
    ]
    for options, says in cases:
        with pytest.raises(ValueError) as err:
            StorageManager({"tiers": [{"backend": "resp", "options": {
                k: str(v) for k, v in options.items()}}], "chunk_size": 16}).close()
        assert says in str(err.value), (options, str(err.value))
