"""A real S3 endpoint for tests: moto's server on 127.0.0.1, driven through s3fs (no mocking).

Reuse from any test module (tests/README.md: imports)::

    from tests.support.s3_server import moto_server, s3  # noqa: F401  (fixtures)

    def test_x(s3):
        tier = {"backend": "fsspec", "options": {"url": s3.url("run1"),
                                                 "storage_options": s3.storage_options}}

``moto_server`` (session) is one server shared by the run; ``s3`` (function) resets it, clears
s3fs's instance cache, sets fake AWS credentials in the environment and creates a fresh bucket.
:class:`MotoServer` can also be started by a test itself, stopped and restarted on the same port.
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

BUCKET = "kvplug-test"
CREDENTIALS = {"key": "testing", "secret": "testing"}


def _quiet() -> None:
    for name in ("werkzeug", "moto", "botocore", "aiobotocore", "s3fs"):
        logging.getLogger(name).setLevel(logging.ERROR)


class MotoServer:
    """``moto.server.ThreadedMotoServer`` on loopback with stop/restart on the same port."""

    def __init__(self, port: int = 0) -> None:
        _quiet()
        self.port = port
        self._srv = None
        self.start()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        deadline = time.monotonic() + 10
        while True:
            srv = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            try:
                srv.start()
                break
            except OSError:  # the port is still held by the previous server's socket
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self._srv = srv
        self.host, self.port = srv.get_host_and_port()
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"moto server on port {self.port} did not come up")

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.stop()
            self._srv = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset(self) -> None:
        """Forget every bucket and object (moto's own reset API)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()


@dataclass
class S3Env:
    """A fresh bucket on a running moto server, with what a tier config needs."""

    server: MotoServer
    bucket: str = BUCKET
    extra_options: dict = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, **CREDENTIALS, **self.extra_options}

    def url(self, prefix: str = "kv") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def filesystem(self):  # noqa: ANN201 - s3fs.S3FileSystem
        """A raw s3fs filesystem on the endpoint (fresh instance)."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True,
                                 use_listings_cache=False, **CREDENTIALS)

    def create_bucket(self) -> None:
        self.filesystem().mkdir(self.bucket)


def set_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials and the region moto expects (region_name in client_kwargs breaks
    bucket creation through s3fs)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    srv = MotoServer()
    yield srv
    srv.stop()


@pytest.fixture
def s3(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Env]:
    import s3fs

    set_aws_env(monkeypatch)
    moto_server.reset()
    s3fs.S3FileSystem.clear_instance_cache()
    env = S3Env(moto_server)
    env.create_bucket()
    yield env
    s3fs.S3FileSystem.clear_instance_cache()
