"""The ``fsspec`` tier: chunk files in any fsspec filesystem (S3/MinIO/Ceph, GCS, memory, file).

Objects are whole chunk files in the shared format (:mod:`kvplug.chunkfile`), named
``<root>/<namespace>/<2 hex>/<key string>.safetensors`` (``namespace_dirs=False`` drops the
namespace directory, which is the posix tier's layout). Stores are queued on a bounded pool of
writer threads (the shared :class:`~kvplug.backends.common.value_writer.ValueWriter`, one object
per batch; a full queue drops the store and counts it); loads (:class:`~.reader.ChunkReader`)
read whole objects or a layer range with one ranged read and verify every layer's checksum
before any byte is returned; ``contains`` checks many keys concurrently with a short-lived
negative cache. Every remote call has a hard timeout and feeds a circuit breaker: a store that
is down, slow or failing makes this tier answer "missing" until a probe after the back-off
succeeds. Credentials never reach a log line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvplug import chunkfile as cf
from kvplug.config import BaseOptions
from kvplug.errors import KVPlugError
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.logs import LogOnce
from kvplug.memory import MemoryObj
from kvplug.pins import PinCounts
from pydantic import ByteSize, ConfigDict, Field, field_validator

from ..common.breaker import CircuitBreaker
from ..common.index import CapacityIndex
from ..common.pinned import PinnedStore
from ..common.tenant_budget import TenantBudget
from ..common.value_writer import MAX_PENDING_BYTES, MAX_PENDING_WRITES, ValueWriter
from .io import (
    GuardedIO,
    Redactor,
    RemoteIO,
    TierParts,
    open_filesystem,
    remove_stale_local_temps,
)
from .reader import ChunkReader

logger = logging.getLogger("kvplug.backends.fsspec")


class FsspecBackend(PinnedStore):
    """A remote tier over one fsspec URL; many hosts may share the same prefix."""

    #: ``quotas`` are kept by counting what this process stores (approximate:
    #: :mod:`kvplug.backends.common.tenant_budget`)
    budget_quotas = True

    class Options(BaseOptions):
        model_config = ConfigDict(extra="forbid")
        url: str = Field(default="", validate_default=True,
                         description="s3://bucket/prefix, gs://..., memory://..., file://...")
        storage_options: dict[str, Any] = Field(
            default_factory=dict, repr=False,
            description="passed to fsspec as given (endpoint_url, key, secret, anon...)",
        )
        capacity: ByteSize | None = Field(
            default=None, description="optional LRU bound on bytes under the prefix, enforced "
            "by this process over the objects it knows; None = unbounded")
        namespace_dirs: bool = Field(default=True, description="<root>/<namespace>/... layout")
        timeout_s: float = Field(default=3.0, gt=0, description="hard bound on one remote call")
        max_pending_writes: int = Field(default=MAX_PENDING_WRITES, ge=1,
                                        description="queued stores; more drop (counted)")
        max_pending_bytes: ByteSize = Field(default=ByteSize(MAX_PENDING_BYTES), gt=0,
                                            description="bytes of queued stores (L1 memory "
                                            "they hold); more drop (counted)")
        io_threads: int = Field(default=8, ge=1, description="writer threads / concurrent calls")
        negative_cache_s: float = Field(default=1.0, ge=0, description="remember misses")
        breaker_threshold: int = Field(default=2, ge=1, description="failures that open it")
        breaker_backoff_s: float = Field(default=5.0, gt=0, description="first retry delay")
        breaker_max_backoff_s: float = Field(default=60.0, gt=0, description="longest delay")

        @field_validator("url")
        @classmethod
        def _url_given(cls, v: str) -> str:
            if not v:
                raise ValueError("url is required, e.g. 's3://bucket/kvplug'")
            return v

    def __init__(self, ctx: TierContext) -> None:
        opts: FsspecBackend.Options = ctx.options
        self.name = ctx.name
        self.opts = opts
        self.redact = Redactor(opts.url, opts.storage_options)
        self.url = self.redact(opts.url)
        fs, self.root = open_filesystem(opts.url, opts.storage_options, opts.timeout_s,
                                        self.redact)
        self.io = RemoteIO(fs, opts.timeout_s, opts.io_threads, ctx.runtime)
        self.breaker = CircuitBreaker(
            ctx.name, threshold=opts.breaker_threshold, backoff_s=opts.breaker_backoff_s,
            max_backoff_s=opts.breaker_max_backoff_s, clock=ctx.runtime.monotonic,
        )
        self._remote = GuardedIO(self.io, self.breaker, self.redact)
        self._log_once = LogOnce(logger)
        self._lock = threading.Lock()  # guards the pins
        self._pins: PinCounts[str] = PinCounts()
        self._index = CapacityIndex(int(opts.capacity) if opts.capacity is not None else None)
        parts = TierParts(ctx.name, self._remote, self._index, self._log_once)
        self._auth = ctx.auth  # keyed names and MACs (auth_key_env), or None
        self._reader = ChunkReader(parts, ctx.allocate, self._lost, opts.negative_cache_s,
                                   ctx.auth)
        self._writer = ValueWriter(  # one whole-object upload per batch, into fresh bytes
            ctx.name, self._remote, self._index, self._log_once, pinned=self._pinned,
            delete=self._delete, stored=self._reader.forget, max_pending=opts.max_pending_writes,
            threads=opts.io_threads, batch_bytes=1, written_ttl_s=max(opts.negative_cache_s, 1.0),
            skip_indexed=True, reuse_buffer=False, thread_prefix="fsspec", auth=ctx.auth,
            max_pending_bytes=int(opts.max_pending_bytes), runtime=ctx.runtime,
            budget=TenantBudget(ctx.quotas, ctx.name))
        if self.io.is_local:  # crashed local writers' temporary files (object stores have none)
            removed = remove_stale_local_temps(self.root)
            if removed:
                logger.info("tier %r: removed %d stale temporary file(s) under %s", self.name,
                            removed, self.url)
        if self._index.bounded:
            self._load_index()
        logger.info("tier %r: fsspec store at %s", self.name, self.url)

    # -- naming ---------------------------------------------------------------------------------
    def store_name(self, key: CacheKey) -> str:
        return self.path_of(key)

    def path_of(self, key: CacheKey) -> str:
        """The object name of ``key``: built only from the key's safe string form and hex."""
        rel = cf.relative_chunk_path(key, self._auth)
        if self.opts.namespace_dirs:
            rel = f"{cf.namespace_dir(key, self._auth)}/{rel}"
        if any(part in ("", ".", "..") for part in rel.split("/")) or "\\" in rel:
            raise KVPlugError(f"refusing object name {rel!r}: it would leave the tier's prefix")
        return f"{self.root}/{rel}"

    # -- store and load -------------------------------------------------------------------------
    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs):
            path = self.path_of(key)
            if not self._reader.other_version(path):  # another version's object: left alone
                self._writer.submit(path, key, obj)

    @hookimpl
    def flush(self, timeout: float) -> bool:
        return self._writer.flush(timeout)

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        return self._reader.get(self.path_of(key), key)

    @hookimpl
    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int) -> MemoryObj | None:
        return self._reader.get_layers(self.path_of(key), first_layer, num_layers)

    # -- lookup ---------------------------------------------------------------------------------
    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        paths = [self.path_of(k) for k in keys]
        known = self._writer.known(paths, trust_written=not self.breaker.is_open)
        answer = self._reader.resolve(paths, known)
        if pin:
            self._pin_hits(paths, answer)
        return answer

    # -- eviction (``evict``, ``unpin``: PinnedStore) and housekeeping ---------------------------
    def _delete(self, paths: Sequence[str]) -> None:
        """Delete objects from the store and from everything that remembers them."""
        for p in paths:
            self._reader.forget(p)
            self._writer.forget(p)
        self._remote.delete(paths)

    def _lost(self, path: str, delete: bool) -> None:
        """The reader found ``path`` corrupt: forget it (and delete it if ``delete``)."""
        self._writer.forget(path)
        self._index.forget(path)
        if delete:
            self._delete([path])

    def _load_index(self) -> None:
        """Learn what is already under the prefix (for the capacity bound), oldest first."""
        try:
            listing = self.io.run(lambda: self.io.find(self.root), timeout=self.opts.timeout_s * 4)
        except Exception as exc:  # noqa: BLE001
            self._log_once("listing", "tier %r: could not list %s (%s); capacity counts only new "
                           "objects", self.name, self.url, self.redact.error(exc))
            return
        entries = [
            (str(info.get("LastModified") or info.get("mtime") or info.get("created") or ""),
             path, int(info.get("size") or 0))
            for path, info in listing.items() if path.endswith(cf.FILE_SUFFIX)
        ]
        for _, path, size in sorted(entries):
            self._index.learn(path if path.startswith(self.root) else f"{self.root}/{path}", size)

    @hookimpl
    def stats(self) -> dict[str, float]:
        out = {**self._writer.stats(), **self._reader.stats(), **self._remote.stats()}
        with self._lock:
            out["pinned"] = float(len(self._pins))
        out.update(self._index.stats())
        out.update(self.breaker.stats())
        return out

    @hookimpl
    def close(self) -> None:
        drain = max(30.0, self.opts.timeout_s * 4)
        if self._writer.close(drain, join_s=self.opts.timeout_s + 2):
            self.io.close()
