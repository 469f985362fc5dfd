"""A real ``redis-server`` for tests, started by the test on 127.0.0.1 (a free port) or a unix
socket, with no persistence (``--save "" --appendonly no``); it can be killed, restarted on the
same port (empty, as a real restart without persistence is), paused (SIGSTOP) and resumed.

Reuse from any test module (tests/README.md: imports)::

    from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

``redis_server`` (function scope) is a fresh server per test; tests that need other settings
construct :class:`RedisServer` themselves (``maxmemory``, ``policy``, ``unix``).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server_process import ServerProcess
from tests.support.server_process import free_port as any_free_port

SERVER = shutil.which("redis-server") or shutil.which("valkey-server")


def free_port(cluster: bool = False) -> int:
    """A free port on 127.0.0.1; for a cluster node one at most 55535 whose bus port (+10000) is
    free too."""
    while True:
        if not cluster:
            return any_free_port()
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + 10000):  # the client port and the cluster bus port
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:  # taken: draw again
            continue


class RedisServer(ServerProcess):
    """One redis-server process on loopback (or a unix socket in ``workdir``)."""

    cluster_node = False
    what = "redis-server"
    log_name = "redis.log"

    def __init__(self, workdir: Path, *, maxmemory: str = "256mb", policy: str = "allkeys-lru",
                 unix: bool = False, password: str | None = None) -> None:
        if SERVER is None:
            pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
        super().__init__(workdir)
        self.maxmemory, self.policy, self.password = maxmemory, policy, password
        self.socket = str(self.workdir / "redis.sock") if unix else None
        self.port = 0 if unix else free_port(cluster=self.cluster_node)
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

    def ready(self) -> bool:
        import redis

        client = self.client()
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        finally:
            client.close()

    def client(self):  # noqa: ANN201 - redis.Redis
        """A plain client (the test's independent view of the store)."""
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=1)

    def restart(self) -> None:
        self.kill()
        if self.socket and os.path.exists(self.socket):
            os.unlink(self.socket)
        self.start()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


class RedisClusterServers:
    """Three cluster-enabled redis-server masters on 127.0.0.1 (free ports), slots spread over
    them with ``redis-cli --cluster create`` (no replicas); ``url`` names the first node.
    ``full_coverage``: see :class:`_ClusterNode`."""

    def __init__(self, workdir: Path, nodes: int = 3, full_coverage: bool = True) -> None:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if SERVER is None or cli is None:
            pytest.skip("redis-server / redis-cli are not installed (scripts/setup.sh)")
        self.nodes: list[RedisServer] = []
        for i in range(nodes):
            srv = _ClusterNode(Path(workdir) / f"node{i}", full_coverage)
            self.nodes.append(srv)
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        import redis

        deadline = time.monotonic() + 30
        for n in self.nodes:
            client = redis.Redis(host="127.0.0.1", port=n.port, socket_timeout=2)
            while client.cluster("info").get("cluster_state") != "ok":
                assert time.monotonic() < deadline, "the cluster never reached cluster_state:ok"
                time.sleep(0.1)
            client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def client(self):  # noqa: ANN201 - redis.cluster.RedisCluster
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(self.url, socket_timeout=5)

    def flush(self) -> None:
        for n in self.nodes:
            client = n.client()
            client.flushall()
            client.close()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class _ClusterNode(RedisServer):
    """``full_coverage=False``: the other masters keep serving their slots while one is down
    (``cluster-require-full-coverage no``; with yes, Redis refuses every key once it marks a
    master failed)."""

    cluster_node = True

    def __init__(self, workdir: Path, full_coverage: bool = True) -> None:
        self.full_coverage = full_coverage
        super().__init__(workdir)

    def argv(self) -> list[str]:
        return [*super().argv(), "--cluster-enabled", "yes", "--cluster-config-file",
                str(self.workdir / "nodes.conf"), "--cluster-node-timeout", "5000",
                "--cluster-require-full-coverage", "yes" if self.full_coverage else "no"]
