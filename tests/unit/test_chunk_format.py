"""The chunk file format: safetensors-compatible, 4 KiB-aligned layers, every damage detected."""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObjMeta, heap_memory_obj
from safetensors import safe_open

CASES = [
    ((4, 2, 4096), torch.uint8),  # layers already 4 KiB multiples: no padding
    ((3, 4, 1000), torch.bfloat16),  # 8000 B layers: padded
    ((2, 3, 7, 5), torch.float32),  # 4-D, odd sizes
    ((5, 1, 33), torch.int64),
    ((1, 1, 1), torch.float16),
]


def _key(i: int = 0, model: str = "org/model-7b") -> CacheKey:
    return CacheKey(model, "bfloat16", "LBHNC-bs16", 2, 1, os.urandom(31) + bytes([i]))


def _obj(shape, dtype, seed=0, fmt=MemoryFormat.KV_PAGES, num_tokens=48):
    obj = heap_memory_obj(shape, dtype, fmt, num_tokens)
    gen = torch.Generator().manual_seed(seed)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def _file(key, obj) -> bytes:
    header, bufs = cf.encode_chunk(key, obj)
    return header + b"".join(bytes(b) for b in bufs)


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_round_trip_and_alignment(shape, dtype, tmp_path):
    key, obj = _key(), _obj(shape, dtype, seed=sum(shape))
    data = _file(key, obj)
    head = cf.decode_header(data[: cf.HEADER_PROBE], len(data))
    assert head.key == key and head.shape == shape and head.dtype == dtype
    assert head.num_tokens == 48 and head.fmt is MemoryFormat.KV_PAGES
    assert head.version == cf.FORMAT_VERSION and head.file_size == len(data)
    assert head.header_bytes % cf.ALIGN == 0 and len(data) % cf.ALIGN == 0
    assert all(off % cf.ALIGN == 0 for off in head.data_offsets)
    assert (head.num_layers, head.num_blocks) == shape[:2]
    assert head.num_layers * head.layer_nbytes == obj.nbytes
    layers = obj.byte_view.view(head.num_layers, -1)
    rebuilt = torch.empty(obj.nbytes, dtype=torch.uint8)
    for i, off in enumerate(head.data_offsets):
        chunk = data[off : off + head.layer_nbytes]
        assert cf.verify_layer(head, i, chunk)
        assert chunk == layers[i].numpy().tobytes()
        rebuilt[i * head.layer_nbytes : (i + 1) * head.layer_nbytes] = torch.frombuffer(
            bytearray(chunk), dtype=torch.uint8)
    assert torch.equal(rebuilt, obj.byte_view)  # bit-exact (random floats include NaNs)
    # Any safetensors reader opens it; layer tensors are the object's pages.
    path = tmp_path / "c.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format_version"] == cf.FORMAT_VERSION and meta["num_tokens"] == "48"
        assert meta["chunk_hash"] == key.hex and meta["kv_layout"] == key.kv_layout
        assert json.loads(meta["checksums"]) == head.checksums
        for i in range(head.num_layers):
            t = f.get_tensor(f"layer.{i}")
            assert t.dtype == torch.uint8 and tuple(t.shape) == (head.num_blocks, head.page_bytes)
            assert torch.equal(t.flatten(), layers[i])


def test_buffers_are_zero_copy_views():
    obj = _obj((2, 2, 4096), torch.uint8)
    _, bufs = cf.encode_chunk(_key(), obj)
    obj.byte_view[0] ^= 0xFF  # a view of obj changes with it; a copy would not
    assert bufs[0][0] == obj.byte_view[0].item()


def test_binary_and_large_headers():
    key = _key()
    obj = _obj((10_000,), torch.uint8, fmt=MemoryFormat.BINARY, num_tokens=0)
    data = _file(key, obj)
    head = cf.decode_header(data[: cf.HEADER_PROBE], len(data))
    assert head.num_layers == 1 and head.fmt is MemoryFormat.BINARY and head.shape == (10_000,)
    # 300 layers: the header outgrows HEADER_PROBE; header_size says how much to read.
    big = _obj((300, 1, 64), torch.uint8)
    data = _file(key, big)
    need = cf.header_size(data[:8])
    assert need > cf.HEADER_PROBE and need % cf.ALIGN == 0
    with pytest.raises(ChunkFormatError):
        cf.decode_header(data[: cf.HEADER_PROBE], len(data))
    head = cf.decode_header(data[:need], len(data))
    assert head.num_layers == 300 and cf.verify_layer(head, 299, data[head.data_offsets[299]:][:64])


def test_truncated_at_every_interesting_offset():
    data = _file(_key(), _obj((3, 4, 1000), torch.bfloat16))
    head = cf.decode_header(data, len(data))
    cuts = {0, 1, 7, 8, 9, 100, head.header_bytes - 1, head.header_bytes, len(data) - 1}
    for off in head.data_offsets:
        cuts |= {off - 1, off, off + 1, off + head.layer_nbytes - 1, off + head.layer_nbytes}
    cuts = sorted(c for c in cuts if 0 <= c < len(data))
    for cut in cuts:
        with pytest.raises(ChunkFormatError):
            cf.decode_header(data[: min(cut, cf.HEADER_PROBE)], cut)
    cf.decode_header(data, len(data))  # negative control: the whole file is fine
    with pytest.raises(ChunkFormatError):
        cf.decode_header(data, len(data) + cf.ALIGN)  # trailing junk is wrong too


def test_every_flipped_header_byte_is_detected():
    data = _file(_key(), _obj((3, 4, 1000), torch.bfloat16))
    head = cf.decode_header(data, len(data))
    for pos in range(head.header_bytes):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(ChunkFormatError):
            cf.decode_header(bytes(bad), len(bad))


def test_flipped_byte_in_each_layer_fails_its_checksum():
    data = _file(_key(), _obj((4, 2, 3000), torch.uint8, seed=5))
    head = cf.decode_header(data, len(data))
    for i, off in enumerate(head.data_offsets):
        for pos in (0, head.layer_nbytes // 2, head.layer_nbytes - 1):
            layer = bytearray(data[off : off + head.layer_nbytes])
            assert cf.verify_layer(head, i, layer)
            layer[pos] ^= 0x80
            assert not cf.verify_layer(head, i, layer)
            assert not cf.verify_layers(head, 0, bytes(layer) * head.num_layers)
        assert not cf.verify_layer(head, i, data[off : off + head.layer_nbytes - 1])  # short


def test_wrong_format_version_and_foreign_files(monkeypatch):
    key, obj = _key(), _obj((2, 2, 4096), torch.uint8)
    monkeypatch.setattr(cf.format, "FORMAT_VERSION", "999")
    future = _file(key, obj)
    monkeypatch.undo()
    with pytest.raises(ChunkFormatError, match="version"):
        cf.decode_header(future, len(future))
    # A plain safetensors file (not ours) and garbage are rejected, never unpickled.
    from safetensors.torch import save

    plain = save({"x": torch.zeros(4)}, metadata={"format_version": "1"})
    for blob in (plain, b"", b"\x00" * 8, struct.pack("<Q", 2**40) + b"{}", os.urandom(8192)):
        with pytest.raises(ChunkFormatError):
            cf.decode_header(blob, len(blob))


def test_read_buffers_place_layers_contiguously():
    key, obj = _key(), _obj((4, 2, 3000), torch.uint8, seed=9)
    data = _file(key, obj)
    head = cf.decode_header(data, len(data))
    dest = bytearray(2 * head.layer_nbytes)
    scratch = memoryview(bytearray(cf.ALIGN))
    offset, bufs = cf.read_buffers(head, dest, 1, 2, scratch)
    assert offset == head.data_offsets[1]
    pos = offset
    for b in bufs:
        b[:] = data[pos : pos + len(b)]
        pos += len(b)
    assert bytes(dest) == obj.byte_view[head.layer_nbytes : 3 * head.layer_nbytes].numpy().tobytes()
    assert cf.verify_layers(head, 1, dest)
    with pytest.raises(ChunkFormatError):
        cf.read_buffers(head, dest, 3, 2, scratch)


@pytest.mark.parametrize(
    "model", ["../../etc/passwd", "/abs/path", "a/../../b", "x\x00y", "..", "名前/モデル", "a" * 500]
)
def test_chunk_path_cannot_escape_root(model, tmp_path):
    key = CacheKey(model, "float16", "L-bs16", 1, 0, b"\xab\xcd" + os.urandom(30))
    path = cf.chunk_path(tmp_path, key)
    assert path.parent.parent == tmp_path and path.parent.name == "ab"
    assert len(path.name) < 255 and set(path.name) <= set(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
    assert not path.name.startswith(".")
    assert cf.relative_chunk_path(key) == f"ab/{path.name}"
    # Different keys never share a file name.
    other = CacheKey(model + "x", "float16", "L-bs16", 1, 0, key.chunk_hash)
    assert cf.chunk_path(tmp_path, other) != path


def test_writer_header_equals_parsed_header():
    key, obj = _key(), _obj((3, 4, 1000), torch.bfloat16)
    header, bufs, made = cf.encode_chunk_with_header(key, obj)
    size = len(header) + sum(len(b) for b in bufs)
    assert made == cf.decode_header(header, size)


def _rehash(body: bytes) -> bytes:
    """A header made of JSON ``body``, padded and with its header checksum recomputed as a writer
    would (so only the check of the content itself can reject it)."""
    total = cf.align_up(8 + len(body))
    raw = bytearray(struct.pack("<Q", total - 8) + body + b" " * (total - 8 - len(body)))
    at = raw.index(b'"header_xxh3":"') + len("header_xxh3") + 4
    raw[at : at + 16] = b"0" * 16
    raw[at : at + 16] = cf.checksum(raw).encode()
    return bytes(raw)


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_header_bytes_are_the_whole_document_dumped_at_once(shape, dtype):
    """Headers are built from a cached tensor table; they must stay byte for byte what dumping
    the whole document at once gives (files written before that change read the same)."""
    key, obj = _key(), _obj(shape, dtype)
    header, _, made = cf.encode_chunk_with_header(key, obj)
    body = header[8:].rstrip(b" ")
    doc = json.loads(body)
    assert list(doc)[0] == "__metadata__" and len(doc) > made.num_layers
    assert json.dumps(doc, separators=(",", ":")).encode() == body
    assert _rehash(body) == header  # the helper below rebuilds a writer's header exactly


def _metadata_dumped(key, meta, sums) -> str:
    """A plain chunk's metadata dumped as a whole (what the template must give)."""
    doc = cf.format._readable_metadata(key, meta, sums, None, "header_xxh3", "0" * 16)
    return json.dumps(doc, separators=(",", ":"))


def test_metadata_from_its_template_is_the_whole_dump_for_every_key_field():
    """A plain chunk's metadata comes from a template per configuration and layout with only the
    hash and the checksums filled in; it must be byte for byte the whole document dumped, one
    encode after another with the template cache warm, for keys and metas that differ from the
    one before in any single field (a template reused across them shows), model names and
    codecs JSON must escape (quotes, backslashes, control characters, the stand-ins themselves,
    non-ASCII), and checksums a file could hold that are not plain hex (the dumped path then)."""
    base = CacheKey("org/model-7b", "bfloat16", "LBHNC-bs16", 2, 1, bytes(range(32)))
    keys = [base]
    changes = ({"model": 'we"ird\\name'}, {"model": "\x01"}, {"model": "a\x02\x01b"},
               {"model": "mod\u00e8le-\u4e2d"}, {"kv_dtype": "float16"},
               {"kv_layout": "LBHNC-bs32"}, {"world_size": 4}, {"rank": 0},
               {"model_digest": "abcd1234"}, {"pp_size": 2, "pp_rank": 1},
               {"layers": "0-14"}, {"tenant": "0123456789abcdef"},
               {"chunk_hash": b"\xff" * 8})
    # every field of a key is varied: one a template ignored would give another key's text
    assert {name for change in changes for name in change} == {
        f.name for f in dataclasses.fields(CacheKey)}
    keys += [dataclasses.replace(base, **change) for change in changes]
    shape = (3, 4, 1000)
    metas = [MemoryObjMeta(shape, torch.bfloat16, MemoryFormat.KV_PAGES, 48),
             MemoryObjMeta(shape, torch.bfloat16, MemoryFormat.KV_PAGES, 47),
             MemoryObjMeta((3, 4, 500), torch.float32, MemoryFormat.KV_PAGES, 48),
             MemoryObjMeta(shape, torch.bfloat16, MemoryFormat.ENCODED, 48,
                           json.dumps({"name": 'z"std\x01'})),
             MemoryObjMeta(shape, torch.bfloat16, MemoryFormat.ENCODED, 48,
                           json.dumps({"name": "lz4"}))]
    hexes = [f"{i:016x}" for i in range(3)]
    odd = [[*hexes[:2], 'q"'], [*hexes[:2], "b\\s"], [*hexes[:2], "\u00e9"],
           [*hexes[:2], "\x02"], [*hexes[:2], "\x7f"]]
    for meta in metas:
        for sums in [hexes, *odd, [f"{i + 7:016x}" for i in range(3)]]:
            for key in keys:
                assert cf.format._plain_metadata_json(key, meta, sums) == \
                    _metadata_dumped(key, meta, sums), (key, meta, sums)
    header = cf.encode_header(base, metas[0], hexes)
    assert json.loads(header[8:])["__metadata__"] == json.loads(
        _metadata_dumped(base, metas[0], hexes)) | {"header_xxh3": json.loads(
            header[8:])["__metadata__"]["header_xxh3"]}


def test_consistent_checksum_but_wrong_table_or_order_is_rejected():
    """With a valid header checksum, a tensor table that disagrees with the metadata, a document
    whose metadata is not first, or junk after the table is still rejected: only the metadata is
    parsed, the rest is compared with the canonical encoding."""
    key, obj = _key(), _obj((3, 4, 1000), torch.bfloat16)
    header, bufs, made = cf.encode_chunk_with_header(key, obj)
    size = len(header) + sum(len(b) for b in bufs)
    body = header[8:].rstrip(b" ")
    assert cf.decode_header(_rehash(body), size) == made  # negative control
    doc = json.loads(body)
    doc["layer.1"]["data_offsets"][0] += 1
    table = json.dumps(doc, separators=(",", ":")).encode()
    reordered = json.loads(body)
    reordered = {k: reordered[k] for k in [*list(reordered)[1:], "__metadata__"]}
    moved = json.dumps(reordered, separators=(",", ":")).encode()
    for bad in (table, moved, body[:-1] + b',"x":{}}', body + b"{}"):
        with pytest.raises(ChunkFormatError):
            cf.decode_header(_rehash(bad), size)


def test_verify_layers_checks_every_layer_and_the_range():
    """Each layer of a run is checked against its own checksum (a flipped byte in any one layer,
    the last included, fails the run), at any first layer; a run that reaches past the chunk's
    layers, starts before it, or is not whole layers is refused."""
    key, obj = _key(), _obj((6, 2, 1500), torch.uint8, seed=11)
    data = _file(key, obj)
    head = cf.decode_header(data, len(data))
    n = head.layer_nbytes
    layers = obj.byte_view.numpy().tobytes()
    assert cf.verify_layers(head, 0, layers)
    assert cf.verify_layers(head, 2, layers[2 * n : 5 * n])
    for i in range(head.num_layers):
        bad = bytearray(layers)
        bad[i * n + 7] ^= 1
        assert not cf.verify_layers(head, 0, bad), f"layer {i}'s flipped byte passed"
    assert not cf.verify_layers(head, 4, layers[4 * n : 7 * n] + layers[:n])  # past the last
    assert not cf.verify_layers(head, -1, layers[:n])
    assert not cf.verify_layers(head, 0, layers[: n + 1])
    assert not cf.verify_layers(head, 1, layers[:n])  # layer 0's bytes as layer 1
