"""A real ``redis-server`` for tests, started by the test on 127.0.0.1 (a free port) or a unix
socket, with no persistence (``--save "" --appendonly no``); it can be killed, restarted on the
same port (empty, as a real restart without persistence is), paused (SIGSTOP) and resumed.

Reuse from any test module (the tests directory is on ``sys.path``)::

    from redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

``redis_server`` (function scope) is a fresh server per test; tests that need other settings
construct :class:`RedisServer` themselves (``maxmemory``, ``policy``, ``unix``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER = shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on loopback (or a unix socket in ``workdir``)."""

    def __init__(self, workdir: Path, *, maxmemory: str = "256mb", policy: str = "allkeys-lru",
                 unix: bool = False, password: str | None = None) -> None:
        if SERVER is None:
            pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.maxmemory, self.policy, self.password = maxmemory, policy, password
        self.socket = str(self.workdir / "redis.sock") if unix else None
        self.port = 0 if unix else free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.socket:
            return f"unix://{auth}{self.socket}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        args = [SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--maxmemory", self.maxmemory, "--maxmemory-policy",
                self.policy, "--dir", str(self.workdir), "--protected-mode", "no"]
        if self.socket:
            args += ["--unixsocket", self.socket, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        return args

    def start(self) -> None:
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        deadline = time.monotonic() + 15
        while True:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready(deadline):
                return
            if self.proc.poll() is None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not come up:\n"
                                   f"{(self.workdir / 'redis.log').read_text()[-3000:]}")
            time.sleep(0.2)  # the port was still held by the previous process: try again

    def _wait_ready(self, deadline: float) -> bool:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def client(self):  # noqa: ANN201 - redis.Redis
        """A plain client (the test's independent view of the store)."""
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: the data is gone, as in a crash of a server without persistence."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        if self.socket and os.path.exists(self.socket):
            os.unlink(self.socket)
        self.start()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()
