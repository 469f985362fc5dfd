"""gds tier: decision, options, format and fallback logic — runs everywhere (no kvikio needed).

Only the decision tests replace the probe (``gds.probe``): a missing driver or kvikio cannot be
caused for real on a machine that has them. Everything else here uses the machine as it is.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.backends.gds import backend as gds
from kvplug.backends.gds import io as gds_io
from kvplug.backends.gds import probe as gds_probe
from kvplug.backends.gds.probe import GDSUnavailableError, Mode, Probe, decide, kvikio_settings
from kvplug.backends.posix import PosixBackend
from kvplug.backends.posix.io import ChunkFileIO
from kvplug.errors import ConfigError
from kvplug.logs import LogOnce
from kvplug.memory import heap_memory_obj
from kvplug.storage_manager import StorageManager
from kvplug.testing import BackendConformance, fill_random, make_key

NO_DRIVER = Probe(driver=False, driver_error="libcuda.so.1: cannot open shared object file")
NO_KVIKIO = Probe(driver=True, kvikio_error="ModuleNotFoundError: No module named 'kvikio'")
COMPAT = Probe(driver=True, kvikio_version="26.10.00", cuda_device=True, gds=False)
FULL = Probe(driver=True, kvikio_version="26.10.00", cuda_device=True, gds=True)
REAL = gds_probe.probe()


def _tier(path, **opts) -> dict:
    return {"backend": "gds", "options": {"path": str(path), **opts}}


# -- the decision -------------------------------------------------------------------------------
def test_no_driver_refuses_naming_posix_and_fallback():
    with pytest.raises(GDSUnavailableError) as err:
        decide(NO_DRIVER, "none", "disk")
    msg = str(err.value)
    assert "'posix' backend" in msg and "fallback: posix" in msg and "'disk'" in msg
    assert "libcuda.so.1" in msg


def test_driver_without_kvikio_refuses_naming_the_extra():
    with pytest.raises(GDSUnavailableError, match=r"pip install 'kvplug\[gds\]'"):
        decide(NO_KVIKIO, "none")


@pytest.mark.parametrize("found", [NO_DRIVER, NO_KVIKIO])
def test_fallback_posix_when_kvikio_cannot_run(found, caplog):
    with caplog.at_level(logging.WARNING, "kvplug.backends.gds"):
        assert decide(found, "posix") is Mode.POSIX
    assert "running as the posix tier" in caplog.text


def test_compat_and_gds_modes():
    assert decide(COMPAT, "none") is Mode.COMPAT
    assert decide(FULL, "none") is Mode.GDS
    assert decide(FULL, "posix") is Mode.GDS  # the fallback is only for when kvikio cannot run


def test_log_once(caplog, monkeypatch):
    monkeypatch.setattr(gds_probe, "log_once", LogOnce(gds_probe.logger))
    with caplog.at_level(logging.WARNING, "kvplug.backends.gds"):
        for _ in range(3):
            gds_probe.log_once("compat", "compat mode %s", "on")
    assert caplog.text.count("compat mode on") == 1


def test_probe_reports_this_machine():
    """The real probe never raises; without a driver it does not even import kvikio."""
    assert isinstance(REAL.driver, bool)
    if not REAL.driver:
        assert REAL.driver_error and not REAL.kvikio


# -- options -> kvikio.defaults -------------------------------------------------------------------
def test_options_map_to_kvikio_defaults():
    opts = gds.GDSBackend.Options(path="/x", num_threads=8, task_size="2MiB",
                                  gds_threshold="64KiB", direct_io_read=True,
                                  direct_io_write=False)
    assert kvikio_settings(opts, Mode.GDS) == {
        "num_threads": 8, "task_size": 2 << 20, "gds_threshold": 64 << 10,
        "auto_direct_io_read": True, "auto_direct_io_write": False,
    }
    assert kvikio_settings(gds.GDSBackend.Options(path="/x"), Mode.GDS) == {}
    assert kvikio_settings(gds.GDSBackend.Options(path="/x"), Mode.COMPAT) == {"compat_mode": 1}
    off = gds.GDSBackend.Options(path="/x", compat_mode="off")
    assert kvikio_settings(off, Mode.GDS) == {"compat_mode": 0}


def test_unknown_or_bad_option_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="fallback"):
        StorageManager({"tiers": [_tier(tmp_path, fallback="s3")]})
    with pytest.raises(ConfigError, match="nthreads"):
        StorageManager({"tiers": [_tier(tmp_path, nthreads=4)]})


# -- the backend's decision, through a StorageManager -----------------------------------------------
def test_backend_refuses_without_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(gds, "probe", lambda: NO_DRIVER)
    with pytest.raises(GDSUnavailableError, match="fallback: posix"):
        StorageManager({"tiers": [_tier(tmp_path / "c")]})
    assert not (tmp_path / "c").exists(), "a refused tier must not touch its directory"


def test_backend_falls_back_to_posix(tmp_path, monkeypatch):
    monkeypatch.setattr(gds, "probe", lambda: NO_KVIKIO)
    with StorageManager({"tiers": [_tier(tmp_path, fallback="posix")]}) as mgr:
        obj = fill_random(mgr)
        want = obj.byte_view.clone()
        mgr.batched_put([make_key(1)], [obj])
        assert mgr.flush(10)
        obj.ref_down()
        st = mgr.stats()["gds"]
        assert st["posix_fallback"] == 1 and st["gds_active"] == 0 and st["writes"] == 1
        backend = mgr.backend(0)
        got = backend.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, want)
        got.ref_down()
        assert backend.get(make_key(2)) is None


# -- format and alignment (what the gds tier writes is what posix writes) ----------------------------
@pytest.mark.parametrize("shape", [(2, 2, 4096), (3, 1, 1000), (1, 4, 6000), (5, 2, 8)])
def test_file_size_and_alignment_match_the_format(shape):
    key = make_key(3)
    obj = heap_memory_obj(shape)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8))
    header, bufs = cf.encode_chunk(key, obj)
    assert gds_io.chunk_file_size(key, obj) == len(header) + sum(len(b) for b in bufs)
    parsed = cf.decode_header(header, gds_io.chunk_file_size(key, obj))
    assert all(off % cf.ALIGN == 0 for off in parsed.data_offsets)
    assert parsed.file_size % cf.ALIGN == 0


def test_posix_internals_the_gds_tier_builds_on():
    """GDSBackend subclasses PosixBackend and replaces its byte-moving part (``_chunk_io``: a
    ``ChunkFileIO`` whose ``prepare_write``/``read`` go through kvikio); fail loudly if the posix
    tier's seams change."""
    assert callable(getattr(PosixBackend, "_chunk_io", None))
    assert issubclass(gds_io.KvikioFileIO, ChunkFileIO)
    for name in ("prepare_write", "read", "forget"):
        assert callable(getattr(ChunkFileIO, name, None)), name
        assert callable(getattr(gds_io.KvikioFileIO, name, None)), name
    assert issubclass(gds.GDSBackend, PosixBackend)
    assert set(PosixBackend.Options.model_fields) <= set(gds.GDSBackend.Options.model_fields)


# -- fallback: posix for real (only where there really is no driver, e.g. CI) -----------------------
needs_no_driver = pytest.mark.skipif(
    REAL.driver and REAL.kvikio,
    reason="kvikio runs on this machine, so fallback: posix cannot happen for real "
    "(tests/backends/test_gds_kvikio.py covers the tier here)",
)


@needs_no_driver
class TestGDSFallbackConformance(BackendConformance):
    """The conformance suite against ``gds`` with ``fallback: posix`` on a machine without a
    usable kvikio: the tier runs as posix. This is fallback coverage, not GDS coverage."""

    persistent = True

    @pytest.fixture
    def make_tiers(self, tmp_path):
        return lambda capacity: [_tier(tmp_path / "c", capacity=capacity, fallback="posix")]

    @pytest.fixture
    def corrupt_entry(self, tmp_path):
        def corrupt(manager, key):
            path = cf.chunk_path(tmp_path / "c", key)
            data = bytearray(path.read_bytes())
            data[-5000] ^= 0xFF
            path.write_bytes(bytes(data))

        return corrupt


@needs_no_driver
def test_fallback_reads_a_posix_directory_and_posix_reads_it(tmp_path):
    """Same directory, either tier: posix writes -> gds (fallback) reads, and the reverse."""
    root = tmp_path / "shared"
    with StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(root)}}]}) as m:
        a = fill_random(m, seed=1)
        want_a = a.byte_view.clone()
        m.batched_put([make_key(1)], [a])
        assert m.flush(10)
        a.ref_down()
    with StorageManager({"tiers": [_tier(root, fallback="posix")]}) as m:
        got = m.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, want_a)
        got.ref_down()
        b = fill_random(m, seed=2)
        want_b = b.byte_view.clone()
        m.batched_put([make_key(2)], [b])
        assert m.flush(10)
        b.ref_down()
    with StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(root)}}]}) as m:
        got = m.get(make_key(2))
        assert got is not None and torch.equal(got.byte_view, want_b)
        got.ref_down()
    assert sorted(p.name[:2] for p in root.iterdir() if p.is_dir()) == sorted(
        {make_key(1).hex[:2], make_key(2).hex[:2]})
    assert not [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".safetensors")]
    assert os.path.exists(cf.chunk_path(root, make_key(2)))
