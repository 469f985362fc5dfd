"""Sizes read from a store never choose an allocation.

A chunk whose header claims 512 MiB (a sparse file, or a real value of that length in a shared
store) must not make kvplug allocate it on the heap past L1's capacity (the pool cannot hold it,
and the read would fall back to the heap), download it whole (fsspec) or receive it whole (resp). Every
read goes through :mod:`kvplug.read_memory` before anything is allocated: the engine's chunk
geometry (the connector's) or, without it, the largest pool bounds one read, and the heap
fallback is capped by ``max_heap_fallback``.

Allocation is measured, not timed: the largest Python/numpy buffer (tracemalloc's peak, which
covers bytes received from a socket or a file) and the largest tensor made through
``torch.empty``/``torch.zeros`` (every heap read goes through them; pool objects are views).
Real tiers: posix on sparse files, fsspec on moto's S3 server, resp on a real redis-server.
"""

from __future__ import annotations

import os
import struct
import tracemalloc

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.memory import MemoryFormat, MemoryObjMeta
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

CLAIM = (4, 64, 2 << 20)  # 512 MiB in the header
L1 = {"backend": "local_cpu", "name": "l1", "options": {"capacity": "64MiB", "prefault": False}}
SHAPE = (4, 2, 4096)  # the chunks this test's "engine" stores


class AllocWatch:
    """The largest allocation while active: tracemalloc's peak (Python and numpy buffers) and
    the largest tensor made through ``torch.empty`` / ``torch.zeros``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mp = monkeypatch
        self.torch_max = 0
        self.python_peak = 0

    def _spy(self, real):
        def made(*args, **kwargs):
            t = real(*args, **kwargs)
            self.torch_max = max(self.torch_max, t.numel() * t.element_size())
            return t
        return made

    def __enter__(self) -> AllocWatch:
        self.mp.setattr(torch, "empty", self._spy(torch.empty))
        self.mp.setattr(torch, "zeros", self._spy(torch.zeros))
        tracemalloc.start()
        self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.python_peak = tracemalloc.get_traced_memory()[1] - self._base
        tracemalloc.stop()
        self.mp.undo()

    @property
    def biggest(self) -> int:
        return max(self.torch_max, self.python_peak)


def hostile_header(key, shape=CLAIM) -> tuple[bytes, int]:
    """A well-formed header (valid checksum) claiming ``shape``, and the file size it implies."""
    meta = MemoryObjMeta(shape, torch.uint8, MemoryFormat.KV_PAGES, 16)
    sums = ["0" * 16] * shape[0]
    header = cf.encode_header(key, meta, sums)
    return header, cf.make_header(key, meta, sums, len(header)).file_size


def sparse_chunk(root, key, shape=CLAIM) -> None:
    header, size = hostile_header(key, shape)
    path = root / cf.relative_chunk_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)  # sparse: the claim costs the disk nothing


def posix(root) -> dict:
    return {"backend": "posix", "name": "disk", "options": {"path": str(root)}}


# -- posix: sparse files ----------------------------------------------------------------------
def test_posix_sparse_512mib_claim_is_a_miss_without_allocating_it(tmp_path, monkeypatch):
    """The reproduction: L1 of 64 MiB, no geometry given (the SDK on its own)."""
    sparse_chunk(tmp_path / "d", make_key(1))
    with StorageManager({"chunk_size": 16, "tiers": [L1, posix(tmp_path / "d")]}) as mgr:
        assert mgr.lookup_prefix([make_key(1)]).num_chunks == 1
        with AllocWatch(monkeypatch) as w:
            got = mgr.get(make_key(1))
        assert got is None
        assert w.biggest < 64 << 20, f"a read allocated {w.biggest} bytes past L1's 64 MiB"
        st = mgr.stats()["l1"]
        assert st["reads_refused_geometry"] == 1 and st["read_heap_fallbacks"] == 0


def test_posix_with_the_engines_geometry_refuses_other_shapes_and_serves_its_own(tmp_path,
                                                                                 monkeypatch):
    from kvplug.read_memory import ChunkGeometry

    root = tmp_path / "d"
    sparse_chunk(root, make_key(1))
    sparse_chunk(root, make_key(2), (4, 2, 8192))  # small, but not this engine's page size
    sparse_chunk(root, make_key(3), (5, 2, 4096))  # one layer too many
    geometry = ChunkGeometry(num_layers=4, pages=2, page_bytes=4096, tokens=16)
    with StorageManager({"chunk_size": 16, "tiers": [posix(root)]}, geometry=geometry) as mgr:
        good = fill_random(mgr, SHAPE, seed=5, num_tokens=16)
        expect = good.byte_view.clone()
        mgr.batched_put([make_key(4)], [good])
        good.ref_down()
        assert mgr.flush(30)
        with AllocWatch(monkeypatch) as w:
            assert [mgr.get(make_key(i)) for i in (1, 2, 3)] == [None] * 3
        assert w.biggest < 1 << 20, w.biggest
        assert mgr.stats()["disk"]["reads_refused_geometry"] == 3
        got = mgr.get(make_key(4))  # the control: a chunk of this engine reads
        assert got is not None and torch.equal(got.byte_view, expect)
        got.ref_down()
        half = mgr.get_layers(make_key(4), 2, 2)
        assert half is not None and torch.equal(half.byte_view, expect.view(4, -1)[2:].reshape(-1))
        half.ref_down()


def test_heap_fallback_is_capped_and_returns_with_the_last_reference(tmp_path):
    """L1 full of chunks in use: reads go to the heap up to ``max_heap_fallback`` bytes held at
    once; past it a miss (counted); the cap frees as the objects go."""
    chunk = 4 * 2 * 4096
    l1 = {"backend": "local_cpu", "name": "l1", "options": {"capacity": 4 * chunk}}
    cfg = {"chunk_size": 16, "max_heap_fallback": 3 * chunk,
           "tiers": [l1, {"backend": "tests.support.tiers_for_tests:DictTier", "name": "lower"}]}
    with StorageManager(cfg) as mgr:
        keys = [make_key(i) for i in range(12)]
        for i, k in enumerate(keys):
            obj = fill_random(mgr, SHAPE, seed=i)
            mgr.batched_put([k], [obj])
            obj.ref_down()
        mgr.evict(nbytes=1 << 40, tiers=["l1"])  # every read now comes from the lower tier
        held = [mgr.get(k, promote=False) for k in keys]
        served = [o for o in held if o is not None]
        assert len(served) == 4 + 3, [o is not None for o in held]  # the pool, then the cap
        st = mgr.stats()["l1"]
        assert st["read_heap_fallbacks"] == 3 and st["reads_refused_heap"] == 5
        assert st["read_heap_bytes"] == 3 * chunk
        for o in served:
            o.ref_down()
        assert mgr.stats()["l1"]["read_heap_bytes"] == 0
        again = [mgr.get(k, promote=False) for k in keys[:7]]
        assert all(o is not None for o in again)
        for o in again:
            o.ref_down()


# -- fsspec: a real S3 endpoint (moto) --------------------------------------------------------
class _MotoProcess:
    """moto's S3 server in a process of its own (its copies of a large object must not count
    as this process's allocations), on a free port of 127.0.0.1."""

    def __init__(self, tmp_path) -> None:
        import subprocess
        import sys
        import time

        from tests.support.server_process import free_port

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
             "-p", str(self.port)], stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "moto.log", "wb"))
        import socket

        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.mark.timeout(300)
def test_fsspec_s3_object_claiming_512mib_is_refused_before_its_body(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    from tests.support.s3_server import S3Env, set_aws_env

    set_aws_env(monkeypatch)
    server = _MotoProcess(tmp_path)
    try:
        s3 = S3Env(server)  # type: ignore[arg-type]
        s3.create_bucket()
        tier = {"backend": "fsspec", "name": "remote", "options": {
            "url": s3.url("sizes"), "storage_options": s3.storage_options, "negative_cache_s": 0,
            "timeout_s": 60.0}}  # a bound for a hang only: moto on a busy machine takes seconds
        key = make_key(7)
        with StorageManager({"chunk_size": 16, "tiers": [L1, tier]}) as mgr:
            header, size = hostile_header(key)
            with s3.filesystem().open(mgr.backend("remote").path_of(key), "wb",
                                      block_size=64 << 20) as f:
                f.write(header)
                zeros = bytes(32 << 20)
                left = size - len(header)
                while left:
                    f.write(zeros[: min(left, len(zeros))])
                    left -= min(left, len(zeros))
            del zeros
            assert mgr.lookup_prefix([key]).num_chunks == 1
            with AllocWatch(monkeypatch) as w:
                assert mgr.get(key) is None
                assert mgr.get_layers(key, 0, 1) is None
            assert w.biggest < 64 << 20, f"a read allocated {w.biggest} bytes past L1's 64 MiB"
            assert mgr.stats()["l1"]["reads_refused_geometry"] == 2
    finally:
        server.stop()


def test_fsspec_local_sparse_file_claim_with_geometry(tmp_path, monkeypatch):
    from kvplug.read_memory import ChunkGeometry

    tier = {"backend": "fsspec", "name": "remote", "options": {
        "url": f"file://{tmp_path / 'f'}", "namespace_dirs": False, "negative_cache_s": 0}}
    with StorageManager({"chunk_size": 16, "tiers": [tier]},
                        geometry=ChunkGeometry(4, 2, 4096, 16)) as mgr:
        sparse_chunk(tmp_path / "f", make_key(1))
        with AllocWatch(monkeypatch) as w:
            assert mgr.get(make_key(1)) is None
        assert w.biggest < 1 << 20, w.biggest


# -- resp: a real redis-server ----------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("with_l1", [True, False], ids=["l1-in-place", "no-l1"])
def test_resp_value_of_512mib_is_never_received_whole(tmp_path, monkeypatch, with_l1):
    from kvplug.read_memory import ChunkGeometry

    from tests.support.redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis", maxmemory="1gb")  # started by the constructor
    try:
        tier = {"backend": "resp", "name": "kv", "options": {"url": srv.url,
                                                             "negative_cache_s": 0}}
        tiers = [L1, tier] if with_l1 else [tier]
        with StorageManager({"chunk_size": 16, "tiers": tiers},
                            geometry=ChunkGeometry(4, 2, 4096, 16)) as mgr:
            good = fill_random(mgr, SHAPE, seed=3, num_tokens=16)
            expect = good.byte_view.clone()
            mgr.batched_put([make_key(0)], [good])
            good.ref_down()
            assert mgr.flush(30)
            key = make_key(9)
            header, size = hostile_header(key)
            import redis

            r = redis.Redis.from_url(srv.url)
            name = mgr.backend("kv").name_of(key)
            r.config_set("proto-max-bulk-len", str(1 << 30))  # values past 512 MB
            r.set(name, header)
            r.setrange(name, size - 1, b"\0")  # a real 512 MiB value
            assert r.strlen(name) == size
            got = mgr.get(make_key(0))  # (with L1: teaches the tier to read in place)
            assert got is not None and torch.equal(got.byte_view, expect)
            got.ref_down()
            mgr.evict(nbytes=1 << 40, tiers=["l1"] if with_l1 else [])
            with AllocWatch(monkeypatch) as w:
                assert mgr.get(key) is None
                assert mgr.batched_get([key, make_key(0)])[0] is None
            limit = mgr.reads.read_limit()
            assert limit < 1 << 20
            assert w.biggest < 4 * limit + (1 << 20), f"a read received {w.biggest} bytes"
            assert mgr.stats()["kv"]["oversized"] >= 2
            got = mgr.get(make_key(0))  # the connection is still in step
            assert got is not None and torch.equal(got.byte_view, expect)
            got.ref_down()
            r.close()
    finally:
        srv.stop()


def test_sparse_claim_allocation_is_measured_by_the_watch(monkeypatch):
    """The watch's negative control: allocating the claim is seen."""
    with AllocWatch(monkeypatch) as w:
        t = torch.empty(CLAIM, dtype=torch.uint8)
        b = bytearray(8 << 20)
    del t, b
    assert w.torch_max == 512 << 20 and w.python_peak >= 8 << 20
    assert os.path.exists("/proc/self")


# -- headers: their length bounded by the engine's geometry before any of it is parsed -----------
HEADER_BOMB = 16 << 20
GEOMETRY = (4, 2, 4096, 16)


def list_bomb() -> bytes:
    """A 16 MiB header of empty JSON lists (``[],[],...``) inside the metadata, whose length
    prefix says so: parsed, it is millions of Python lists."""
    head = b'{"__metadata__":{"format":['
    count = (HEADER_BOMB - 8 - len(head) - 4) // 3
    body = head + b"[]," * count + b"[]]}}"
    return struct.pack("<Q", HEADER_BOMB - 8) + body + b" " * (HEADER_BOMB - 8 - len(body))


def test_list_bomb_is_a_header_the_old_bound_accepted():
    """The negative control of the tests below: the bomb's announced length is one the format
    accepted before headers were bounded by the geometry (16 MiB), and its JSON parses."""
    bomb = list_bomb()
    assert len(bomb) == HEADER_BOMB and HEADER_BOMB % cf.ALIGN == 0
    assert struct.unpack("<Q", bomb[:8])[0] + 8 == HEADER_BOMB
    assert bomb[8:].decode().rstrip().endswith("[]]}}")
    engine = cf.max_header_bytes(GEOMETRY[0])
    assert engine < 64 << 10 and HEADER_BOMB > 256 * engine


def test_posix_with_auth_refuses_a_16mib_header_before_parsing_it(tmp_path, monkeypatch):
    from kvplug.read_memory import ChunkGeometry

    from tests.support.auth_attacks import KEY_A, set_secrets

    set_secrets(monkeypatch.setenv)
    root = tmp_path / "d"
    cfg = {"chunk_size": 16, "auth_key_env": KEY_A, "tiers": [posix(root)]}
    with StorageManager(cfg, geometry=ChunkGeometry(*GEOMETRY)) as mgr:
        good = fill_random(mgr, SHAPE, seed=11, num_tokens=16)
        expect = good.byte_view.clone()
        mgr.batched_put([make_key(0)], [good])
        good.ref_down()
        assert mgr.flush(30)
        path = root / cf.relative_chunk_path(make_key(1), mgr.auth)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(list_bomb())
        with AllocWatch(monkeypatch) as w:
            assert mgr.get(make_key(1)) is None
        assert w.python_peak < 1 << 20, f"reading the header took {w.python_peak} bytes"
        assert mgr.stats()["disk"]["corrupt"] == 1
        got = mgr.get(make_key(0))  # the control: this engine's own chunk still reads
        assert got is not None and torch.equal(got.byte_view, expect)
        got.ref_down()


def test_fsspec_with_geometry_refuses_a_16mib_header_before_fetching_it(tmp_path, monkeypatch):
    import fsspec
    from kvplug.read_memory import ChunkGeometry

    url = f"memory://headers-{os.getpid()}-{os.urandom(4).hex()}"
    tier = {"backend": "fsspec", "name": "remote", "options": {"url": url,
                                                               "negative_cache_s": 0}}
    with StorageManager({"chunk_size": 16, "tiers": [tier]},
                        geometry=ChunkGeometry(*GEOMETRY)) as mgr:
        be = mgr.backend("remote")
        fsspec.filesystem("memory").pipe_file(be.path_of(make_key(1)), list_bomb())
        with AllocWatch(monkeypatch) as w:
            assert mgr.get(make_key(1)) is None
            assert mgr.get_layers(make_key(1), 0, 1) is None
        assert w.python_peak < 1 << 20, f"reading the header took {w.python_peak} bytes"
        assert mgr.stats()["remote"]["corrupt"] >= 1


def test_resp_get_layers_never_fetches_a_16mib_header(tmp_path):
    from kvplug.read_memory import ChunkGeometry

    from tests.support.redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis")
    try:
        tier = {"backend": "resp", "name": "kv", "options": {"url": srv.url,
                                                             "negative_cache_s": 0}}
        with StorageManager({"chunk_size": 16, "tiers": [tier]},
                            geometry=ChunkGeometry(*GEOMETRY)) as mgr:
            r = srv.client()
            name = mgr.backend("kv").name_of(make_key(1))
            r.set(name, list_bomb())

            def sent() -> int:
                return int(r.info("stats")["total_net_output_bytes"])

            before = sent()
            assert mgr.get_layers(make_key(1), 0, 1) is None
            fetched = sent() - before
            assert fetched < 64 << 10, f"the tier fetched {fetched} bytes of a header"
            assert mgr.stats()["kv"]["corrupt"] == 1
            r.close()
    finally:
        srv.stop()
