"""gds tier with real kvikio I/O: runs only where a CUDA driver and kvikio are present.

Where ``KVPLUG_TEST_LIBCUDA_SHIM=1`` the "driver" is the test-only libcuda shim that
tests/backends/test_gds_shim.py builds: kvikio's host-memory (compat) path runs for real, nothing else.
That is never GDS coverage: GDS and device-memory tests skip under the shim.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.backends.gds.probe import Mode, probe
from kvplug.storage_manager import StorageManager
from kvplug.testing import BackendConformance, fill_random, make_key

FOUND = probe()
SHIM = os.environ.get("KVPLUG_TEST_LIBCUDA_SHIM") == "1"
pytestmark = pytest.mark.skipif(
    not (FOUND.driver and FOUND.kvikio),
    reason=f"kvikio I/O needs a CUDA driver and kvikio (driver: {FOUND.driver_error or 'ok'}; "
    f"kvikio: {FOUND.kvikio_error or FOUND.kvikio_version or 'not probed'}); install 'kvplug[gds]' on a GPU "
    "machine (tests/backends/test_gds_shim.py runs these through a test-only libcuda shim where kvikio "
    "is installed)",
)
needs_cuda = pytest.mark.skipif(
    SHIM or not torch.cuda.is_available(),
    reason="needs a CUDA device (the libcuda shim only serves host memory)" if SHIM
    else "needs a CUDA device",
)


def _tier(path, **opts) -> dict:
    return {"backend": "gds", "options": {"path": str(path), **opts}}


def _posix(path) -> dict:
    return {"backend": "posix", "options": {"path": str(path)}}


def _corrupt(root):
    def corrupt(manager, key):
        path = cf.chunk_path(root, key)
        data = bytearray(path.read_bytes())
        data[-5000] ^= 0xFF
        path.write_bytes(bytes(data))

    return corrupt


class TestGDSConformance(BackendConformance):
    """The conformance suite against ``gds`` alone (host memory from the heap)."""

    persistent = True

    @pytest.fixture
    def make_tiers(self, tmp_path):
        return lambda capacity: [_tier(tmp_path / "c", capacity=capacity, num_threads=2,
                                       task_size="1MiB")]

    @pytest.fixture
    def corrupt_entry(self, tmp_path):
        return _corrupt(tmp_path / "c")


class TestGDSBehindL1Conformance(TestGDSConformance):
    """The same behind a local_cpu L1: reads land in L1's pool (the connector's usual setup)."""

    @pytest.fixture
    def make_tiers(self, tmp_path):
        return lambda capacity: [
            {"backend": "local_cpu", "options": {"capacity": capacity}},
            _tier(tmp_path / "c", capacity=capacity),
        ]

    @pytest.fixture
    def corrupt_entry(self, tmp_path):
        damage = _corrupt(tmp_path / "c")

        def corrupt(manager, key):
            manager.evict([key], tiers=[manager.tier_names[0]])  # L1 drops its copy
            damage(manager, key)

        return corrupt


def test_mode_is_reported(tmp_path):
    with StorageManager({"tiers": [_tier(tmp_path)]}) as mgr:
        backend = mgr.backend(0)
        st = mgr.stats()["gds"]
        assert backend.mode in (Mode.GDS, Mode.COMPAT)
        assert st["gds_active"] + st["compat_mode"] == 1 and st["posix_fallback"] == 0
        if SHIM:
            assert backend.mode is Mode.COMPAT, "the shim has no cuFile: it must be compat mode"


@pytest.mark.parametrize("first", ["posix", "gds"])
def test_directory_is_shared_with_posix(tmp_path, first):
    """A directory written by one tier is read by the other, bit-exact (padded layers too)."""
    root = tmp_path / "shared"
    writer, reader = (_posix(root), _tier(root)) if first == "posix" else (_tier(root), _posix(root))
    with StorageManager({"tiers": [writer]}) as m:
        obj = fill_random(m, shape=(3, 2, 1000), seed=5, num_tokens=7)
        want = obj.byte_view.clone()
        m.batched_put([make_key(1)], [obj])
        assert m.flush(10)
        obj.ref_down()
    data = cf.chunk_path(root, make_key(1)).read_bytes()
    header = cf.decode_header(data[: cf.HEADER_PROBE], len(data))
    assert all(off % cf.ALIGN == 0 for off in header.data_offsets)
    with StorageManager({"tiers": [reader]}) as m:
        got = m.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, want) and got.num_tokens == 7
        got.ref_down()
        part = m.get_layers(make_key(1), 1, 2)
        assert part is not None and torch.equal(part.byte_view, want[2000:])
        part.ref_down()


@pytest.mark.parametrize("first", ["posix", "gds"])
def test_authenticated_directory_shared_with_posix_holds_no_chunk_hash(tmp_path, monkeypatch,
                                                                         first):
    """With ``auth_key_env`` too: a chunk kvikio wrote (its own header encoder) is read by
    posix and the other way round, and its header records the veiled key
    (:func:`kvplug.chunkfile.stored_key`), never the chunk hash a guessed prompt gives."""
    monkeypatch.setenv("KVPLUG_TEST_GDS_AUTH", os.urandom(32).hex())
    root, key = tmp_path / "shared", make_key(3)
    writer, reader = (_posix(root), _tier(root)) if first == "posix" else (_tier(root), _posix(root))
    with StorageManager({"tiers": [writer], "auth_key_env": "KVPLUG_TEST_GDS_AUTH"}) as m:
        obj = fill_random(m, shape=(3, 2, 1000), seed=6, num_tokens=7)
        want = obj.byte_view.clone()
        m.batched_put([key], [obj])
        assert m.flush(10)
        obj.ref_down()
        (path,) = root.rglob("*.safetensors")
        data = path.read_bytes()
        assert key.hex.encode() not in data and key.chunk_hash not in data
    with StorageManager({"tiers": [reader], "auth_key_env": "KVPLUG_TEST_GDS_AUTH"}) as m:
        got = m.get(key)
        assert got is not None and torch.equal(got.byte_view, want)
        got.ref_down()
        assert m.stats()[reader["backend"]]["auth_failures"] == 0


def test_layer_by_layer_host_load(tmp_path):
    """``get_layers`` one layer per call (layer-wise loading), into host memory here."""
    with StorageManager({"tiers": [_tier(tmp_path)]}) as m:
        obj = fill_random(m, shape=(4, 2, 3000), seed=9)
        want = obj.byte_view.clone().view(4, -1)
        m.batched_put([make_key(1)], [obj])
        assert m.flush(10)
        obj.ref_down()
        backend = m.backend(0)
        for layer in range(4):
            part = backend.get_layers(make_key(1), layer, 1)
            assert part is not None
            assert torch.equal(part.byte_view, want[layer])
            part.ref_down()
        assert backend.get_layers(make_key(1), 4, 1) is None, "out-of-range layer must miss"
        assert backend.get_layers(make_key(2), 0, 1) is None


@needs_cuda
def test_device_store_and_layerwise_device_load(tmp_path, monkeypatch):
    """A device object is written from the GPU; layers are read straight into CUDA memory (a
    tier whose ``ctx.allocate`` hands out device memory, as a device-pool L1 would)."""
    from kvplug.memory import heap_memory_obj

    with StorageManager({"tiers": [_tier(tmp_path)]}) as m:
        obj = heap_memory_obj((3, 2, 4096), device="cuda")
        obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8,
                                          device="cuda"))
        want = obj.byte_view.clone().view(3, -1)
        m.batched_put([make_key(1)], [obj])
        assert m.flush(30)
        obj.ref_down()
        backend = m.backend(0)
        monkeypatch.setattr(backend.files, "allocate", lambda shape, dtype, fmt, num_tokens:
                            heap_memory_obj(shape, dtype, fmt, num_tokens, device="cuda"))
        for layer in range(3):
            part = backend.get_layers(make_key(1), layer, 1)
            assert part is not None and part.byte_view.is_cuda
            assert torch.equal(part.byte_view, want[layer])
            part.ref_down()
        monkeypatch.undo()
        host = m.get(make_key(1))
        assert host is not None and torch.equal(host.byte_view, want.reshape(-1).cpu())
        host.ref_down()


@needs_cuda
def test_gds_is_active_where_the_machine_has_it():
    """Reports (does not fail) when cuFile says GDS is unavailable: compat mode is legitimate."""
    if not FOUND.gds:
        pytest.skip("cuFile reports GDS unavailable on this machine: compat mode only")
    assert FOUND.gds


def test_hostile_entries_and_private_files_through_kvikio(tmp_path):
    """The gds tier's own open paths (kvikio reads the file a checked descriptor holds): a FIFO
    and a symlink at chunk paths are misses that never hang nor follow; files are 0600/0700."""
    import stat
    import threading

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    with StorageManager({"tiers": [_tier(elsewhere)]}) as m:  # a valid chunk of key 2
        obj = fill_random(m, shape=(3, 2, 1000), seed=3)
        m.batched_put([make_key(2)], [obj])
        assert m.flush(10)
        obj.ref_down()
    fifo, link = cf.chunk_path(root, make_key(1)), cf.chunk_path(root, make_key(2))
    for p in (fifo, link):
        p.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    os.symlink(cf.chunk_path(elsewhere, make_key(2)), link)
    with StorageManager({"tiers": [_tier(root)]}) as m:
        backend = m.backend(0)
        out: list = []

        def ask():
            for k in (make_key(1), make_key(2)):
                out.append((backend.contains([k], pin=True), backend.get(k),
                            backend.get_layers(k, 0, 1)))
                backend.unpin([k])

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "a FIFO or a link at a chunk path hung the gds tier"
        assert out == [([False], None, None)] * 2
        obj = fill_random(m, shape=(3, 2, 1000), seed=4)
        m.batched_put([make_key(3)], [obj])
        assert m.flush(10)
        obj.ref_down()
        got = backend.get(make_key(3))
        assert got is not None
        got.ref_down()
    assert stat.S_IMODE(cf.chunk_path(root, make_key(3)).stat().st_mode) == 0o600
    made = cf.chunk_path(elsewhere, make_key(2))  # root and shard made by the tier
    assert [stat.S_IMODE(p.stat().st_mode) for p in (made, made.parent, elsewhere)] == [
        0o600, 0o700, 0o700]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(link)
