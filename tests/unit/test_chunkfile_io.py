"""The chunk-file library's shared I/O rules: temp names, atomic writes, the generic header reader."""

from __future__ import annotations

import os

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, heap_memory_obj


def _chunk(layers: int = 3, seed: int = 0) -> tuple[CacheKey, bytes]:
    key = CacheKey("org/m", "bfloat16", "L-bs16", 1, 0, os.urandom(32))
    gen = torch.Generator().manual_seed(seed)
    obj = heap_memory_obj((layers, 2, 1000), torch.uint8, MemoryFormat.KV_PAGES, 32)
    obj.tensor.copy_(torch.randint(0, 256, obj.tensor.shape, dtype=torch.uint8, generator=gen))
    header, bufs = cf.encode_chunk(key, obj)
    return key, header + b"".join(bytes(b) for b in bufs)


def test_temp_names_are_recognised_and_never_chunks():
    key, _ = _chunk()
    final = cf.chunk_name(key)
    tmp = cf.temp_name(final)
    assert cf.is_temp(tmp) and not cf.is_chunk_file(tmp)
    assert cf.is_chunk_file(final) and not cf.is_temp(final)
    assert tmp != cf.temp_name(final), "two writers of one chunk must not share a temp name"
    # Negative control: other dot files and other suffixes are neither.
    for name in (".hidden", "notes.txt", final + ".bak"):
        assert not cf.is_temp(name) and not cf.is_chunk_file(name)


@pytest.mark.parametrize("fsync", [False, True])
def test_atomic_file_publishes_whole_files_only(tmp_path, fsync):
    target = tmp_path / "ab" / "chunk.safetensors"
    with cf.atomic_file(target, fsync=fsync) as tmp:
        assert tmp.parent == target.parent and cf.is_temp(tmp.name)
        tmp.write_bytes(b"partial")
        assert not target.exists(), "visible before the rename"
        with open(tmp, "ab") as f:
            f.write(b"+rest")
    assert target.read_bytes() == b"partial+rest"
    assert [p.name for p in target.parent.iterdir()] == ["chunk.safetensors"]


def test_atomic_file_failure_leaves_nothing(tmp_path):
    target = tmp_path / "x.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"):
        with cf.atomic_file(target) as tmp:
            tmp.write_bytes(b"half")
            raise OSError("disk full")
    assert target.read_bytes() == b"old", "a failed write must not replace the old file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


@pytest.mark.parametrize("layers", [1, 3, 90])  # 90 layers: the header outgrows HEADER_PROBE
def test_read_header_through_ranged_reads(layers):
    key, data = _chunk(layers)
    calls: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        calls.append((offset, length))
        return data[offset : offset + length]

    header, raw = cf.read_header(read, len(data))
    assert header.key == key and header.num_layers == layers
    assert raw == data[: header.header_bytes]
    assert all(off + n <= header.header_bytes for off, n in calls), "read past the header"
    assert (len(calls) > 1) == (header.header_bytes > cf.HEADER_PROBE)


def test_read_header_fd_matches_and_rejects_damage(tmp_path):
    key, data = _chunk()
    path = tmp_path / "c.safetensors"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert cf.read_header_fd(fd)[0].key == key
    finally:
        os.close(fd)
    for bad in (data[:-1], data[:100], b"", data[:8] + b"x" + data[9:]):
        path.write_bytes(bad)
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(ChunkFormatError):
                cf.read_header_fd(fd)
        finally:
            os.close(fd)
