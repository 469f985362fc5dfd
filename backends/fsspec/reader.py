"""Loads of the fsspec tier: whole chunks and layer ranges, verified, and the lookups' caches.

Every layer's checksum is checked against the chunk header before a byte reaches a memory
object; a bad object is counted, logged once and treated as a miss (whole-file damage deletes
it so the next store rewrites it). Memory comes from ``ctx.allocate`` (L1's pool), so promotion
into L1 costs no second copy. Headers are read once per object and cached, so a layer-wise load
costs one ranged read per layer range, and a whole chunk read again one request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError, ChunkVersionError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

from ..common.chunks import Allocate, HeaderCache, copy_verified, layer_range
from ..common.index import TTLSet
from .io import TierParts

logger = logging.getLogger("kvplug.backends.fsspec")
#: How long an object of another format version is known to be one (lookups miss it meanwhile).
OTHER_VERSION_TTL_S = 60.0



#: :meth:`ChunkReader._get_known`'s answer for an object whose size changed.
_RESIZED = object()


class _Unavailable(Exception):
    """A ranged read of a header found the object missing or the store unavailable."""


class ChunkReader:
    """Reads and verifies chunk objects. Owns the header cache, the negative lookup cache and the
    read counters (``corrupt``, ``negative_hits``). ``lost(path, delete)`` tells the tier an
    object is corrupt (and should be deleted when the whole file is damaged)."""

    def __init__(self, tier: TierParts, allocate: Allocate, lost: Callable[[str, bool], None],
                 negative_cache_s: float, auth: cf.Keyring | None = None) -> None:
        self._tier = tier
        self._auth = auth  # the tier's keyring (auth_key_env): headers must be authenticated
        self._allocate = allocate
        self._lost = lost
        self._lock = threading.Lock()
        self._headers = HeaderCache()
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
        self._headers.pop(path)
        with self._lock:
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
        size is not what its header describes is a miss before any of its body is downloaded.
        A chunk whose header was read before is read in one request (:meth:`_get_known`)."""
        known = self._headers.get(path)
        if known is not None:
            got = self._get_known(path, key, known.file_size)
            if got is not _RESIZED:
                return got  # type: ignore[return-value]
        head = self._tier.remote.head(path, cf.HEADER_PROBE)
        if head is None:
            return None
        prefix, size = head
        header = self._parse(path, self._reader(path, prefix), size)
        if header is None:
            return None
        obj = self._object_for(path, key, header)
        if obj is None:
            return None  # another key, no memory, or sizes this engine refuses: nothing fetched
        body = b""
        if header.file_size > header.header_bytes:
            body = self._tier.remote.fetch(path, header.header_bytes, header.file_size)
            if body is None or len(body) != header.file_size - header.header_bytes:
                obj.ref_down()
                return None  # gone or replaced since the header was read: a plain miss
        self._remember(path, header, size)  # forgotten again if a layer turns out corrupt
        return self._fill(path, header, obj, memoryview(body), 0, header.num_layers,
                          base=header.header_bytes, delete=True)

    def _get_known(self, path: str, key: CacheKey, size: int) -> MemoryObj | None | object:
        """The chunk at ``path``, last seen ``size`` bytes long, with one ranged read of
        ``size + 1`` bytes (a longer object shows without being downloaded); the bytes are
        parsed and verified as in :meth:`get`. :data:`_RESIZED` when the object is now of
        another size (the caller reads its header first, as for an unknown object)."""
        data = self._tier.remote.fetch(path, 0, size + 1)
        if data is None:
            return None
        if len(data) != size:
            return _RESIZED
        header = self._parse(path, self._reader(path, data), size)
        if header is None:
            return None
        obj = self._object_for(path, key, header)
        if obj is None:
            return None
        self._remember(path, header, size)
        return self._fill(path, header, obj, memoryview(data), 0, header.num_layers, base=0,
                          delete=True)

    def _object_for(self, path: str, key: CacheKey, header: cf.ChunkHeader) -> MemoryObj | None:
        """The memory object ``header``'s chunk is read into, once the header is shown to be
        ``key``'s (else the file is corrupt: counted and deleted); None for another key, no
        memory, or sizes this engine refuses (checked by the allocator before allocating)."""
        if header.key != cf.stored_key(key, self._auth):
            self._corrupt(path, "the file holds another key", delete=True)
            return None
        meta = header.meta
        return self._allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)

    def get_layers(self, path: str, first_layer: int, num_layers: int) -> MemoryObj | None:
        """Layers ``[first_layer, first_layer + num_layers)`` with one ranged read."""
        header = self._header(path)
        if header is None:
            return None
        try:
            meta, start, end = layer_range(header, first_layer, num_layers)
        except ChunkFormatError:
            return None
        obj = self._allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:
            return None  # no memory, or sizes this engine refuses: nothing fetched
        data = self._tier.remote.fetch(path, start, end)
        if data is None or len(data) != end - start:
            obj.ref_down()
            return None
        return self._fill(path, header, obj, memoryview(data), first_layer, num_layers,
                          base=start, delete=False)

    def _header(self, path: str) -> cf.ChunkHeader | None:
        """The header of ``path``: cached, or read with ranged reads (usually one)."""
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
            return cf.read_header(read, size, self._auth)[0]
        except _Unavailable:
            return None
        except ChunkVersionError as exc:  # a node of another version wrote it: not ours to judge
            with self._lock:
                self._counts["other_version"] += 1
                self._other.add(path)
            self._headers.pop(path)
            self._tier.log_once(
                "other_version", "tier %r: chunk %s is of another format version (%s); treated "
                "as a miss and left in place", self._tier.name, path.rsplit("/", 1)[-1], exc)
            return None
        except ChunkFormatError as exc:
            self._corrupt(path, str(exc), delete=True)
            return None

    def _fill(self, path: str, header: cf.ChunkHeader, obj: MemoryObj, view: memoryview,
              first: int, count: int, base: int, delete: bool) -> MemoryObj | None:
        """:func:`~kvplug.backends.common.chunks.copy_verified` into ``obj`` (allocated before
        the fetch; consumed); a mismatch is a corrupt object (deleted when ``delete``: the whole
        file was read)."""
        try:
            return copy_verified(lambda *_: obj, header, obj.meta, view, first, count, base)
        except ChunkFormatError as exc:
            self._corrupt(path, str(exc), delete=delete)
            return None
        except BaseException:
            if not obj.is_freed:
                obj.ref_down()
            raise

    def _remember(self, path: str, header: cf.ChunkHeader, size: int) -> None:
        self._headers.put(path, header)
        self._tier.index.learn(path, size, touch=True)

    def _corrupt(self, path: str, why: str, delete: bool) -> None:
        with self._lock:
            self._counts["corrupt"] += 1
        self._headers.pop(path)
        self._tier.log_once(
            "corrupt", "tier %r: corrupt chunk %s (%s) treated as a miss — further ones are "
            "counted in stats, not logged", self._tier.name, path.rsplit("/", 1)[-1], why,
        )
        self._lost(path, delete)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}
