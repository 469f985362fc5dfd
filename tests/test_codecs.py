"""Codecs as a per-tier wrapper: round trips, layer-wise reads, files, bad input, discovery.

No engine here (tests/test_codecs_engine.py runs a real vLLM): real posix tiers on real files, a
third-party-style in-memory tier, third-party codecs as real distributions on sys.path.
"""

from __future__ import annotations

import json
import logging
import textwrap

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.codecs import LayerSpec, load_codec_class, parse_frame
from kvplug.codecs.fp8 import FP8Codec, FP8Options
from kvplug.codecs.lossless import LosslessCodec
from kvplug.codecs.registry import clear_cache
from kvplug.errors import ConfigError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, heap_memory_obj
from kvplug.storage_manager import StorageManager

LAYERS, BLOCKS, HEADS, BS, HEAD_DIM = 4, 2, 2, 16, 64
PAGE = HEADS * BS * 2 * HEAD_DIM * 2  # [H, N, C=2*head_dim] bf16: LBHNC, block size 16


def key(i: int, dtype: str = "bfloat16") -> CacheKey:
    return CacheKey("org/m", dtype, "LBHNC-bs16", 1, 0, i.to_bytes(4, "big") * 8)


def kv_obj(seed: int, layers: int = LAYERS, tokens: int = 32):
    """A KV_PAGES chunk of bf16 values like KV (normal, a few large heads), as raw bytes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, BLOCKS, HEADS, BS, 2 * HEAD_DIM, generator=g)
    x[:, :, 1] *= 8.0  # one head with a larger range: per-head scales matter for fp8
    obj = heap_memory_obj((layers, BLOCKS, PAGE), num_tokens=tokens)
    obj.tensor.copy_(x.to(torch.bfloat16).view(torch.uint8).reshape(layers, BLOCKS, PAGE))
    return obj


def random_obj(seed: int):
    g = torch.Generator().manual_seed(seed)
    obj = heap_memory_obj((LAYERS, BLOCKS, PAGE), num_tokens=32)
    obj.tensor.copy_(torch.randint(0, 256, (LAYERS, BLOCKS, PAGE), dtype=torch.uint8, generator=g))
    return obj


def posix(path, codec: str | None = None, options: dict | None = None, name: str = "disk"):
    tier = {"backend": "posix", "name": name, "options": {"path": str(path), "capacity": "1GiB"}}
    if codec:
        tier["codec"] = codec
    if options:
        tier["codec_options"] = options
    return tier


def manager(*tiers) -> StorageManager:
    return StorageManager({"chunk_size": 32, "tiers": list(tiers)})


def stored(mgr: StorageManager, k: CacheKey, obj) -> None:
    mgr.batched_put([k], [obj])
    assert mgr.flush(60)


def files(root) -> list:
    return sorted(p for p in root.rglob("*") if p.is_file() and cf.is_chunk_file(p.name))


def header_of(path) -> cf.ChunkHeader:
    with open(path, "rb") as f:
        return cf.read_header_fd(f.fileno())[0]


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [kv_obj, random_obj], ids=["kv-like", "random-bytes"])
def test_lossless_posix_round_trip_is_bit_exact_whole_and_by_layer(tmp_path, make):
    mgr = manager(posix(tmp_path, "lossless"))
    objs = [make(s) for s in range(3)]
    for i, o in enumerate(objs):
        stored(mgr, key(i), o)
    for i, o in enumerate(objs):
        got = mgr.get(key(i))
        assert got is not None and got.meta.fmt is MemoryFormat.KV_PAGES
        assert got.meta.shape == o.meta.shape and got.num_tokens == 32
        assert torch.equal(got.tensor, o.tensor)
        got.ref_down()
        for layer in range(LAYERS):
            part = mgr.get_layers(key(i), layer, 1)
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
    stored(mgr, key(0), kv_obj(0))
    assert files(tmp_path)[0].stat().st_size > LAYERS * BLOCKS * PAGE
    assert "codec_encoded" not in mgr.stats()["disk"]
    mgr.close()


def test_codec_runs_on_a_third_party_in_memory_tier():
    """A tier that is not a file tier (tests/tiers_for_tests.DictTier) gets the codec too."""
    mgr = manager({"backend": "tiers_for_tests:DictTier", "name": "mem", "codec": "lossless"})
    o = kv_obj(5)
    stored(mgr, key(0), o)
    raw, meta = mgr.backend("mem").data[key(0)]
    assert meta.fmt is MemoryFormat.ENCODED  # the backend holds the encoded object
    assert raw.numel() < o.nbytes
    got = mgr.get(key(0))
    assert torch.equal(got.tensor, o.tensor)
    got.ref_down()
    mgr.close()


def test_header_records_codec_and_inspect_shows_it(tmp_path):
    from click.testing import CliRunner
    from kvplug.cli import main

    mgr = manager(posix(tmp_path, "lossless", {"clevel": 3}))
    stored(mgr, key(0), kv_obj(0))
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
    stored(raw, key(0), o)
    raw.close()
    assert header_of(files(tmp_path)[0]).version == cf.FORMAT_VERSION
    mgr = manager(posix(tmp_path, "lossless"))
    got = mgr.get(key(0))
    assert torch.equal(got.tensor, o.tensor)
    got.ref_down()
    mgr.close()


def test_tier_without_codec_decodes_a_shared_encoded_directory(tmp_path):
    w = manager(posix(tmp_path, "lossless"))
    o = kv_obj(2)
    stored(w, key(0), o)
    w.close()
    r = manager(posix(tmp_path))
    got = r.get(key(0))
    assert got.meta.fmt is MemoryFormat.KV_PAGES and torch.equal(got.tensor, o.tensor)
    got.ref_down()
    r.close()


def test_lower_tier_hit_is_promoted_raw_into_l1(tmp_path):
    w = manager(posix(tmp_path, "lossless"))
    o = kv_obj(3)
    stored(w, key(0), o)
    w.close()
    mgr = manager({"backend": "local_cpu", "options": {"capacity": "64MiB"}},
                  posix(tmp_path, "lossless"))
    got = mgr.get(key(0))
    got.ref_down()
    assert mgr.lookup_prefix([key(0)]).tiers == ["local_cpu"]
    again = mgr.get(key(0))
    assert again.meta.fmt is MemoryFormat.KV_PAGES and torch.equal(again.tensor, o.tensor)
    again.ref_down()
    mgr.close()


# -- fp8 ---------------------------------------------------------------------------------------
def test_fp8_round_trip_halves_bytes_and_error_is_bounded_per_head(tmp_path):
    mgr = manager(posix(tmp_path, "fp8", {"num_kv_heads": HEADS}))
    o = kv_obj(4)
    stored(mgr, key(0), o)
    got = mgr.get(key(0))
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
        stored(mgr, key(0, "bfloat16-fp8-e4m3"), o)
    assert "stored raw" in caplog.text
    got = mgr.get(key(0, "bfloat16-fp8-e4m3"))
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


# -- config errors ----------------------------------------------------------------------------
def test_unknown_codec_is_a_config_error_naming_the_installed_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"codec 'zfp' is not installed; installed codecs: .*fp8.*"
                                          r"lossless"):
        manager(posix(tmp_path, "zfp"))


def test_codec_on_l1_and_bad_codec_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="never blocks"):
        manager({"backend": "local_cpu", "codec": "lossless"})
    with pytest.raises(ConfigError, match="num_kv_heads"):
        manager(posix(tmp_path, "fp8"))
    with pytest.raises(ConfigError, match="clevel"):
        manager(posix(tmp_path, "lossless", {"clevel": 42}))
    with pytest.raises(ConfigError, match="codec_options given without a codec"):
        manager({**posix(tmp_path), "codec_options": {"clevel": 1}})


# -- bad input ---------------------------------------------------------------------------------
def rewrite(path, edit) -> None:
    """Rewrite a chunk file with its layer slots changed by ``edit(slots)`` and every checksum
    recomputed (what a buggy writer or a tier without checksums could hand back)."""
    head = header_of(path)
    data = path.read_bytes()
    slots = [bytearray(data[o : o + head.layer_nbytes]) for o in head.data_offsets]
    edit(slots)
    t = torch.frombuffer(bytearray(b"".join(slots)), dtype=torch.uint8)
    obj = heap_memory_obj(head.shape, fmt=head.fmt, num_tokens=head.num_tokens)
    obj.tensor.copy_(t.reshape(head.shape))
    obj.meta = type(head.meta)(head.shape, head.dtype, head.fmt, head.num_tokens, head.codec)
    header, bufs = cf.encode_chunk(head.key, obj)
    path.write_bytes(header + b"".join(bytes(b) for b in bufs))


def frame_doc(slot: bytearray) -> tuple[dict, int, int]:
    jlen = int.from_bytes(slot[4:8], "little")
    return json.loads(bytes(slot[16 : 16 + jlen])), jlen, int.from_bytes(slot[8:16], "little")


def set_doc(slot: bytearray, doc: dict, old_jlen: int) -> None:
    plen = int.from_bytes(slot[8:16], "little")
    payload = bytes(slot[16 + old_jlen : 16 + old_jlen + plen])
    desc = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    new = bytes(slot[:4]) + len(desc).to_bytes(4, "little") + slot[8:16] + desc + payload
    slot[:] = new.ljust(len(slot), b"\0")[: max(len(slot), len(new))]


def _wrong_params(slots):
    doc, jlen, _ = frame_doc(slots[1])
    doc["params"]["lib"] = "zstandard"
    set_doc(slots[1], doc, jlen)


def _wrong_geometry(slots):
    for s in slots:
        doc, jlen, _ = frame_doc(s)
        doc["page_bytes"] //= 2
        doc["blocks"] *= 2
        doc.pop("raw_xxh3")
        set_doc(s, doc, jlen)


def _truncated_payload(slots):
    doc, jlen, plen = frame_doc(slots[2])
    payload = bytes(slots[2][16 + jlen : 16 + jlen + plen // 2])
    doc["payload_xxh3"] = cf.checksum(payload)
    desc = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    new = b"KVCF" + len(desc).to_bytes(4, "little") + len(payload).to_bytes(8, "little") + desc
    slots[2][:] = (new + payload).ljust(len(slots[2]), b"\0")


def _flipped_payload(slots):
    doc, jlen, plen = frame_doc(slots[0])
    at = 16 + jlen + plen // 2
    slots[0][at] ^= 0x40


def _flipped_payload_rehashed(slots):
    """The payload digest recomputed too: only the raw checksum after decoding can tell."""
    _flipped_payload(slots)
    doc, jlen, plen = frame_doc(slots[0])
    doc["payload_xxh3"] = cf.checksum(bytes(slots[0][16 + jlen : 16 + jlen + plen]))
    set_doc(slots[0], doc, jlen)


def _overrun(slots):
    slots[3][8:16] = (10**9).to_bytes(8, "little")


def _bad_magic(slots):
    slots[0][:4] = b"NOPE"


BAD = [_wrong_params, _wrong_geometry, _truncated_payload, _flipped_payload,
       _flipped_payload_rehashed, _overrun, _bad_magic]


@pytest.mark.parametrize("edit", BAD, ids=[f.__name__.strip("_") for f in BAD])
def test_bad_encoded_chunk_is_a_miss_with_a_log_line(tmp_path, edit, caplog):
    w = manager(posix(tmp_path, "lossless"))
    stored(w, key(0), kv_obj(0))
    stored(w, key(1), kv_obj(1))  # a good neighbour, read after the bad one
    w.close()
    path = cf.chunk_path(tmp_path, key(0))
    rewrite(path, edit)
    mgr = manager(posix(tmp_path, "lossless"))
    with caplog.at_level(logging.WARNING, logger="kvplug.codecs"):
        whole = mgr.get(key(0))
        parts = [mgr.get_layers(key(0), i, 1) for i in range(LAYERS)]
    orig = kv_obj(0).tensor
    if edit is _wrong_geometry:
        # the same bytes under another page geometry: the connector's shape check refuses them
        # (connector/load.py valid_pages), so they never reach a block
        assert whole.meta.shape != orig.shape and torch.equal(whole.byte_view, orig.reshape(-1))
        whole.ref_down()
        for p in parts:
            p.ref_down()
        return
    assert whole is None
    # a layer read alone is either a miss or exactly the original layer, never other bytes
    assert any(p is None for p in parts)
    for i, p in enumerate(parts):
        if p is not None:
            assert torch.equal(p.tensor[0], orig[i])
            p.ref_down()
    assert "treated as a miss" in caplog.text
    assert mgr.stats()["disk"]["codec_decode_failures"] >= 1
    good = mgr.get(key(1))
    assert good is not None and torch.equal(good.tensor, kv_obj(1).tensor)
    good.ref_down()
    mgr.close()


def test_control_rewrite_without_edit_still_reads(tmp_path):
    """The bad-input harness itself keeps a file valid when it changes nothing."""
    w = manager(posix(tmp_path, "lossless"))
    stored(w, key(0), kv_obj(0))
    w.close()
    rewrite(cf.chunk_path(tmp_path, key(0)), lambda slots: None)
    mgr = manager(posix(tmp_path, "lossless"))
    got = mgr.get(key(0))
    assert got is not None and torch.equal(got.tensor, kv_obj(0).tensor)
    got.ref_down()
    mgr.close()


def test_flipped_file_byte_is_caught_by_the_file_checksum(tmp_path):
    w = manager(posix(tmp_path, "lossless"))
    stored(w, key(0), kv_obj(0))
    w.close()
    path = files(tmp_path)[0]
    head = header_of(path)
    data = bytearray(path.read_bytes())
    data[head.data_offsets[1] + 40] ^= 1
    path.write_bytes(bytes(data))
    mgr = manager(posix(tmp_path, "lossless"))
    assert mgr.get(key(0)) is None
    assert mgr.stats()["disk"]["corrupt"] == 1  # the tier's own checksum (over encoded bytes)
    mgr.close()


def test_wrong_codec_metadata_in_the_header_is_a_miss(tmp_path):
    w = manager(posix(tmp_path, "lossless"))
    stored(w, key(0), kv_obj(0))
    w.close()
    path = files(tmp_path)[0]
    data = path.read_bytes()
    path.write_bytes(data.replace(b'\\"name\\":\\"lossless\\"', b'\\"name\\":\\"lossmore\\"', 1))
    assert path.read_bytes() != data
    mgr = manager(posix(tmp_path, "lossless"))
    assert mgr.get(key(0)) is None
    mgr.close()


# -- third-party codecs through the entry-point group ----------------------------------------
XOR_CODEC = '''
import torch
from kvplug.codecs import Codec

class XorCodec(Codec):
    """Toy codec: every byte xor 0x5A (proves the bytes pass through the third party's code)."""

    def encode_layer(self, pages, spec):
        return (pages.contiguous() ^ 0x5A).numpy().tobytes(), {"xor": 90}

    @classmethod
    def decode_layer(cls, payload, params, out, spec):
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out.view(torch.uint8).reshape(-1).copy_(data ^ params["xor"])
'''


def install_codec(site, dist: str, module: str, entry: str, body: str) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[kvplug.codecs]\n{entry}\n")


def test_third_party_codec_is_found_used_and_missing_is_a_miss_naming_it(tmp_path, monkeypatch,
                                                                        caplog):
    site = tmp_path / "site"
    site.mkdir()
    install_codec(site, "kvplug-xor", "kvplug_xor", "xor = kvplug_xor:XorCodec", XOR_CODEC)
    with monkeypatch.context() as m:
        m.syspath_prepend(str(site))
        clear_cache()
        cls, info = load_codec_class("xor")
        assert (info.package, info.version) == ("kvplug-xor", "0.1.0")
        mgr = manager(posix(tmp_path / "d", "xor"))
        o = kv_obj(7)
        stored(mgr, key(0), o)
        got = mgr.get(key(0))
        assert torch.equal(got.tensor, o.tensor)
        got.ref_down()
        mgr.close()
    path = files(tmp_path / "d")[0]
    head = header_of(path)
    assert head.codec_info["package"] == "kvplug-xor"
    slot = path.read_bytes()[head.data_offsets[0] :][: head.layer_nbytes]
    frame = parse_frame(slot)
    assert bytes(frame.payload[:16]) == bytes((o.tensor[0, 0, :16] ^ 0x5A).tolist())
    clear_cache()  # the distribution is gone from sys.path now
    mgr = manager(posix(tmp_path / "d", "lossless"))
    with caplog.at_level(logging.WARNING, logger="kvplug.codecs"):
        assert mgr.get(key(0)) is None
    assert "codec 'xor' (package kvplug-xor 0.1.0)" in caplog.text
    assert "install kvplug-xor" in caplog.text
    assert mgr.stats()["disk"]["codec_missing"] == 1
    mgr.close()
    clear_cache()


# -- the codecs directly --------------------------------------------------------------------
def test_codec_classes_round_trip_one_layer_directly():
    o = kv_obj(9)
    spec = LayerSpec(key(0), 0, BLOCKS, PAGE)
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
    stored(w, key(0), kv_obj(0))
    w.close()
    path = files(tmp_path)[0]
    with monkeypatch.context() as m:
        m.setattr(cf.format, "format_version", lambda encoded: cf.FORMAT_VERSION)
        with pytest.raises(cf.format.ChunkVersionError):
            header_of(path)
        old = manager(posix(tmp_path))
        assert old.get(key(0)) is None
        old.close()
    assert path.exists()
    mgr = manager(posix(tmp_path))
    got = mgr.get(key(0))
    assert got is not None and torch.equal(got.tensor, kv_obj(0).tensor)
    got.ref_down()
    mgr.close()


def test_inspect_table_names_the_codec(tmp_path):
    from click.testing import CliRunner
    from kvplug.cli import main

    for codec, sub in ((None, "a"), ("lossless", "b")):
        mgr = manager(posix(tmp_path / sub, codec))
        stored(mgr, key(0), kv_obj(0))
        mgr.close()
    raw = CliRunner().invoke(main, ["inspect", str(tmp_path / "a")], terminal_width=250)
    enc = CliRunner().invoke(main, ["inspect", str(tmp_path / "b")], terminal_width=250)
    assert raw.exit_code == 0 and enc.exit_code == 0
    assert "lossless" in enc.output and "lossless" not in raw.output


class ThreadRecordingCodec(LosslessCodec):
    """The lossless codec, noting which thread encodes (named as 'module:Class' in the config)."""

    threads: list[str] = []

    def encode_layer(self, pages, spec):
        import threading

        ThreadRecordingCodec.threads.append(threading.current_thread().name)
        return super().encode_layer(pages, spec)


def test_encoding_runs_on_the_tiers_encoder_thread_not_the_callers(tmp_path):
    import threading

    mgr = manager(posix(tmp_path, "test_codecs:ThreadRecordingCodec"))
    ThreadRecordingCodec.threads.clear()
    o = kv_obj(0)
    mgr.batched_put([key(0)], [o])
    o.ref_down()  # the caller may drop its reference at once: the put holds its own
    assert mgr.flush(60)
    assert ThreadRecordingCodec.threads and threading.current_thread().name not in \
        ThreadRecordingCodec.threads
    assert all(t.startswith("kvplug-enc-disk") for t in ThreadRecordingCodec.threads)
    got = mgr.get(key(0))
    assert torch.equal(got.tensor, kv_obj(0).tensor)
    got.ref_down()
    mgr.close()


def test_config_check_resolves_codecs_and_names_unknown_ones(tmp_path):
    import yaml
    from click.testing import CliRunner
    from kvplug.cli import main

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"tiers": [
        {"backend": "local_cpu"},
        {**posix(tmp_path / "d", "fp8", {"num_kv_heads": 8})}]}))
    out = CliRunner().invoke(main, ["config", "check", "--json", str(good)])
    assert out.exit_code == 0, out.output
    assert '"lossy": true' in out.output and '"num_kv_heads": 8' in out.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tiers": [posix(tmp_path / "d", "zfp")]}))
    out = CliRunner().invoke(main, ["config", "check", str(bad)])
    assert out.exit_code != 0 and "codec 'zfp' is not installed" in out.output
    assert "lossless" in out.output
