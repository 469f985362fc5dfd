"""The ``fsspec`` tier: chunk files in any fsspec filesystem (S3/MinIO/Ceph, GCS, memory, file).

Objects are whole chunk files in the shared format (:mod:`kvplug.chunkfile`), named
``<root>/<namespace>/<2 hex>/<key string>.safetensors`` (``namespace_dirs=False`` drops the
namespace directory, which is the posix tier's layout). Everything else is the remote tiers' one
path (:class:`~kvplug.backends.common.value_tier.ValueStoreTier`, the same as resp and mooncake):
stores queued on a bounded pool of writer threads (one object per upload; a full queue drops the
store and counts it); loads read an object with one ranged read of the size expected (its own
header's, or the last chunk's), header first where that is unknown, and a layer range with one
ranged read, every layer's checksum verified before any byte is returned; ``contains`` asks for
many sizes concurrently, with a short-lived negative cache. The capacity index learns every
object lookups, reads and a listing at start find (the bound is over the prefix). Every remote
call has a hard timeout and feeds a circuit breaker (:class:`~.io.FsspecIO`): a store that is
down, slow or failing makes this tier answer "missing" until a probe after the back-off
succeeds. Credentials never reach a log line.
"""

from __future__ import annotations

import logging
from typing import Any

from kvplug import chunkfile as cf
from kvplug.bench_raw import RawTarget
from kvplug.errors import KVPlugError
from kvplug.hookspecs import TierContext
from kvplug.keys import CacheKey
from pydantic import ByteSize, Field, field_validator

from ..common.breaker import CircuitBreaker
from ..common.value_io import ValueIO
from ..common.value_tier import RemoteOptions, ValueStoreTier
from .io import FsspecIO, Redactor, open_filesystem

logger = logging.getLogger("kvplug.backends.fsspec")


class FsspecBackend(ValueStoreTier):
    """A remote tier over one fsspec URL; many hosts may share the same prefix."""

    kind = "fsspec store"
    index_found = True

    class Options(RemoteOptions):
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
        io_threads: int = Field(default=8, ge=1, description="writer threads / concurrent calls")
        negative_cache_s: float = Field(default=1.0, ge=0, description="remember misses")
        breaker_backoff_s: float = Field(default=5.0, gt=0, description="first retry delay")
        breaker_max_backoff_s: float = Field(default=60.0, gt=0, description="longest delay")

        @field_validator("url")
        @classmethod
        def _url_given(cls, v: str) -> str:
            if not v:
                raise ValueError("url is required, e.g. 's3://bucket/kvplug'")
            return v

    @staticmethod
    def bench_raw(options: FsspecBackend.Options) -> RawTarget:
        """``kvplug bench``'s raw medium (:mod:`kvplug.bench_raw`): the same filesystem's
        ``pipe``/``cat`` (.bench.RawFsspec)."""
        from .bench import RawFsspec

        return RawFsspec(options.url, dict(options.storage_options))

    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        opts: FsspecBackend.Options = ctx.options
        self.redact = Redactor(opts.url, opts.storage_options)
        fs, self.root = open_filesystem(opts.url, opts.storage_options, opts.timeout_s,
                                        self.redact)
        io = FsspecIO(ctx.name, fs, opts.timeout_s, opts.io_threads, breaker, self.redact,
                      ctx.runtime, self.root)
        return io, self.redact(opts.url)

    def batch_bytes(self) -> int:
        return 1  # one whole-object upload per batch

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        if self.io.local is not None:  # crashed writers' temporary files (object stores: none)
            removed = self.io.local.remove_stale_temps()
            if removed:
                logger.info("tier %r: removed %d stale temporary file(s) under %s", self.name,
                            removed, self.url)
        if self._index.bounded:
            self._load_index()

    # -- naming ---------------------------------------------------------------------------------
    def name_of(self, key: CacheKey) -> str:
        return self.path_of(key)

    def path_of(self, key: CacheKey) -> str:
        """The object name of ``key``: built only from the key's safe string form and hex."""
        rel = cf.relative_chunk_path(key, self._auth)
        if self.opts.namespace_dirs:
            rel = f"{cf.namespace_dir(key, self._auth)}/{rel}"
        if any(part in ("", ".", "..") for part in rel.split("/")) or "\\" in rel:
            raise KVPlugError(f"refusing object name {rel!r}: it would leave the tier's prefix")
        return f"{self.root}/{rel}"

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
