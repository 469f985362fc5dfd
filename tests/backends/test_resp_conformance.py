"""The backend conformance suite against the resp tier, on a real redis-server started by the
test: over TCP on 127.0.0.1, over a unix socket (with a password, from an env variable) and on a
three-master cluster."""

from __future__ import annotations

import uuid

import pytest
from kvplug.testing import BackendConformance

from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(120)

FAST = {"timeout_s": 5.0, "negative_cache_s": 0.0}


def _corrupt(client, name: str) -> None:
    """Flip one byte inside the value's last layer."""
    size = client.strlen(name)
    assert size > 100, f"{name} is not stored ({size} bytes)"
    byte = client.getrange(name, size - 100, size - 100)
    client.setrange(name, size - 100, bytes([byte[0] ^ 0xFF]))


class TestRespTcp(BackendConformance):
    persistent = True

    @pytest.fixture
    def make_tiers(self, redis_server):  # noqa: F811 - fixture
        prefix = f"conf-{uuid.uuid4().hex[:8]}:"
        return lambda capacity: [{"backend": "resp", "options": {
            "url": redis_server.url, "prefix": prefix, "capacity": capacity, **FAST}}]

    @pytest.fixture
    def corrupt_entry(self, redis_server):  # noqa: F811 - fixture
        return lambda manager, key: _corrupt(redis_server.client(),
                                             manager.backend(0).name_of(key))


class TestRespUnixSocketWithPassword(BackendConformance):
    persistent = True

    @pytest.fixture
    def server(self, tmp_path, monkeypatch):
        monkeypatch.setenv("KVPLUG_TEST_REDIS_PASSWORD", "s3cret-pw")
        srv = RedisServer(tmp_path / "redis", unix=True, password="s3cret-pw")
        yield srv
        srv.stop()

    @pytest.fixture
    def make_tiers(self, server):
        return lambda capacity: [{"backend": "resp", "options": {
            "url": f"unix://{server.socket}", "password_env": "KVPLUG_TEST_REDIS_PASSWORD",
            "capacity": capacity, **FAST}}]

    @pytest.fixture
    def corrupt_entry(self, server):
        return lambda manager, key: _corrupt(server.client(), manager.backend(0).name_of(key))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One three-master cluster for the module (it takes seconds to form)."""
    from tests.support.redis_server import RedisClusterServers

    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"))
    yield servers
    servers.stop()


class TestRespCluster(BackendConformance):
    """A three-master Redis cluster: keys spread over every node, pipelines split by node."""

    persistent = True

    @pytest.fixture
    def cluster(self, servers):
        servers.flush()  # empty for each test
        return servers

    @pytest.fixture
    def make_tiers(self, cluster):
        return lambda capacity: [{"backend": "resp", "options": {
            "url": cluster.url, "cluster": True, "capacity": capacity, **FAST}}]

    @pytest.fixture
    def corrupt_entry(self, cluster):
        return lambda manager, key: _corrupt(cluster.client(), manager.backend(0).name_of(key))

    def test_values_spread_over_every_node(self, cluster, make_tiers):
        """Chunks land on all three masters (no hash tag pins them to one slot)."""
        from kvplug.storage_manager import StorageManager
        from kvplug.testing.conformance import fill_random, make_key

        mgr = StorageManager({"tiers": make_tiers(self.roomy), "chunk_size": 16})
        try:
            for i in range(24):
                obj = fill_random(mgr, seed=i)
                mgr.batched_put([make_key(i)], [obj])
                obj.ref_down()
            assert mgr.flush(timeout=30)
            assert mgr.lookup_prefix([make_key(i) for i in range(24)]).num_chunks == 24
        finally:
            mgr.close()
        sizes = [n.client().dbsize() for n in cluster.nodes]
        assert sum(sizes) == 24 and min(sizes) > 0, sizes
