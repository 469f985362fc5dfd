"""The ``fsspec`` tier: chunk files in any fsspec filesystem (S3/MinIO/Ceph, GCS, memory, file).

Objects are whole chunk files in the shared format (:mod:`kvplug.chunk_format`), named
``<root>/<namespace>/<2 hex>/<key string>.safetensors`` (``namespace_dirs=False`` drops the
namespace directory, which is the posix tier's layout). Stores are queued on a bounded pool of
writer threads (a full queue drops the store and counts it); loads read whole objects or a layer
range with one ranged read and verify every layer's checksum before any byte is returned;
``contains`` checks many keys concurrently with a short-lived negative cache. Every remote call has
a hard timeout and feeds a circuit breaker: a store that is down, slow or failing makes this tier
answer "missing" until a probe after the back-off succeeds. Credentials never reach a log line.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvplug import chunk_format as cf
from kvplug.errors import KVPlugError
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from .fsspec_breaker import CircuitBreaker
from .fsspec_index import CapacityIndex, TTLSet
from .fsspec_io import Redactor, RemoteIO, open_filesystem
from .fsspec_read import ReadMixin
from .fsspec_write import WriteMixin

logger = logging.getLogger("kvplug.backends.fsspec")
_HEADER_CACHE = 4096


class FsspecBackend(ReadMixin, WriteMixin):
    """A remote tier over one fsspec URL; many hosts may share the same prefix."""

    class Options(BaseModel):
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
        max_pending_writes: int = Field(default=64, ge=1, description="queued stores; more drop")
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
        self._allocate = ctx.allocate
        self.redact = Redactor(opts.url, opts.storage_options)
        self.url = self.redact(opts.url)
        fs, self.root = open_filesystem(opts.url, opts.storage_options, opts.timeout_s,
                                        self.redact)
        self.io = RemoteIO(fs, opts.timeout_s, opts.io_threads)
        self.breaker = CircuitBreaker(
            ctx.name, threshold=opts.breaker_threshold, backoff_s=opts.breaker_backoff_s,
            max_backoff_s=opts.breaker_max_backoff_s,
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._absent = TTLSet(opts.negative_cache_s)
        self._written = TTLSet(max(opts.negative_cache_s, 1.0))
        self._headers: OrderedDict[str, cf.ChunkHeader] = OrderedDict()
        self._index = CapacityIndex(int(opts.capacity)) if opts.capacity is not None else None
        self._counts: dict[str, int] = dict.fromkeys(
            ("written", "bytes_put", "dropped_puts", "dropped_queue_full", "dropped_down",
             "put_errors", "remote_errors", "timeouts", "corrupt", "negative_hits",
             "remote_lookups", "evicted"), 0)
        self._logged: set[str] = set()
        self._closed = False
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=opts.max_pending_writes)
        self._writers = [
            threading.Thread(target=self._writer, name=f"kvplug-fsspec-w{i}", daemon=True)
            for i in range(opts.io_threads)
        ]
        for t in self._writers:
            t.start()
        if self._index is not None:
            self._load_index()
        logger.info("tier %r: fsspec store at %s", self.name, self.url)

    # -- naming ---------------------------------------------------------------------------------
    def path_of(self, key: CacheKey) -> str:
        """The object name of ``key``: built only from the key's safe string form and hex."""
        rel = cf.relative_chunk_path(key)
        if self.opts.namespace_dirs:
            ns = key.namespace if len(key.namespace) <= 120 else cf.chunk_name(key).split(".")[0]
            rel = f"{ns}/{rel}"
        if any(part in ("", ".", "..") for part in rel.split("/")) or "\\" in rel:
            raise KVPlugError(f"refusing object name {rel!r}: it would leave the tier's prefix")
        return f"{self.root}/{rel}"

    # -- failures -------------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def _once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            logger.warning(msg + " — further ones are counted in stats, not logged", *args)

    def _remote_failed(self, exc: BaseException) -> None:
        timeout = isinstance(exc, TimeoutError)
        self._count("timeouts" if timeout else "remote_errors")
        self.breaker.failure(self.redact.error(exc))

    # -- lookup ---------------------------------------------------------------------------------
    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        paths = [self.path_of(k) for k in keys]
        found: list[bool | None] = [None] * len(paths)
        trust_writes = not self.breaker.is_open
        with self._lock:
            for i, p in enumerate(paths):
                if p in self._pending:
                    found[i] = False  # not durable yet: invisible
                elif trust_writes and p in self._written:
                    found[i] = True
                elif p in self._absent:
                    found[i] = False
                    self._counts["negative_hits"] += 1
        todo = [i for i, f in enumerate(found) if f is None]
        if todo:
            sizes = self._sizes([paths[i] for i in todo])
            with self._lock:
                for i, size in zip(todo, sizes):
                    found[i] = size is not None and size >= 0
                    if size is None:
                        self._absent.add(paths[i])
                    elif size >= 0 and self._index is not None and paths[i] not in self._index.sizes:
                        self._index.add(paths[i], size)
        answer = [bool(f) for f in found]
        if pin:
            with self._lock:
                for p, hit in zip(paths, answer):
                    if hit:
                        self._pins[p] = self._pins.get(p, 0) + 1
        return answer

    def _sizes(self, paths: Sequence[str]) -> list[int | None]:
        """Sizes of many objects with a bounded set of concurrent calls (None: missing, -1:
        unknown because the store failed)."""
        if not self.breaker.allow():
            return [-1] * len(paths)
        self._count("remote_lookups", len(paths))
        try:
            results = self.io.run_many([lambda p=p: self.io.size(p) for p in paths])
        except Exception as exc:  # noqa: BLE001
            self._remote_failed(exc)
            return [-1] * len(paths)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._remote_failed(errors[0])
        else:
            self.breaker.success()
        return [-1 if isinstance(r, BaseException) else r for r in results]

    @hookimpl
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        with self._lock:
            for key in keys:
                p = self.path_of(key)
                count = self._pins.get(p, 0)
                if count > 1:
                    self._pins[p] = count - 1
                elif count == 1:
                    del self._pins[p]

    # -- eviction and housekeeping -------------------------------------------------------------
    @hookimpl
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        if keys is None:
            if self._index is None or nbytes <= 0:
                return 0  # unbounded store: expire objects with a bucket lifecycle rule
            with self._lock:
                victims = self._index.victims(
                    nbytes - max(0, self._index.capacity - self._index.used), self._protected
                ) or []
        else:
            victims = []
            with self._lock:
                for key in keys:
                    p = self.path_of(key)
                    if self._pins.get(p, 0) > 0:
                        continue
                    size = self._index.pop(p) if self._index is not None else None
                    victims.append((p, size or 0))
                    self._absent.discard(p)
        self._delete([p for p, _ in victims])
        return sum(s for _, s in victims)

    def _load_index(self) -> None:
        """Learn what is already under the prefix (for the capacity bound), oldest first."""
        try:
            listing = self.io.run(lambda: self.io.find(self.root), timeout=self.opts.timeout_s * 4)
        except Exception as exc:  # noqa: BLE001
            self._once("listing", "tier %r: could not list %s (%s); capacity counts only new "
                       "objects", self.name, self.url, self.redact.error(exc))
            return
        entries = [
            (str(info.get("LastModified") or info.get("mtime") or info.get("created") or ""),
             path, int(info.get("size") or 0))
            for path, info in listing.items() if path.endswith(cf.FILE_SUFFIX)
        ]
        with self._lock:
            for _, path, size in sorted(entries):
                self._index.add(path if path.startswith(self.root) else f"{self.root}/{path}",
                                size)

    @hookimpl
    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {k: float(v) for k, v in self._counts.items()}
            out["pending_writes"] = float(sum(self._pending.values()))
            out["pinned"] = float(len(self._pins))
            if self._index is not None:
                out["entries"] = float(len(self._index.sizes))
                out["bytes"] = float(self._index.used)
                out["capacity"] = float(self._index.capacity)
        out.update(self.breaker.stats())
        return out

    @hookimpl
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        drain = max(30.0, self.opts.timeout_s * 4)
        if not self.flush(drain):
            logger.warning("tier %r: writes still pending after %.0fs at close; dropped",
                           self.name, drain)
        while True:  # what the writers could not drain in time is dropped and released
            try:
                path, _, obj = self._queue.get_nowait()
            except queue.Empty:
                break
            obj.ref_down()
            self._done(path)
            self._count("dropped_puts")
        self._stop.set()
        for t in self._writers:
            t.join(timeout=self.opts.timeout_s + 2)
        self.io.close()
