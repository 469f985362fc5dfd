"""A stored chunk never chooses code.

An attacker with write access to a shared store plants an ENCODED chunk whose codec frames (and
header) name ``"<module>:<Class>"``. Were that name passed to ``importlib.import_module`` (by the
codec wrapper of any tier, even one with no codec configured), a module file anywhere on
``sys.path`` would run inside the engine. So a codec is resolved only among the installed
``kvplug.codecs`` entry points and the tier's own configured codec; anything else is a miss,
counted in ``codec_missing`` and logged once, and nothing is imported.

The planted module records its import by writing a marker file; the negative control imports it
directly and sees the marker.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import uuid

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.codecs import build_frame
from kvplug.memory import MemoryFormat, MemoryObj, MemoryObjMeta
from kvplug.testing import make_key

from tests.support.codec_helpers import BLOCKS, LAYERS, PAGE, manager, posix

MODULE_BODY = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")

from kvplug.codecs.lossless import LosslessCodec


class Evil(LosslessCodec):
    pass
"""


@pytest.fixture
def planted_module(tmp_path, monkeypatch):
    """A module on ``sys.path`` that writes a marker file when imported: ``(name, marker)``."""
    name = f"kvplug_planted_{uuid.uuid4().hex[:12]}"
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "imported.marker"
    (site / f"{name}.py").write_text(MODULE_BODY.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield name, marker
    sys.modules.pop(name, None)


def planted_chunk(root, k, codec_name: str) -> None:
    """Write, with the public chunk-file library (what an attacker has), an ENCODED chunk whose
    frames and header name ``codec_name``; every checksum is valid."""
    frames = []
    for i in range(LAYERS):
        payload = bytes([i]) * (BLOCKS * PAGE)
        frames.append(build_frame(codec_name, "evil-pkg", "6.6.6", {"lib": "blosc2"}, BLOCKS,
                                  PAGE, payload))
    slot = max(len(f) for f in frames)
    t = torch.zeros((LAYERS, 1, slot), dtype=torch.uint8)
    for i, f in enumerate(frames):
        t[i, 0, : len(f)] = torch.frombuffer(bytearray(f), dtype=torch.uint8)
    desc = json.dumps({"name": codec_name, "package": "evil-pkg", "version": "6.6.6",
                       "params": {}}, sort_keys=True, separators=(",", ":"))
    obj = MemoryObj(t, MemoryObjMeta((LAYERS, 1, slot), torch.uint8, MemoryFormat.ENCODED, 32,
                                     desc))
    header, bufs = cf.encode_chunk(k, obj)
    path = root / cf.relative_chunk_path(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + b"".join(bytes(b) for b in bufs))


@pytest.mark.parametrize("configured", [None, "lossless"], ids=["no-codec", "other-codec"])
def test_a_chunk_naming_a_module_imports_nothing_and_is_a_miss(tmp_path, planted_module,
                                                               configured, caplog):
    name, marker = planted_module
    root = tmp_path / "disk"
    planted_chunk(root, make_key(0), f"{name}:Evil")
    planted_chunk(root, make_key(1), f"{name}:Evil")
    mgr = manager(posix(root, configured))
    try:
        with caplog.at_level(logging.WARNING, logger="kvplug.codecs"):
            assert mgr.lookup_prefix([make_key(0)]).num_chunks == 1  # the tier does hold a file
            assert mgr.get(make_key(0)) is None
            assert mgr.batched_get([make_key(1)]) == [None]
            assert mgr.get_layers(make_key(0), 1, 1) is None
        assert not marker.exists(), "a module named by stored bytes was imported"
        assert name not in sys.modules
        assert mgr.stats()["disk"]["codec_missing"] == 3
        assert caplog.text.count("codec") >= 1
        assert len([r for r in caplog.records if "not installed here" in r.getMessage()]) == 1
    finally:
        mgr.close()


def test_negative_control_importing_the_planted_module_writes_the_marker(planted_module):
    name, marker = planted_module
    importlib.import_module(name)
    assert marker.read_text() == "imported"


def test_the_configured_module_path_codec_still_reads_its_own_chunks(tmp_path, planted_module):
    """A codec named as ``module:Class`` in the tier's *config* (the operator's choice) is the
    one thing besides entry points a tier decodes with; stored bytes naming it are then read."""
    name, marker = planted_module
    root = tmp_path / "disk"
    mgr = manager(posix(root, f"{name}:Evil"))
    assert marker.exists()  # the operator's config imported it (trusted)
    try:
        from tests.support.codec_helpers import kv_obj, stored

        o = kv_obj(3)
        stored(mgr, make_key(0), o)
        got = mgr.get(make_key(0))
        assert got is not None and torch.equal(got.tensor, o.tensor)
        got.ref_down()
    finally:
        mgr.close()
