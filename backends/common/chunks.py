"""What every remote tier does with a chunk it read (resp, mooncake, fsspec): the parsed-header
cache, the byte range of a layer range, and the verified copy into a fresh memory object."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError
from kvplug.memory import MemoryObj, MemoryObjMeta

#: ``ctx.allocate``: ``(shape, dtype, fmt, num_tokens) -> MemoryObj | None``.
Allocate = Callable[..., MemoryObj | None]
HEADER_CACHE = 4096  # parsed headers kept (a few KiB each)


class HeaderCache:
    """Parsed chunk headers by name, least recently used dropped first (thread-safe)."""

    def __init__(self, size: int = HEADER_CACHE) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._headers: OrderedDict[str, cf.ChunkHeader] = OrderedDict()

    def get(self, name: str) -> cf.ChunkHeader | None:
        with self._lock:
            return self._headers.get(name)

    def put(self, name: str, header: cf.ChunkHeader) -> None:
        with self._lock:
            self._headers[name] = header
            self._headers.move_to_end(name)
            if len(self._headers) > self._size:
                self._headers.popitem(last=False)

    def pop(self, name: str) -> None:
        with self._lock:
            self._headers.pop(name, None)


def layer_range(header: cf.ChunkHeader, first: int, count: int) -> tuple[MemoryObjMeta, int, int]:
    """The meta of layers ``first .. first + count - 1`` and their byte range ``[start, end)`` in
    the chunk; ``ChunkFormatError`` when the range is outside the chunk."""
    meta = header.layers_meta(first, count)
    start = header.data_offsets[first]
    return meta, start, header.data_offsets[first + count - 1] + header.layer_nbytes


def copy_verified(allocate: Allocate, header: cf.ChunkHeader, meta: MemoryObjMeta,
                  view: memoryview, first: int, count: int, base: int) -> MemoryObj | None:
    """A fresh object holding layers ``first .. first + count - 1`` of ``view`` (which starts at
    chunk offset ``base``), each checked against its checksum after the copy (what is checked is
    what is returned); ``None`` when memory is full, ``ChunkFormatError`` on a mismatch."""
    obj = allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
    if obj is None:
        return None
    n = header.layer_nbytes
    offsets = [off - base for off in header.data_offsets[first : first + count]]
    dest = obj.byte_view.numpy()
    src = np.frombuffer(view, dtype=np.uint8)
    if n and all(b - a == n for a, b in zip(offsets, offsets[1:])):
        dest[:] = src[offsets[0] : offsets[0] + n * count]
    else:
        for i, off in enumerate(offsets):
            dest[i * n : (i + 1) * n] = src[off : off + n]
    if not cf.verify_layers(header, first, dest.data):
        obj.ref_down()
        raise ChunkFormatError(f"a checksum of layers {first}..{first + count - 1} mismatches")
    return obj
