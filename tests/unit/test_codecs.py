"""Codecs as a per-tier wrapper: round trips (whole and by layer), fp8, files written with and
without a codec, promotion into L1, the encoder thread, the codec classes directly.

No engine here (tests/engine/test_codecs_engine.py runs a real vLLM): real posix tiers on real files, a
third-party-style in-memory tier. Bad input: tests/faults/test_codecs_bad_input.py; configuration,
discovery and the command line: tests/unit/test_codecs_config.py.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.codecs import LayerSpec
from kvplug.codecs.fp8 import FP8Codec, FP8Options
from kvplug.codecs.lossless import LosslessCodec
from kvplug.memory import MemoryFormat
from kvplug.testing import make_key

from tests.support.codec_helpers import (
    BLOCKS,
    BS,
    HEAD_DIM,
    HEADS,
    LAYERS,
    PAGE,
    files,
    header_of,
    kv_obj,
    manager,
    posix,
    random_obj,
    stored,
)


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [kv_obj, random_obj], ids=["kv-like", "random-bytes"])
def test_lossless_posix_round_trip_is_bit_exact_whole_and_by_layer(tmp_path, make):
    mgr = manager(posix(tmp_path, "lossless"))
    objs = [make(s) for s in range(3)]
    for i, o in enumerate(objs):
        stored(mgr, make_key(i), o)
    for i, o in enumerate(objs):
        got = mgr.get(make_key(i))
        assert got is not None and got.meta.fmt is MemoryFormat.KV_PAGES
        assert got.meta.shape == o.meta.shape and got.num_tokens == 32
        assert torch.equal(got.tensor, o.tensor)
        got.ref_down()
        for layer in range(LAYERS):
            part = mgr.get_layers(make_key(i), layer, 1)
            assert part is not None and torch.equal(part.tensor[0], o.tensor[layer])
            part.ref_down()
    s = mgr.stats()["disk"]
    assert s["codec_encoded"] == 3 and s["codec_decoded"] == 3 + 3 * LAYERS
    if make is kv_obj:  # bf16 KV compresses; random bytes do not
        assert s["codec_encoded_bytes"] < 0.9 * s["codec_raw_bytes"]
        assert sum(f.stat().st_size for f in files(tmp_path)) < 3 * LAYERS * BLOCKS * PAGE
    mgr.close()


def test_negative_control_raw_tier_does_not_compress(tmp_path):
    """The size check above can fail: without a codec the files hold every raw byte."""
    mgr = manager(posix(tmp_path))
    stored(mgr, make_key(0), kv_obj(0))
    assert files(tmp_path)[0].stat().st_size > LAYERS * BLOCKS * PAGE
    assert "codec_encoded" not in mgr.stats()["disk"]
    mgr.close()


def test_codec_runs_on_a_third_party_in_memory_tier():
    """A tier that is not a file tier (tests/tiers_for_tests.DictTier) gets the codec too."""
    mgr = manager({"backend": "tests.support.tiers_for_tests:DictTier", "name": "mem", "codec": "lossless"})
    o = kv_obj(5)
    stored(mgr, make_key(0), o)
    raw, meta = mgr.backend("mem").data[make_key(0)]
    assert meta.fmt is MemoryFormat.ENCODED  # the backend holds the encoded object
    assert raw.numel() < o.nbytes
    got = mgr.get(make_key(0))
    assert torch.equal(got.tensor, o.tensor)
    got.ref_down()
    mgr.close()


def test_header_records_codec_and_inspect_shows_it(tmp_path):
    from click.testing import CliRunner
    from kvplug.cli import main

    mgr = manager(posix(tmp_path, "lossless", {"clevel": 3}))
    stored(mgr, make_key(0), kv_obj(0))
    mgr.close()
    head = header_of(files(tmp_path)[0])
    assert head.fmt is MemoryFormat.ENCODED and head.version == "1+codec"
    assert head.codec_info["name"] == "lossless" and head.codec_info["package"] == "kvplug"
    assert head.codec_info["params"]["clevel"] == 3
    out = CliRunner().invoke(main, ["inspect", "--json", "--verify", str(tmp_path)])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["corrupt"] == [] and report["groups"][0]["codec"].startswith("lossless (kvplug")


def test_files_written_before_the_codec_still_read(tmp_path):
    raw = manager(posix(tmp_path))
    o = kv_obj(1)
    stored(raw, make_key(0), o)
    raw.close()
    assert header_of(files(tmp_path)[0]).version == cf.FORMAT_VERSION
    mgr = manager(posix(tmp_path, "lossless"))
    got = mgr.get(make_key(0))
    assert torch.equal(got.tensor, o.tensor)
    got.ref_down()
    mgr.close()


def test_tier_without_codec_decodes_a_shared_encoded_directory(tmp_path):
    w = manager(posix(tmp_path, "lossless"))
    o = kv_obj(2)
    stored(w, make_key(0), o)
    w.close()
    r = manager(posix(tmp_path))
    got = r.get(make_key(0))
    assert got.meta.fmt is MemoryFormat.KV_PAGES and torch.equal(got.tensor, o.tensor)
    got.ref_down()
    r.close()


def test_lower_tier_hit_is_promoted_raw_into_l1(tmp_path):
    w = manager(posix(tmp_path, "lossless"))
    o = kv_obj(3)
    stored(w, make_key(0), o)
    w.close()
    mgr = manager({"backend": "local_cpu", "options": {"capacity": "64MiB"}},
                  posix(tmp_path, "lossless"))
    got = mgr.get(make_key(0))
    got.ref_down()
    assert mgr.lookup_prefix([make_key(0)]).tiers == ["local_cpu"]
    again = mgr.get(make_key(0))
    assert again.meta.fmt is MemoryFormat.KV_PAGES and torch.equal(again.tensor, o.tensor)
    again.ref_down()
    mgr.close()


# -- fp8 ---------------------------------------------------------------------------------------
def test_fp8_round_trip_halves_bytes_and_error_is_bounded_per_head(tmp_path):
    mgr = manager(posix(tmp_path, "fp8", {"num_kv_heads": HEADS}))
    o = kv_obj(4)
    stored(mgr, make_key(0), o)
    got = mgr.get(make_key(0))
    assert got.meta.shape == o.meta.shape
    shape = (LAYERS, BLOCKS, HEADS, BS, 2 * HEAD_DIM)
    x = o.tensor.view(torch.bfloat16).reshape(shape).float()
    y = got.tensor.view(torch.bfloat16).reshape(shape).float()
    assert not torch.equal(x, y)  # lossy
    for h in range(HEADS):  # e4m3: 3 mantissa bits; error within 1/8 of the value + bf16 rounding
        err = (x[:, :, h] - y[:, :, h]).abs()
        assert (err <= x[:, :, h].abs() / 8 + x[:, :, h].abs().amax() / 448 / 8).all()
    s = mgr.stats()["disk"]
    assert s["codec_encoded_bytes"] < 0.6 * s["codec_raw_bytes"]
    got.ref_down()
    mgr.close()


def test_fp8_declines_a_cache_that_is_already_fp8_and_stores_it_raw(tmp_path, caplog):
    mgr = manager(posix(tmp_path, "fp8", {"num_kv_heads": HEADS}))
    o = kv_obj(0)
    with caplog.at_level(logging.WARNING, logger="kvplug.codecs"):
        stored(mgr, make_key(0, dtype="bfloat16-fp8-e4m3"), o)
    assert "stored raw" in caplog.text
    got = mgr.get(make_key(0, dtype="bfloat16-fp8-e4m3"))
    assert torch.equal(got.tensor, o.tensor) and mgr.stats()["disk"]["codec_stored_raw"] == 1
    got.ref_down()
    mgr.close()


def test_lossy_codec_says_so_at_startup(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="kvplug.storage"):
        manager(posix(tmp_path / "a", "lossless")).close()
    assert "LOSSY" not in caplog.text and "codec" in caplog.text
    with caplog.at_level(logging.INFO, logger="kvplug.storage"):
        manager(posix(tmp_path / "b", "fp8", {"num_kv_heads": 2})).close()
    assert "LOSSY" in caplog.text


# -- the codecs directly --------------------------------------------------------------------
def test_codec_classes_round_trip_one_layer_directly():
    o = kv_obj(9)
    spec = LayerSpec(make_key(0), 0, BLOCKS, PAGE)
    payload, params = LosslessCodec().encode_layer(o.tensor[0], spec)
    out = torch.empty(BLOCKS, PAGE, dtype=torch.uint8)
    LosslessCodec.decode_layer(memoryview(payload), params, out, spec)
    assert torch.equal(out, o.tensor[0])
    payload, params = FP8Codec(FP8Options(num_kv_heads=HEADS)).encode_layer(o.tensor[0], spec)
    assert len(payload) == 4 * HEADS + BLOCKS * PAGE // 2
    FP8Codec.decode_layer(memoryview(payload), params, out, spec)
    assert out.shape == (BLOCKS, PAGE)


def test_reader_older_than_codecs_sees_another_version_and_keeps_the_file(tmp_path, monkeypatch):
    """A node that predates codecs only knows version "1": an encoded chunk is a miss for it
    (ChunkVersionError), and the file stays for the nodes that can read it."""
    w = manager(posix(tmp_path, "lossless"))
    stored(w, make_key(0), kv_obj(0))
    w.close()
    path = files(tmp_path)[0]
    with monkeypatch.context() as m:
        m.setattr(cf.format, "format_version", lambda encoded: cf.FORMAT_VERSION)
        with pytest.raises(cf.format.ChunkVersionError):
            header_of(path)
        old = manager(posix(tmp_path))
        assert old.get(make_key(0)) is None
        old.close()
    assert path.exists()
    mgr = manager(posix(tmp_path))
    got = mgr.get(make_key(0))
    assert got is not None and torch.equal(got.tensor, kv_obj(0).tensor)
    got.ref_down()
    mgr.close()


class ThreadRecordingCodec(LosslessCodec):
    """The lossless codec, noting which thread encodes (named as 'module:Class' in the config)."""

    threads: list[str] = []

    def encode_layer(self, pages, spec):
        import threading

        ThreadRecordingCodec.threads.append(threading.current_thread().name)
        return super().encode_layer(pages, spec)


def test_encoding_runs_on_the_tiers_encoder_thread_not_the_callers(tmp_path):
    import threading

    mgr = manager(posix(tmp_path, "tests.unit.test_codecs:ThreadRecordingCodec"))
    ThreadRecordingCodec.threads.clear()
    o = kv_obj(0)
    mgr.batched_put([make_key(0)], [o])
    o.ref_down()  # the caller may drop its reference at once: the put holds its own
    assert mgr.flush(60)
    assert ThreadRecordingCodec.threads and threading.current_thread().name not in \
        ThreadRecordingCodec.threads
    assert all(t.startswith("kvplug-enc-disk") for t in ThreadRecordingCodec.threads)
    got = mgr.get(make_key(0))
    assert torch.equal(got.tensor, kv_obj(0).tensor)
    got.ref_down()
    mgr.close()
