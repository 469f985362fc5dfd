"""The one read and write path of every remote tier: resp (Valkey/Redis), mooncake (Mooncake
Store) and fsspec (object stores, any fsspec filesystem), shared by hosts.

Each chunk is one value in the shared chunk format (:mod:`kvplug.chunkfile`), named by the
backend (resp, mooncake: ``<prefix><key string>``; fsspec: a path under its URL); the key string
holds the model namespace, so models never collide. Stores are queued and sent in batches
(:class:`~.value_writer.ValueWriter`); ``contains`` asks for many keys in one batch, with a
short-lived negative cache; ``get`` reads a value in one call (``batched_get``: many values in
one batch) and verifies every layer's checksum before any byte is returned. Where the store reads
in pieces into registered memory (Mooncake: L1's pool) or into any memory (resp: a socket), the
layers go straight into the memory objects, laid out as the last chunk was, and the header read
must say so (:meth:`ValueStoreTier._read_into`); where reads are sized (fsspec), a value is read
with one ranged read of the size expected (its own header's, or the last chunk's), header first
where that is unknown. ``get_layers`` reads a layer range where the store reads ranges. A
corrupt value or one of another format version is judged by :mod:`.bad_entries`. Every call is
bounded by the store client's timeout and feeds the tier's circuit breaker
(:class:`~.value_io.ValueIO`). The store's own eviction, a restart that lost its data, or a value
refused because the store is full are all misses or dropped stores, never errors. Credentials
never reach a log line or ``stats``.

A backend subclasses :class:`ValueStoreTier`: its ``Options`` derive from
:class:`RemoteOptions` (:class:`ValueStoreOptions` for a key-value store) and
:meth:`ValueStoreTier.open_io` returns its :class:`~.value_io.ValueIO`.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvplug import chunkfile as cf
from kvplug.config import BaseOptions
from kvplug.errors import ChunkFormatError
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.logs import LogOnce
from kvplug.memory import MemoryFormat, MemoryObj, MemoryObjMeta
from pydantic import ByteSize, ConfigDict, Field, field_validator

from .bad_entries import BadEntries, Unavailable
from .breaker import CircuitBreaker
from .chunks import HeaderCache, Layout, copy_verified, layer_range
from .index import CapacityIndex, Pins, TTLSet
from .tenant_budget import TenantBudget
from .value_io import ValueIO
from .value_writer import MAX_PENDING_BYTES, MAX_PENDING_WRITES, TierParts, ValueWriter

logger = logging.getLogger("kvplug.backends.values")
_NAME_CACHE = 65536
#: Values of another layout in a row after which a smaller chunk's layout replaces the current.
LAYOUT_PATIENCE = 8


class RemoteOptions(BaseOptions):
    """Options every remote tier has (resp, mooncake, fsspec); a backend adds how to reach its
    store and may change a default."""

    model_config = ConfigDict(extra="forbid")
    capacity: ByteSize | None = Field(
        default=None, description="optional LRU bound on bytes this process stored, enforced by "
        "it; None = leave eviction to the store")
    timeout_s: float = Field(default=2.0, gt=0, description="hard bound on one call to the store")
    max_pending_writes: int = Field(default=MAX_PENDING_WRITES, ge=1,
                                    description="queued stores; more drop (counted)")
    max_pending_bytes: ByteSize = Field(default=ByteSize(MAX_PENDING_BYTES), gt=0,
                                        description="bytes of queued stores (L1 memory they "
                                        "hold); more drop (counted)")
    io_threads: int = Field(default=4, ge=1, description="writer threads")
    negative_cache_s: float = Field(default=0.5, ge=0, description="remember misses")
    breaker_threshold: int = Field(default=2, ge=1, description="failures that open it")
    breaker_backoff_s: float = Field(default=2.0, gt=0, description="first retry delay")
    breaker_max_backoff_s: float = Field(default=30.0, gt=0, description="longest delay")


class ValueStoreOptions(RemoteOptions):
    """Options every key-value store tier has (resp, mooncake)."""

    prefix: str = Field(default="kvplug:", description="prepended to every key name")
    batch_bytes: ByteSize = Field(default=ByteSize(16 << 20), gt=0,
                                  description="bytes of queued stores sent in one batch (each "
                                  "writer thread keeps an encoding buffer of about this size)")

    @field_validator("prefix")
    @classmethod
    def _prefix_safe(cls, v: str) -> str:
        if any(c.isspace() for c in v) or "{" in v or "}" in v:
            raise ValueError(f"prefix {v!r} may not hold spaces or braces (braces would pin every "
                             "key to one cluster slot); e.g. 'kvplug:'")
        return v


class ValueStoreTier(ABC):
    """The hooks of a remote tier; subclasses say how to reach the store (:meth:`open_io`) and
    may say how a key is named (:meth:`name_of`)."""

    Options: type[RemoteOptions] = ValueStoreOptions
    #: ``quotas`` are kept by counting what this process stores (:mod:`.tenant_budget`)
    budget_quotas = True
    #: Values in the chunk format through kvplug.chunkfile with ctx.auth: ciphertext under
    #: ``encrypt: true``.
    encrypts = True
    #: What log lines call the store (e.g. "Valkey/Redis store").
    kind = "key-value store"
    #: Whether the capacity index learns every value lookups and reads find (also those other
    #: hosts wrote: the bound is over everything under the prefix, and a value it knows is not
    #: stored again) rather than only what this process stored (fsspec).
    index_found = False

    @abstractmethod
    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        """The store's calls (behind ``breaker``) and the store's name for log lines (no
        credentials)."""

    def batch_bytes(self) -> int:
        """Bytes of queued stores the writer sends in one batch."""
        return int(self.opts.batch_bytes)  # type: ignore[attr-defined]

    def __init__(self, ctx: TierContext) -> None:
        opts = ctx.options
        self.name = ctx.name
        self.opts = opts
        self.breaker = CircuitBreaker(ctx.name, threshold=opts.breaker_threshold,
                                      backoff_s=opts.breaker_backoff_s,
                                      max_backoff_s=opts.breaker_max_backoff_s,
                                      clock=ctx.runtime.monotonic)
        self.io, self.url = self.open_io(ctx, self.breaker)
        if getattr(self, "get_layers", None) is not None and not self.io.ranged_reads:
            self.io.close()
            raise TypeError(
                f"{type(self).__name__} implements get_layers but {type(self.io).__name__} "
                "reads no byte ranges: implement its _get_range, or set get_layers = None on "
                f"{type(self).__name__} (whole chunks only)")
        self.io.read_limit = ctx.read_limit  # a value longer than one chunk is never received
        self._header_limit = ctx.header_limit
        self._allocate = ctx.allocate
        self._auth = ctx.auth  # keyed names and MACs (auth_key_env), or None
        self._log_once = LogOnce(logger)
        self._lock = threading.Lock()  # negative cache, counters
        self._pins = Pins()
        self._headers = HeaderCache()
        self._bad = BadEntries(ctx.name, self._log_once, clock=ctx.runtime.monotonic)
        #: The last chunk's layout: where the store reads in pieces into memory objects, reads go
        #: straight into memory objects laid out so (:meth:`_read_into`); where reads are sized
        #: (``io.sized_reads``), the size a value of unknown size is read with.
        self._layout: Layout | None = None
        self._missed = 0  # values of another layout since the last read in place
        self._into_pool = self.io.reads_into and (self.io.reads_anywhere
                                                  or bool(ctx.memory_regions()))
        self._absent = TTLSet(opts.negative_cache_s, clock=ctx.runtime.monotonic)
        self._counts = dict.fromkeys(("negative_hits", "vanished", "bytes_got", "reads_in_place",
                                      "layout_misses", "oversized", "headers_reused"), 0)
        self._names: dict[CacheKey, str] = {}
        self._index = CapacityIndex(int(opts.capacity) if opts.capacity is not None else None)
        self._writer = ValueWriter(
            TierParts(ctx.name, self.io, self._index, self._headers, self._pins, self._log_once,
                      ctx.auth, ctx.runtime),
            max_pending=opts.max_pending_writes, threads=opts.io_threads,
            batch_bytes=self.batch_bytes(), written_ttl_s=max(opts.negative_cache_s, 1.0),
            max_pending_bytes=int(opts.max_pending_bytes),
            budget=TenantBudget(ctx.quotas, ctx.name))
        logger.info("tier %r: %s at %s", self.name, self.kind, self.url)

    def name_of(self, key: CacheKey) -> str:
        """The store's key name for ``key`` (the key's safe string form under the prefix);
        remembered, since every lookup names many keys (a dict hit costs less than the name)."""
        name = self._names.get(key)
        if name is None:
            if len(self._names) >= _NAME_CACHE:
                self._names.clear()
            name = self._names[key] = self.opts.prefix + cf.chunk_name(key, self._auth)
        return name

    # -- store ----------------------------------------------------------------------------------
    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs):
            name = self.name_of(key)
            if self._bad.is_other(name):  # another version's value: left alone
                continue
            if self.index_found and name in self._index:  # known to be stored already
                continue
            self._writer.enqueue(name, key, obj)

    @hookimpl
    def flush(self, timeout: float) -> bool:
        return self._writer.flush(timeout)

    # -- lookup ---------------------------------------------------------------------------------
    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        names = [self.name_of(k) for k in keys]
        answer = self._writer.known(names, trust_written=not self.breaker.is_open)
        with self._lock:
            for i, name in enumerate(names):
                if answer[i] is None and (name in self._absent or self._bad.is_other(name)):
                    answer[i] = False
                    self._counts["negative_hits"] += 1
        todo = [i for i, a in enumerate(answer) if a is None]
        if todo:
            found = self.io.exists([names[i] for i in todo])
            with self._lock:
                for i, hit in zip(todo, found):
                    answer[i] = hit is not None and hit is not False
                    if hit is False:
                        self._absent.add(names[i])
            if self.index_found:  # a store that told the sizes: the index learns them
                for i, hit in zip(todo, found):
                    if type(hit) is int:
                        self._index.learn(names[i], hit)
        result = [bool(a) for a in answer]
        if pin:
            self._pins.pin_all(n for n, hit in zip(names, result) if hit)
        return result

    @hookimpl
    def forget_misses(self, keys: Sequence[CacheKey]) -> None:
        names = [self.name_of(k) for k in keys]
        with self._lock:
            for name in names:
                self._absent.discard(name)

    @hookimpl
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        self._pins.unpin_all(self.name_of(k) for k in keys)

    # -- load -----------------------------------------------------------------------------------
    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        if self._into_pool and self._layout is not None:
            return self.batched_get([key])[0]
        return self._read_one(key, self.name_of(key))

    @hookimpl
    def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        names = [self.name_of(k) for k in keys]
        out: list[MemoryObj | None] = []
        if self._into_pool and self._layout is None and keys:  # one read whole tells it
            out.append(self._read_one(keys[0], names[0]))
        elif self.io.sized_reads and keys and self._expect(names[0]) is None:
            out.append(self._read_one(keys[0], names[0]))  # header first: learns the layout
        i = len(out)
        if self._into_pool and self._layout is not None:
            return out + self._read_into(keys[i:], names[i:], self._layout)
        rest: list[MemoryObj | None] = [None] * (len(keys) - i)
        expects = [self._expect(n) for n in names[i:]] if self.io.sized_reads else None
        again: list[int] = []

        def use(j: int, value: bytes | memoryview | None) -> None:  # as each value is read
            want = None if expects is None else expects[j]
            if want is not None and value is not None and len(value) > want:
                again.append(j)  # longer than expected: read header first below
            elif want is None and expects is not None and value is None:
                again.append(j)  # no size to read it with
            else:
                rest[j] = self._load(keys[i + j], names[i + j], value)

        self.io.get_each(names[i:], use, expects)
        for j in again:
            if not self.breaker.is_open:
                rest[j] = self._read_header_first(keys[i + j], names[i + j])
        return out + rest

    def _expect(self, name: str) -> int | None:
        """The size value ``name`` is read with (``io.sized_reads``): its own, where its header
        was read before, else the last chunk's; ``None``: unknown (read header first)."""
        known = self._headers.get(name)
        if known is not None:
            return known.file_size
        return None if self._layout is None else self._layout.size

    def _read_one(self, key: CacheKey, name: str) -> MemoryObj | None:
        """One value read whole: in one call, or (``io.sized_reads``) with one ranged read of
        the size expected, header first where that is unknown or the value is longer."""
        if not self.io.sized_reads:
            return self._load(key, name, self.io.get(name))
        expect = self._expect(name)
        if expect is not None:
            data = self.io.get(name, expect)
            if data is None or len(data) <= expect:  # the whole value (a shorter one is judged)
                return self._load(key, name, data)
        return self._read_header_first(key, name)

    def _read_header_first(self, key: CacheKey, name: str) -> MemoryObj | None:
        """A value of unknown size read as its checked header sizes it: the first bytes and the
        size in one round trip, then the body; a value whose size is not what its header says is
        found before any of its body is fetched (the stored bytes choose no download size)."""
        head = self.io.head(name, cf.HEADER_PROBE)
        if head is None:
            return None if self.breaker.is_open else self._miss(name)
        prefix, size = head
        header = self._parse(name, self._reader(name, prefix), size)
        if header is None or not self._holds(name, key, header):
            return None
        meta = header.meta
        obj = self._allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:  # no memory, or sizes this engine refuses: nothing fetched
            return None
        body = b""
        if header.file_size > header.header_bytes:
            body = self.io.get_range(name, header.header_bytes, header.file_size)
            if body is None or len(body) != header.file_size - header.header_bytes:
                obj.ref_down()
                return None  # gone or replaced since the header was read: a plain miss
        self._found(name, header)
        got = self._fill(name, header, meta, memoryview(body), 0, header.num_layers,
                         base=header.header_bytes, obj=obj)
        if got is not None:
            self._count("bytes_got", header.file_size)
        return got

    def _holds(self, name: str, key: CacheKey, header: cf.ChunkHeader) -> bool:
        """Whether ``header`` is ``key``'s; else the value is corrupt (deleted)."""
        if cf.holds(header, key, self._auth):
            return True
        self._corrupt(name, "the value holds another key")
        return False

    def _load(self, key: CacheKey, name: str, data: bytes | memoryview | None) -> MemoryObj | None:
        """The verified chunk of one value read whole (``None``: missing or unavailable)."""
        if data is None:
            return None if self.breaker.is_open else self._miss(name)
        limit = self.io.read_limit()
        if limit is not None and len(data) > limit:  # longer than any chunk of this engine
            self._count("oversized")
            self._log_once("oversized", "tier %r: value %s is longer than any chunk of this "
                           "engine (%d bytes); treated as a miss (further ones are counted in "
                           "stats as oversized)", self.name, name, limit)
            return None
        view = memoryview(data)
        header = self._parse(name, lambda off, n: view[off : off + n], len(data))
        if header is None or not self._holds(name, key, header):
            return None
        self._found(name, header)
        obj = self._fill(name, header, header.meta, view, 0, header.num_layers, base=0)
        if obj is not None:
            self._count("bytes_got", len(data))
        return obj

    def _found(self, name: str, header: cf.ChunkHeader) -> None:
        """A value read whole has ``header`` (forgotten again if a layer turns out corrupt)."""
        self._remember(name, header)
        if self._into_pool or self.io.sized_reads:
            self._learn(header)

    def _learn(self, header: cf.ChunkHeader) -> None:
        """Read the next chunks by ``header``'s layout unless the current one is of larger
        chunks that still fit (a request's last chunk is often partial, and its next load
        starts with full ones again). Encoded chunks differ in size: no layout reads them."""
        if header.fmt is MemoryFormat.ENCODED:
            self._layout = None
        elif (self._layout is None or header.file_size >= self._layout.size
              or self._missed >= LAYOUT_PATIENCE):  # the chunks did get smaller
            self._layout = Layout.of(header)
            self._missed = 0

    def _read_into(self, keys: Sequence[CacheKey], names: list[str],
                   layout: Layout) -> list[MemoryObj | None]:
        """Each chunk read straight into a memory object laid out as the last chunk was (a
        store that reads in pieces: no copy), then checked: the header read must describe that
        layout and this key, every layer its checksum. A value laid out otherwise is read again
        whole (:meth:`_load`); a missing one is a miss; a damaged one is deleted."""
        n = len(keys)
        out: list[MemoryObj | None] = [None] * n
        objs: list[MemoryObj | None] = [None] * n
        for i in range(n):
            obj = self._allocate(layout.meta.shape, layout.meta.dtype, layout.meta.fmt,
                                 layout.meta.num_tokens)
            if obj is not None and not self.io.registered(obj.tensor.data_ptr(), obj.nbytes):
                obj.ref_down()  # outside registered memory (a heap fallback): read whole
                obj = None
            objs[i] = obj
        direct = [i for i in range(n) if objs[i] is not None]
        hb, gap = layout.header_bytes, layout.stride - layout.layer_nbytes
        sizes: list[int | bytearray | None] = []
        if direct:
            try:
                scratch = self.io.scratch(len(direct) * hb + gap)
            except Exception as exc:  # noqa: BLE001 - no scratch memory: give back, read whole
                self._log_once("scratch", "tier %r: no scratch memory for reads in place (%r); "
                               "reading whole", self.name, exc)
                for i in direct:
                    objs[i].ref_down()  # type: ignore[union-attr]
                    objs[i] = None
                direct = []
        if direct:
            base = scratch.ctypes.data
            pieces = [layout.pieces(objs[i].tensor.data_ptr(), base + j * hb,
                                    base + len(direct) * hb) for j, i in enumerate(direct)]
            sizes = self.io.get_into_many([names[i] for i in direct], pieces)
        again = [i for i in range(n) if objs[i] is None]
        for j, (i, size) in enumerate(zip(direct, sizes)):
            obj, objs[i] = objs[i], None
            if size is None or size != layout.size:
                obj.ref_down()
                if size is None:
                    if not self.breaker.is_open:
                        self._miss(names[i])
                    continue
                self._layout_missed()
                if isinstance(size, int):
                    again.append(i)  # another layout: read it whole
                else:
                    out[i] = self._load(keys[i], names[i], size)  # read whole already
                continue
            out[i] = self._check_read(keys[i], names[i], obj, layout,
                                      memoryview(scratch)[j * hb : (j + 1) * hb], again, i)
        for i in sorted(again):
            if not self.breaker.is_open:
                out[i] = self._load(keys[i], names[i], self.io.get(names[i]))
        return out

    def _layout_missed(self) -> None:
        """A value laid out otherwise than :attr:`_layout` (counted; see :meth:`_learn`)."""
        self._count("layout_misses")
        self._missed += 1

    def _check_read(self, key: CacheKey, name: str, obj: MemoryObj, layout: Layout,
                    head: memoryview, again: list[int], i: int) -> MemoryObj | None:
        """``obj`` once the header read says it holds ``key``'s layers as ``layout`` placed
        them and every layer matches its checksum; else released (``None``, or ``i`` appended
        to ``again`` when the value is laid out otherwise)."""
        try:
            if cf.header_size(head[:8]) != layout.header_bytes:
                obj.ref_down()
                again.append(i)  # a longer or shorter header: another layout
                self._layout_missed()
                return None
        except ChunkFormatError as exc:
            obj.ref_down()
            self._corrupt(name, str(exc))
            return None
        header = self._parse(name, lambda off, k: head[off : off + k], layout.size)
        other = header is not None and not cf.holds(header, key, self._auth)
        if header is None or other or not layout.fits(header):
            obj.ref_down()
            if other:
                self._corrupt(name, "the value holds another key")
            elif header is not None:
                again.append(i)
                self._layout_missed()
            return None
        obj.meta = header.meta  # the same shape; its own token count
        if not cf.verify_layers(header, 0, obj.byte_view.numpy().data):
            obj.ref_down()
            self._corrupt(name, f"a checksum of layers 0..{header.num_layers - 1} mismatches")
            return None
        self._remember(name, header)
        self._count("bytes_got", layout.size)
        self._count("reads_in_place")
        self._missed = 0
        return obj

    @hookimpl
    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int) -> MemoryObj | None:
        name = self.name_of(key)
        header = self._header(name)
        if header is None:
            return None
        try:
            meta, start, end = layer_range(header, first_layer, num_layers)
        except ChunkFormatError:
            return None
        obj = self._allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:  # no memory, or sizes this engine refuses: nothing fetched
            return None
        data = self.io.get_range(name, start, end)
        if data is None or len(data) != end - start:
            obj.ref_down()
            return self._miss(name)
        return self._fill(name, header, meta, memoryview(data), first_layer, num_layers,
                          base=start, obj=obj, whole=False)

    def _header(self, name: str) -> cf.ChunkHeader | None:
        """The header of value ``name``: cached, or read with ranged reads (usually one)."""
        cached = self._headers.get(name)
        if cached is not None:
            return cached
        prefix = self.io.get_range(name, 0, cf.HEADER_PROBE)
        if prefix is None:
            return None if self.breaker.is_open else self._miss(name)
        header = self._parse(name, self._reader(name, prefix), None)
        if header is not None:
            self._remember(name, header)
        return header

    def _reader(self, name: str, prefix: bytes) -> cf.ReadAt:
        """``read(offset, length)`` of value ``name``: from ``prefix`` (its first bytes) where
        they cover the range, else a ranged read (:class:`Unavailable` when that fails)."""

        def read(offset: int, length: int) -> bytes:
            if offset + length <= len(prefix):
                return prefix[offset : offset + length]
            data = self.io.get_range(name, offset, offset + length)
            if data is None:
                raise Unavailable
            return data

        return read

    def _parse(self, name: str, read: cf.ReadAt, size: int | None) -> cf.ChunkHeader | None:
        """The checked header of value ``name`` (``read``: its bytes; ``size``: its length, where
        known); ``None`` for a corrupt value, another version's or an unavailable one
        (:class:`~.bad_entries.BadEntries`). Header bytes equal to those this name's cached
        header was parsed from are that header again, unparsed (``headers_reused``; the parse is
        a pure function of the bytes and the size); the caller's checks (key, layout, every
        layer's checksum) run either way."""
        known = self._headers.known(name)
        if known is not None and (size is None or known[0].file_size == size):
            header, raw = known
            try:
                same = read(0, len(raw)) == raw
            except Unavailable:
                return None
            if same:
                self._count("headers_reused")
                return header
        parsed = self._bad.read_header(name, read, size, self._auth,
                                       lambda: self._lost(name, delete=True), self._max_header())
        if parsed is None:
            self._headers.pop(name)
            return None
        self._headers.put(name, *parsed)
        return parsed[0]

    def _max_header(self) -> int | None:
        """The most header bytes read of a value: a header of the engine's chunks
        (``ctx.header_limit``), never more than a whole value may be (``ctx.read_limit``); a
        longer one is corrupt before more than its first bytes are fetched."""
        limits = [n for n in (self._header_limit(), self.io.read_limit()) if n is not None]
        return min(limits) if limits else None

    def _fill(self, name: str, header: cf.ChunkHeader, meta: MemoryObjMeta, view: memoryview,
              first: int, count: int, base: int, obj: MemoryObj | None = None,
              whole: bool = True) -> MemoryObj | None:
        """:func:`~.chunks.copy_verified` (into ``obj`` when it was allocated before the read;
        consumed); a mismatch is a corrupt value: deleted where the ``whole`` value was read,
        only forgotten where a layer range was read by a header cached earlier (the value may
        have been rewritten since)."""
        allocate = self._allocate if obj is None else (lambda *_: obj)
        try:
            return copy_verified(allocate, header, meta, view, first, count, base)
        except ChunkFormatError as exc:
            self._corrupt(name, str(exc), whole=whole)
            return None
        except BaseException:
            if obj is not None and not obj.is_freed:
                obj.ref_down()
            raise

    def _miss(self, name: str) -> None:
        """A value that lookups promised is gone (the store evicted it, restarted or lost it)."""
        self._writer.forget(name)
        self._index.forget(name)
        self._headers.pop(name)
        self._count("vanished")
        return None

    def _remember(self, name: str, header: cf.ChunkHeader) -> None:
        self._headers.put(name, header)
        if self.index_found:
            self._index.learn(name, header.file_size, touch=True)

    def _corrupt(self, name: str, why: str, whole: bool = True) -> None:
        """The policy (:class:`~.bad_entries.BadEntries`): counted, logged once, deleted."""
        self._bad.corrupt(name, why, (lambda: self._lost(name, delete=True)) if whole else None)
        if not whole:
            self._lost(name, delete=False)

    def _lost(self, name: str, delete: bool) -> None:
        """Forget a corrupt value (and delete it from the store when ``delete``)."""
        self._writer.forget(name)
        self._index.forget(name)
        self._headers.pop(name)
        if delete:
            self._delete([name])

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    # -- eviction -------------------------------------------------------------------------------
    @hookimpl
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        if keys is None:  # bounded by this process only; else the store's own policy evicts
            victims = self._index.shrink(nbytes, self._writer.protected)
        else:
            names = [n for n in map(self.name_of, keys) if n not in self._pins]
            victims = [(n, self._index.forget(n) or 0) for n in names]
        self._delete([n for n, _ in victims])
        return sum(s for _, s in victims)

    def _delete(self, names: Sequence[str]) -> None:
        for n in names:
            self._writer.forget(n)
            self._headers.pop(n)
            self._bad.forget(n)
        with self._lock:
            for n in names:
                self._absent.discard(n)
        self.io.delete(names)

    # -- housekeeping ---------------------------------------------------------------------------
    @hookimpl
    def stats(self) -> dict[str, float]:
        out = {**self._writer.stats(), **self.io.stats(), **self._bad.stats()}
        with self._lock:
            out.update({k: float(v) for k, v in self._counts.items()})
        out["pinned"] = float(len(self._pins))
        out.update(self._index.stats())
        out.update(self.breaker.stats())
        return out

    @hookimpl
    def close(self) -> None:
        if self._writer.close(max(30.0, self.opts.timeout_s * 4), join_s=self.opts.timeout_s + 2):
            self.io.close()
