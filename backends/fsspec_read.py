"""Loads of the fsspec tier: whole chunks, layer ranges and concurrent batches, verified.

Every layer's checksum is checked against the chunk header before a byte reaches a memory
object; a bad object is counted, logged once and treated as a miss (whole-file damage deletes
it so the next store rewrites it). Memory comes from ``ctx.allocate`` (L1's pool), so promotion
into L1 costs no second copy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from kvplug import chunk_format as cf
from kvplug.errors import ChunkFormatError
from kvplug.hookspecs import hookimpl
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

from .fsspec_breaker import CircuitBreaker
from .fsspec_index import CapacityIndex, TTLSet
from .fsspec_io import Redactor, RemoteIO

_HEADER_CACHE = 4096


class ReadMixin:
    """The read half of :class:`~kvplug.backends.fsspec_remote.FsspecBackend`."""

    name: str
    opts: Any
    io: RemoteIO
    breaker: CircuitBreaker
    redact: Redactor
    _lock: threading.Lock
    _counts: dict[str, int]
    _written: TTLSet
    _absent: TTLSet
    _index: CapacityIndex | None
    _headers: OrderedDict[str, cf.ChunkHeader]
    _pins: dict[str, int]
    _allocate: Callable[..., MemoryObj | None]

    if TYPE_CHECKING:  # provided by FsspecBackend / the other mixin
        def _count(self, what: str, n: int = 1) -> None: ...
        def _once(self, what: str, msg: str, *args: Any) -> None: ...
        def _remote_failed(self, exc: BaseException) -> None: ...
        def path_of(self, key: CacheKey) -> str: ...
        def _delete(self, paths: Sequence[str]) -> None: ...

    def _fetch(self, path: str, start: int | None = None, end: int | None = None) -> bytes | None:
        """Bytes of an object (range), ``None`` when missing or the store is unavailable."""
        if not self.breaker.allow():
            return None
        try:
            data = self.io.run(lambda: self.io.cat(path, start, end))
        except FileNotFoundError:
            self.breaker.success()
            return None
        except Exception as exc:  # noqa: BLE001
            self._remote_failed(exc)
            return None
        self.breaker.success()
        return data

    def _corrupt(self, path: str, why: str, delete: bool) -> None:
        self._count("corrupt")
        with self._lock:
            self._headers.pop(path, None)
            self._written.discard(path)
            if self._index is not None:
                self._index.pop(path)
        self._once("corrupt", "tier %r: corrupt chunk %s (%s) treated as a miss", self.name,
                    path.rsplit("/", 1)[-1], why)
        if delete:
            self._delete([path])

    def _decode(self, path: str, key: CacheKey, data: bytes) -> MemoryObj | None:
        """Check a whole chunk file and copy it into a fresh memory object (or miss)."""
        try:
            header = cf.decode_header(data, file_size=len(data))
            if header.key != key:
                raise ChunkFormatError("the file holds another key")
        except ChunkFormatError as exc:
            self._corrupt(path, str(exc), delete=True)
            return None
        view = memoryview(data)
        n = header.layer_nbytes
        for i, off in enumerate(header.data_offsets):
            if not cf.verify_layer(header, i, view[off : off + n]):
                self._corrupt(path, f"layer {i} checksum mismatch", delete=True)
                return None
        self._remember(path, header, len(data))
        obj = self._allocate(header.shape, header.dtype, header.fmt, header.num_tokens)
        if obj is None:
            return None
        self._copy_layers(obj, view, header.data_offsets, n)
        return obj

    @staticmethod
    def _copy_layers(obj: MemoryObj, view: memoryview, offsets: Sequence[int], n: int) -> None:
        dest = obj.byte_view.numpy()
        src = np.frombuffer(view, dtype=np.uint8)
        if n and all(b - a == n for a, b in zip(offsets, offsets[1:])):
            dest[:] = src[offsets[0] : offsets[0] + n * len(offsets)]
            return
        for i, off in enumerate(offsets):
            dest[i * n : (i + 1) * n] = src[off : off + n]

    def _remember(self, path: str, header: cf.ChunkHeader, size: int) -> None:
        with self._lock:
            self._headers[path] = header
            self._headers.move_to_end(path)
            if len(self._headers) > _HEADER_CACHE:
                self._headers.popitem(last=False)
            if self._index is not None:
                if path not in self._index.sizes:
                    self._index.add(path, size)
                self._index.touch(path)

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        path = self.path_of(key)
        data = self._fetch(path)
        return None if data is None else self._decode(path, key, data)

    def get_many(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """Several whole chunks fetched concurrently (one bounded batch of remote reads)."""
        paths = [self.path_of(k) for k in keys]
        if not paths or not self.breaker.allow():
            return [None] * len(paths)
        try:
            results = self.io.run_many([lambda p=p: self.io.cat(p) for p in paths])
        except Exception as exc:  # noqa: BLE001
            self._remote_failed(exc)
            return [None] * len(paths)
        out: list[MemoryObj | None] = []
        failure: BaseException | None = None
        for path, key, res in zip(paths, keys, results):
            if isinstance(res, FileNotFoundError):
                out.append(None)
            elif isinstance(res, BaseException):
                failure = failure or res
                out.append(None)
            else:
                out.append(self._decode(path, key, res))
        if failure is None:
            self.breaker.success()
        else:
            self._remote_failed(failure)
        return out

    def _header(self, path: str) -> cf.ChunkHeader | None:
        with self._lock:
            cached = self._headers.get(path)
        if cached is not None:
            return cached
        probe = self._fetch(path, 0, cf.HEADER_PROBE)
        if probe is None:
            return None
        try:
            need = cf.header_size(probe)
            if need > len(probe):
                more = self._fetch(path, len(probe), need)
                if more is None:
                    return None
                probe += more
            header = cf.decode_header(probe)
        except ChunkFormatError as exc:
            self._corrupt(path, str(exc), delete=True)
            return None
        self._remember(path, header, header.file_size)
        return header

    @hookimpl
    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int) -> MemoryObj | None:
        path = self.path_of(key)
        header = self._header(path)
        if header is None:
            return None
        try:
            meta = header.layers_meta(first_layer, num_layers)
        except ChunkFormatError:
            return None
        start = header.data_offsets[first_layer]
        last = first_layer + num_layers - 1
        data = self._fetch(path, start, header.data_offsets[last] + header.layer_nbytes)
        if data is None:
            return None
        view = memoryview(data)
        offsets = [off - start for off in header.data_offsets[first_layer : last + 1]]
        n = header.layer_nbytes
        if len(view) != offsets[-1] + n or not all(
            cf.verify_layer(header, first_layer + i, view[o : o + n])
            for i, o in enumerate(offsets)
        ):
            self._corrupt(path, "layer range checksum mismatch", delete=False)
            return None
        obj = self._allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is not None:
            self._copy_layers(obj, view, offsets, n)
        return obj
