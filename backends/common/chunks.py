"""What every remote tier does with a chunk it read (resp, mooncake, fsspec): the parsed-header
cache, the byte range of a layer range, the verified copy into a fresh memory object, and the
:class:`Layout` by which a store that reads in pieces reads straight into one."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError
from kvplug.memory import MemoryObj, MemoryObjMeta

#: ``ctx.allocate``: ``(shape, dtype, fmt, num_tokens) -> MemoryObj | None``.
Allocate = Callable[..., MemoryObj | None]
HEADER_CACHE = 4096  # parsed headers kept (a few KiB each)


class HeaderCache:
    """Parsed chunk headers by name, least recently used dropped first (thread-safe); with the
    raw header bytes they were parsed from, where known (:meth:`known`: bytes read again that
    equal them need no second parse, which is a pure function of them)."""

    def __init__(self, size: int = HEADER_CACHE) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._headers: OrderedDict[str, tuple[cf.ChunkHeader, bytes | None]] = OrderedDict()

    def get(self, name: str) -> cf.ChunkHeader | None:
        with self._lock:
            entry = self._headers.get(name)
        return None if entry is None else entry[0]

    def known(self, name: str) -> tuple[cf.ChunkHeader, bytes] | None:
        """``(header, the raw bytes it was parsed from)``, or None."""
        with self._lock:
            entry = self._headers.get(name)
        return None if entry is None or entry[1] is None else (entry[0], entry[1])

    def put(self, name: str, header: cf.ChunkHeader, raw: bytes | None = None) -> None:
        with self._lock:
            old = self._headers.get(name)
            if raw is None and old is not None and old[0] is header:
                raw = old[1]  # the same parse: keep its bytes
            self._headers[name] = (header, raw)
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


@dataclass(frozen=True)
class Layout:
    """Where a chunk's bytes lie in its value, as the tier's last chunk had them: a store that
    reads a value in pieces (Mooncake) reads the next chunks straight into memory objects by it
    (the header to scratch memory, each layer into the object, padding to scratch), then checks
    that the header read says the same."""

    header_bytes: int
    meta: MemoryObjMeta
    num_layers: int
    layer_nbytes: int
    stride: int
    size: int  # the whole value

    @classmethod
    def of(cls, header: cf.ChunkHeader) -> Layout:
        return cls(header.header_bytes, header.meta, header.num_layers, header.layer_nbytes,
                   header.layer_stride, header.file_size)

    def fits(self, header: cf.ChunkHeader) -> bool:
        """Whether ``header`` puts every byte where this layout does, for an object of the
        same shape (the token count may differ)."""
        m, h = self.meta, header.meta
        return (header.header_bytes, header.num_layers, header.layer_nbytes, header.file_size,
                h.shape, h.dtype, h.fmt, h.codec) == (
            self.header_bytes, self.num_layers, self.layer_nbytes, self.size,
            m.shape, m.dtype, m.fmt, m.codec)

    def pieces(self, dest: int, header: int, pad: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each piece of the value, in order: the header at ``header``,
        the layers back to back at ``dest``, padding at ``pad`` (``stride - layer_nbytes``
        bytes of junk, shared by every layer)."""
        n, gap = self.layer_nbytes, self.stride - self.layer_nbytes
        out = [(header, self.header_bytes)]
        if not gap:
            return [*out, (dest, n * self.num_layers)] if n else out
        for i in range(self.num_layers):
            out += [(dest + i * n, n), (pad, gap)]
        return out
