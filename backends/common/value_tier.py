"""A tier over a key-value store (resp: Valkey/Redis; mooncake: Mooncake Store), shared by hosts.

Each chunk is one value in the shared chunk format (:mod:`kvplug.chunkfile`), named
``<prefix><key string>`` (the key string holds the model namespace, so models never collide).
Stores are queued and sent in batches (:class:`~.value_writer.ValueWriter`); ``contains`` asks
for many keys in one batch, with a short-lived negative cache; ``get`` reads a value in one call
(``batched_get``: many values in one batch) and verifies every layer's checksum before any byte
is returned; where the store reads in pieces into registered memory (Mooncake: L1's pool) or
into any memory (resp: a socket), the layers go straight into the memory objects, laid out as
the last chunk was, and the header read must say so (:meth:`ValueStoreTier._read_into`);
``get_layers`` reads a layer range where the store reads ranges. Every call is bounded by the
store client's timeout and feeds the circuit breaker shared with the fsspec tier
(:class:`~.value_io.ValueIO`). The store's own eviction, a restart that lost its data, or a
value refused because the store is full are all misses or dropped stores, never errors.
Credentials never reach a log line or ``stats``.

A backend subclasses :class:`ValueStoreTier`: its ``Options`` derive from
:class:`ValueStoreOptions` and :meth:`ValueStoreTier.open_io` returns its
:class:`~.value_io.ValueIO`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvplug import chunkfile as cf
from kvplug.config import BaseOptions
from kvplug.errors import ChunkFormatError, ChunkVersionError
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.logs import LogOnce
from kvplug.memory import MemoryFormat, MemoryObj, MemoryObjMeta
from kvplug.pins import PinCounts
from pydantic import ByteSize, ConfigDict, Field, field_validator

from .breaker import CircuitBreaker
from .chunks import HeaderCache, Layout, copy_verified, layer_range
from .index import CapacityIndex, TTLSet
from .pinned import PinnedStore
from .tenant_budget import TenantBudget
from .value_io import ValueIO
from .value_writer import MAX_PENDING_BYTES, MAX_PENDING_WRITES, ValueWriter

logger = logging.getLogger("kvplug.backends.values")
_NAME_CACHE = 65536
#: Values of another layout in a row after which a smaller chunk's layout replaces the current.
LAYOUT_PATIENCE = 8


class ValueStoreOptions(BaseOptions):
    """Options every value-store tier has (a backend adds how to reach its store)."""

    model_config = ConfigDict(extra="forbid")
    prefix: str = Field(default="kvplug:", description="prepended to every key name")
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
    batch_bytes: ByteSize = Field(default=ByteSize(16 << 20), gt=0,
                                  description="bytes of queued stores sent in one batch (each "
                                  "writer thread keeps an encoding buffer of about this size)")
    negative_cache_s: float = Field(default=0.5, ge=0, description="remember misses")
    breaker_threshold: int = Field(default=2, ge=1, description="failures that open it")
    breaker_backoff_s: float = Field(default=2.0, gt=0, description="first retry delay")
    breaker_max_backoff_s: float = Field(default=30.0, gt=0, description="longest delay")

    @field_validator("prefix")
    @classmethod
    def _prefix_safe(cls, v: str) -> str:
        if any(c.isspace() for c in v) or "{" in v or "}" in v:
            raise ValueError(f"prefix {v!r} may not hold spaces or braces (braces would pin every "
                             "key to one cluster slot); e.g. 'kvplug:'")
        return v


class ValueStoreTier(PinnedStore):
    """The hooks of a tier over a key-value store; subclasses say how to reach the store."""

    Options = ValueStoreOptions
    #: ``quotas`` are kept by counting what this process stores (:mod:`.tenant_budget`)
    budget_quotas = True
    #: What log lines call the store (e.g. "Valkey/Redis store").
    kind = "key-value store"

    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        """The store's calls (behind ``breaker``) and the store's name for log lines (no
        credentials)."""
        raise NotImplementedError

    def __init__(self, ctx: TierContext) -> None:
        opts: ValueStoreOptions = ctx.options
        self.name = ctx.name
        self.opts = opts
        self.breaker = CircuitBreaker(ctx.name, threshold=opts.breaker_threshold,
                                      backoff_s=opts.breaker_backoff_s,
                                      max_backoff_s=opts.breaker_max_backoff_s,
                                      clock=ctx.runtime.monotonic)
        self.io, self.url = self.open_io(ctx, self.breaker)
        self.io.read_limit = ctx.read_limit  # a value longer than one chunk is never received
        self._allocate = ctx.allocate
        self._auth = ctx.auth  # keyed names and MACs (auth_key_env), or None
        self._log_once = LogOnce(logger)
        self._lock = threading.Lock()  # pins, negative cache, counters
        self._pins: PinCounts[str] = PinCounts()
        self._headers = HeaderCache()
        #: The last chunk's layout, where the store reads in pieces into memory objects (reads go
        #: straight into memory objects laid out so; see :meth:`_read_into`).
        self._layout: Layout | None = None
        self._missed = 0  # values of another layout since the last read in place
        self._into_pool = self.io.reads_into and (self.io.reads_anywhere
                                                  or bool(ctx.memory_regions()))
        self._absent = TTLSet(opts.negative_cache_s, clock=ctx.runtime.monotonic)
        self._counts = dict.fromkeys(("corrupt", "other_version", "negative_hits", "vanished",
                                      "bytes_got", "reads_in_place", "layout_misses",
                                      "oversized", "headers_reused"), 0)
        self._names: dict[CacheKey, str] = {}
        self._index = CapacityIndex(int(opts.capacity) if opts.capacity is not None else None)
        self._writer = ValueWriter(
            ctx.name, self.io, self._index, self._log_once, pinned=self._pinned,
            delete=self._delete, stored=self._stored, max_pending=opts.max_pending_writes,
            threads=opts.io_threads, batch_bytes=int(opts.batch_bytes),
            written_ttl_s=max(opts.negative_cache_s, 1.0), auth=ctx.auth,
            max_pending_bytes=int(opts.max_pending_bytes), runtime=ctx.runtime,
            budget=TenantBudget(ctx.quotas, ctx.name))
        logger.info("tier %r: %s at %s", self.name, self.kind, self.url)

    def store_name(self, key: CacheKey) -> str:
        return self.name_of(key)

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
            self._writer.submit(self.name_of(key), key, obj)

    @hookimpl
    def flush(self, timeout: float) -> bool:
        return self._writer.flush(timeout)

    def _stored(self, name: str) -> None:
        self._headers.pop(name)
        with self._lock:
            self._absent.discard(name)

    # -- lookup ---------------------------------------------------------------------------------
    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        names = [self.name_of(k) for k in keys]
        answer = self._writer.known(names, trust_written=not self.breaker.is_open)
        with self._lock:
            for i, name in enumerate(names):
                if answer[i] is None and name in self._absent:
                    answer[i] = False
                    self._counts["negative_hits"] += 1
        todo = [i for i, a in enumerate(answer) if a is None]
        if todo:
            found = self.io.exists([names[i] for i in todo])
            with self._lock:
                for i, hit in zip(todo, found):
                    answer[i] = bool(hit)
                    if hit is False:
                        self._absent.add(names[i])
        result = [bool(a) for a in answer]
        if pin:
            self._pin_hits(names, result)
        return result

    # -- load -----------------------------------------------------------------------------------
    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        if self._layout is not None:
            return self.batched_get([key])[0]
        name = self.name_of(key)
        return self._load(key, name, self.io.get(name))

    @hookimpl
    def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        names = [self.name_of(k) for k in keys]
        out: list[MemoryObj | None] = []
        if self._into_pool and self._layout is None and keys:  # one read whole tells it
            out.append(self._load(keys[0], names[0], self.io.get(names[0])))
        i = len(out)
        if self._layout is not None:
            return out + self._read_into(keys[i:], names[i:], self._layout)
        rest: list[MemoryObj | None] = [None] * (len(keys) - i)

        def use(j: int, value: bytes | memoryview | None) -> None:  # as each value is read
            rest[j] = self._load(keys[i + j], names[i + j], value)

        self.io.get_each(names[i:], use)
        return out + rest

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
        if header is None:
            return None
        if header.key != cf.stored_key(key, self._auth):
            self._corrupt(name, "the value holds another key")
            return None
        self._remember(name, header)
        if self._into_pool:
            self._learn(header)
        obj = self._fill(name, header, header.meta, view, 0, header.num_layers, base=0)
        if obj is not None:
            self._count("bytes_got", len(data))
        return obj

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
        other = header is not None and header.key != cf.stored_key(key, self._auth)
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
                          base=start, obj=obj)

    def _header(self, name: str) -> cf.ChunkHeader | None:
        cached = self._headers.get(name)
        if cached is not None:
            return cached
        prefix = self.io.get_range(name, 0, cf.HEADER_PROBE)
        if prefix is None:
            return self._miss(name)

        def read(offset: int, length: int) -> bytes:
            if offset + length <= len(prefix):
                return prefix[offset : offset + length]
            return self.io.get_range(name, offset, offset + length) or b""

        header = self._parse(name, read, None)
        if header is not None:
            self._remember(name, header)
        return header

    def _parse(self, name: str, read: cf.ReadAt, size: int | None) -> cf.ChunkHeader | None:
        """The checked header of value ``name`` (``read``: its bytes; ``size``: its length, where
        known). Header bytes equal to those this name's cached header was parsed from are that
        header again, unparsed (``headers_reused``; the parse is a pure function of the bytes
        and the size); the caller's checks (key, layout, every layer's checksum) run either way."""
        known = self._headers.known(name)
        if known is not None and (size is None or known[0].file_size == size):
            header, raw = known
            if read(0, len(raw)) == raw:
                self._count("headers_reused")
                return header
        try:
            header, raw = cf.read_header(read, size, self._auth)
            self._headers.put(name, header, raw)
            return header
        except ChunkVersionError as exc:  # another version's value: a miss, left in place
            self._count("other_version")
            self._log_once("other_version", "tier %r: %s is of another format version (%s); "
                           "treated as a miss and left in place", self.name, name, exc)
            return None
        except ChunkFormatError as exc:
            self._corrupt(name, str(exc))
            return None

    def _fill(self, name: str, header: cf.ChunkHeader, meta: MemoryObjMeta, view: memoryview,
              first: int, count: int, base: int, obj: MemoryObj | None = None) -> MemoryObj | None:
        """:func:`~.chunks.copy_verified` (into ``obj`` when it was allocated before the read;
        consumed); a mismatch is a corrupt value (deleted)."""
        allocate = self._allocate if obj is None else (lambda *_: obj)
        try:
            return copy_verified(allocate, header, meta, view, first, count, base)
        except ChunkFormatError as exc:
            self._corrupt(name, str(exc))
            return None

    def _miss(self, name: str) -> None:
        """A value that lookups promised is gone (the store evicted it, restarted or lost it)."""
        self._writer.forget(name)
        self._index.forget(name)
        self._headers.pop(name)
        self._count("vanished")
        return None

    def _remember(self, name: str, header: cf.ChunkHeader) -> None:
        self._headers.put(name, header)

    def _corrupt(self, name: str, why: str) -> None:
        self._count("corrupt")
        self._log_once("corrupt", "tier %r: corrupt value %s (%s) treated as a miss and deleted — "
                       "further ones are counted in stats, not logged", self.name, name, why)
        self._miss(name)
        self._delete([name])

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    # -- eviction (``evict``, ``unpin``: :class:`~.pinned.PinnedStore`) ------------------------
    def _delete(self, names: Sequence[str]) -> None:
        for n in names:
            self._writer.forget(n)
            self._headers.pop(n)
        self.io.delete(names)

    # -- housekeeping ---------------------------------------------------------------------------
    @hookimpl
    def stats(self) -> dict[str, float]:
        out = {**self._writer.stats(), **self.io.stats()}
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
