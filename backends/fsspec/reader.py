"""Loads of the fsspec tier: whole chunks and layer ranges, verified, and the lookups' caches.

Every layer's checksum is checked against the chunk header before a byte reaches a memory
object; a bad object is counted, logged once and treated as a miss (whole-file damage deletes
it so the next store rewrites it). Memory comes from ``ctx.allocate`` (L1's pool), so promotion
into L1 costs no second copy. Headers are read once per object and cached, so a layer-wise load
costs one ranged read per layer range.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError, ChunkVersionError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj, MemoryObjMeta

from ..common.index import TTLSet
from .io import TierParts

logger = logging.getLogger("kvplug.backends.fsspec")
_HEADER_CACHE = 4096  # parsed headers kept (a few KiB each)
#: How long an object of another format version is known to be one (lookups miss it meanwhile).
OTHER_VERSION_TTL_S = 60.0

#: ``ctx.allocate``: ``(shape, dtype, fmt, num_tokens) -> MemoryObj | None``.
Allocate = Callable[..., MemoryObj | None]


class _Unavailable(Exception):
    """A ranged read of a header found the object missing or the store unavailable."""


class ChunkReader:
    """Reads and verifies chunk objects. Owns the header cache, the negative lookup cache and the
    read counters (``corrupt``, ``negative_hits``). ``lost(path, delete)`` tells the tier an
    object is corrupt (and should be deleted when the whole file is damaged)."""

    def __init__(self, tier: TierParts, allocate: Allocate, lost: Callable[[str, bool], None],
                 negative_cache_s: float) -> None:
        self._tier = tier
        self._allocate = allocate
        self._lost = lost
        self._lock = threading.Lock()
        self._headers: OrderedDict[str, cf.ChunkHeader] = OrderedDict()
        self._absent = TTLSet(negative_cache_s)
        self._other = TTLSet(OTHER_VERSION_TTL_S)  # objects of another format version
        self._counts = dict.fromkeys(("corrupt", "negative_hits", "other_version"), 0)

    # -- lookups --------------------------------------------------------------------------------
    def resolve(self, paths: Sequence[str], found: Sequence[bool | None]) -> list[bool]:
        """Answer the lookups still ``None`` in ``found``: from the negative cache, then with one
        concurrent batch of remote size calls (a store that fails answers "missing")."""
        answer = list(found)
        with self._lock:
            for i, path in enumerate(paths):
                if answer[i] is None and (path in self._absent or path in self._other):
                    answer[i] = False
                    self._counts["negative_hits"] += 1
        todo = [i for i, f in enumerate(answer) if f is None]
        if todo:
            sizes = self._tier.remote.sizes([paths[i] for i in todo])
            with self._lock:
                for i, size in zip(todo, sizes):
                    if size is None:
                        self._absent.add(paths[i])
            for i, size in zip(todo, sizes):
                answer[i] = size is not None and size >= 0
                if answer[i]:
                    self._tier.index.learn(paths[i], size)
        return [bool(f) for f in answer]

    def forget(self, path: str) -> None:
        """The object was written or deleted: drop its cached header and negative entry."""
        with self._lock:
            self._headers.pop(path, None)
            self._absent.discard(path)
            self._other.discard(path)

    def other_version(self, path: str) -> bool:
        """Whether ``path`` was recently found to be another format version's object (left
        alone: neither read, nor overwritten, nor deleted by this version)."""
        with self._lock:
            return path in self._other

    # -- loads ----------------------------------------------------------------------------------
    def get(self, path: str, key: CacheKey) -> MemoryObj | None:
        """The whole chunk of ``key`` stored at ``path``, verified; ``None`` on any miss. The
        header comes first (a ranged read, with the object's size alongside), so an object whose
        size is not what its header describes is a miss before any of its body is downloaded."""
        head = self._tier.remote.head(path, cf.HEADER_PROBE)
        if head is None:
            return None
        prefix, size = head
        header = self._parse(path, self._reader(path, prefix), size)
        if header is None:
            return None
        if header.key != key:
            self._corrupt(path, "the file holds another key", delete=True)
            return None
        body = b""
        if header.file_size > header.header_bytes:
            body = self._tier.remote.fetch(path, header.header_bytes, header.file_size)
            if body is None or len(body) != header.file_size - header.header_bytes:
                return None  # gone or replaced since the header was read: a plain miss
        view = memoryview(body)
        offsets = self._verified(path, header, view, 0, header.num_layers,
                                 base=header.header_bytes, delete=True)
        if offsets is None:
            return None
        self._remember(path, header, size)
        return self._copy(header.meta, view, offsets, header.layer_nbytes)

    def get_layers(self, path: str, first_layer: int, num_layers: int) -> MemoryObj | None:
        """Layers ``[first_layer, first_layer + num_layers)`` with one ranged read."""
        header = self._header(path)
        if header is None:
            return None
        try:
            meta = header.layers_meta(first_layer, num_layers)
        except ChunkFormatError:
            return None
        start = header.data_offsets[first_layer]
        end = header.data_offsets[first_layer + num_layers - 1] + header.layer_nbytes
        data = self._tier.remote.fetch(path, start, end)
        if data is None:
            return None
        view = memoryview(data)
        offsets = self._verified(path, header, view, first_layer, num_layers, base=start,
                                 delete=False)
        return None if offsets is None else self._copy(meta, view, offsets, header.layer_nbytes)

    def _header(self, path: str) -> cf.ChunkHeader | None:
        """The header of ``path``: cached, or read with ranged reads (usually one)."""
        with self._lock:
            cached = self._headers.get(path)
        if cached is not None:
            return cached

        header = self._parse(path, self._reader(path, b""), None)
        if header is not None:
            self._remember(path, header, header.file_size)
        return header

    def _reader(self, path: str, prefix: bytes) -> cf.ReadAt:
        """``read(offset, length)`` of ``path``: from ``prefix`` (its first bytes) when they
        cover the range, else with a ranged read (raises ``_Unavailable`` when that fails)."""

        def read(offset: int, length: int) -> bytes:
            if offset + length <= len(prefix):
                return prefix[offset : offset + length]
            data = self._tier.remote.fetch(path, offset, offset + length)
            if data is None:
                raise _Unavailable
            return data

        return read

    def _parse(self, path: str, read: cf.ReadAt, size: int | None) -> cf.ChunkHeader | None:
        """The checked header through ``read``; ``None`` when unavailable or corrupt."""
        try:
            return cf.read_header(read, size)[0]
        except _Unavailable:
            return None
        except ChunkVersionError as exc:  # a node of another version wrote it: not ours to judge
            with self._lock:
                self._counts["other_version"] += 1
                self._other.add(path)
                self._headers.pop(path, None)
            self._tier.log_once(
                "other_version", "tier %r: chunk %s is of another format version (%s); treated "
                "as a miss and left in place", self._tier.name, path.rsplit("/", 1)[-1], exc)
            return None
        except ChunkFormatError as exc:
            self._corrupt(path, str(exc), delete=True)
            return None

    def _verified(self, path: str, header: cf.ChunkHeader, view: memoryview, first: int,
                  count: int, base: int, delete: bool) -> list[int] | None:
        """Offsets in ``view`` (which starts at file offset ``base``) of layers ``first`` ..
        ``first + count - 1`` when each matches its checksum; ``None`` (corrupt) otherwise."""
        n = header.layer_nbytes
        offsets = [off - base for off in header.data_offsets[first : first + count]]
        for i, off in enumerate(offsets):
            if not cf.verify_layer(header, first + i, view[off : off + n]):
                self._corrupt(path, f"layer {first + i} checksum mismatch", delete=delete)
                return None
        return offsets

    def _copy(self, meta: MemoryObjMeta, view: memoryview, offsets: Sequence[int],
              n: int) -> MemoryObj | None:
        """A fresh memory object (``None`` when memory is full) holding the layers at ``offsets``."""
        obj = self._allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:
            return None
        dest = obj.byte_view.numpy()
        src = np.frombuffer(view, dtype=np.uint8)
        if n and all(b - a == n for a, b in zip(offsets, offsets[1:])):
            dest[:] = src[offsets[0] : offsets[0] + n * len(offsets)]
        else:
            for i, off in enumerate(offsets):
                dest[i * n : (i + 1) * n] = src[off : off + n]
        return obj

    def _remember(self, path: str, header: cf.ChunkHeader, size: int) -> None:
        with self._lock:
            self._headers[path] = header
            self._headers.move_to_end(path)
            if len(self._headers) > _HEADER_CACHE:
                self._headers.popitem(last=False)
        self._tier.index.learn(path, size, touch=True)

    def _corrupt(self, path: str, why: str, delete: bool) -> None:
        with self._lock:
            self._counts["corrupt"] += 1
            self._headers.pop(path, None)
        self._tier.log_once(
            "corrupt", "tier %r: corrupt chunk %s (%s) treated as a miss — further ones are "
            "counted in stats, not logged", self._tier.name, path.rsplit("/", 1)[-1], why,
        )
        self._lost(path, delete)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}
