"""Remote I/O for the fsspec tier: every call bounded by a hard timeout, batches run concurrently.

All operations are coroutines run on one event loop: the filesystem's own loop for async
filesystems (s3fs, gcsfs, ...), where ``fs._cat_file`` and friends are awaited directly, or
fsspec's IO loop for synchronous ones (``memory``, ``file``), whose blocking calls go to a small
thread pool; a ``file://`` store is not reached through fsspec's local filesystem at all but
through :class:`~.local.LocalFiles` (the posix tier's rules: no link followed, no blocking
open). ``asyncio.wait_for`` cancels a call that runs past its timeout inside the loop, and the
calling thread waits on the future with a slightly longer bound, so a dead store never hangs a
caller. Credentials are scrubbed from every message this module produces (:class:`Redactor`).
:class:`FsspecIO` is the tier's :class:`~kvplug.backends.common.value_io.ValueIO`: the same small
interface resp and mooncake implement, behind the tier's circuit breaker.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, get_loop
from kvplug.errors import ConfigError
from kvplug.redact import Redactor
from kvplug.runtime import THREADS, Runtime

from ..common.breaker import CircuitBreaker
from ..common.value_io import ValueIO
from .local import LocalFiles

T = TypeVar("T")


def _s3_defaults(options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Defaults for s3fs that the user did not set: short client timeouts, few retries, no
    listings cache and no shared instance (several hosts and tests must see fresh state)."""
    out = dict(options)
    out.setdefault("use_listings_cache", False)
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("connect_timeout", max(0.5, min(timeout_s, 5.0)))
    config.setdefault("read_timeout", timeout_s)
    config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
    out["config_kwargs"] = config
    return out


def open_filesystem(
    url: str, storage_options: Mapping[str, Any], timeout_s: float, redact: Redactor
) -> tuple[fsspec.AbstractFileSystem, str]:
    """``fsspec.url_to_fs`` with kvplug's defaults; errors name the URL without credentials."""
    options = dict(storage_options)
    options.setdefault("skip_instance_cache", True)
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        options = _s3_defaults(options, timeout_s)
    try:
        fs, root = fsspec.url_to_fs(url, **options)
    except ImportError as exc:
        raise ConfigError(
            f"fsspec tier: the filesystem for {redact(url)!r} is not installed "
            f"({redact.error(exc)}); for S3 install kvplug[remote]"
        ) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"fsspec tier: cannot open {redact(url)!r}: {redact.error(exc)}"
        ) from None
    if protocol in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
        fs.retries = min(fs.retries, 2)  # s3fs's own retry loop (a class attribute)
    return fs, root.rstrip("/")


class FsspecIO(ValueIO):
    """The tier's calls over one fsspec filesystem: bounded, concurrent coroutines on one event
    loop (:meth:`cat`, :meth:`size`, :meth:`put`, :meth:`rm`, :meth:`find`) and, over them, the
    value-store interface (one object a value, its path the name). A call that is refused, fails
    or times out is a miss, never an exception; failures are counted (``timeouts``,
    ``remote_errors``) and fed to the breaker with credentials scrubbed from their message."""

    timeout_stat = "timeouts"
    keeps_values = True  # an upload holds the bytes it is given: each value in fresh bytes
    sized_reads = True  # a whole read never downloads more than the size expected, plus a byte

    def __init__(self, name: str, fs: fsspec.AbstractFileSystem, timeout_s: float,
                 io_threads: int, breaker: CircuitBreaker, redact: Redactor,
                 runtime: Runtime = THREADS, root: str = "") -> None:
        super().__init__(name, breaker, redact)
        self.fs = fs
        self.timeout_s = timeout_s
        self.concurrency = io_threads
        self.is_async = isinstance(fs, AsyncFileSystem) and bool(getattr(fs, "async_impl", False))
        self.loop = fs.loop if self.is_async else get_loop()
        # blocking filesystems' calls, from fsspec's event loop thread (kvplug.runtime's pool:
        # fsspec's own loop thread stays outside a simulation's control)
        self._pool = None if self.is_async else runtime.executor(io_threads, "kvplug-fsspec-io")
        #: a ``file://`` store's objects, under the posix tier's rules (None: another store)
        self.local = LocalFiles(root) if {"file", "local"} & set(_protocols(fs)) else None
        cat = getattr(fs, "_cat_file", None)
        # s3fs issues a HEAD before every whole-object read unless told to read in one request.
        self._cat_kwargs = (
            {"max_concurrency": 1}
            if self.is_async and cat is not None
            and "max_concurrency" in inspect.signature(cat).parameters
            else {}
        )

    # -- running ------------------------------------------------------------------------------
    def run(self, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run one coroutine on the loop; ``TimeoutError`` past ``timeout`` (never hangs)."""
        limit = self.timeout_s if timeout is None else timeout

        async def bounded() -> T:
            return await asyncio.wait_for(make(), limit)

        fut = asyncio.run_coroutine_threadsafe(bounded(), self.loop)
        try:
            return fut.result(limit + 1.0)
        except (FutureTimeout, asyncio.TimeoutError, TimeoutError):
            fut.cancel()
            raise TimeoutError(f"remote call took longer than {limit:.1f}s") from None

    async def _blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def gather(self, makers: Sequence[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
        """Run coroutines at most ``concurrency`` at a time, each under the call timeout."""
        sem = asyncio.Semaphore(self.concurrency)

        async def one(make: Callable[[], Awaitable[T]]) -> T:
            async with sem:
                return await asyncio.wait_for(make(), self.timeout_s)

        return await asyncio.gather(*(one(m) for m in makers), return_exceptions=True)

    def run_many(self, makers: Sequence[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
        """:meth:`gather` from a plain thread, bounded as a whole."""
        waves = -(-len(makers) // self.concurrency) if makers else 1
        return self.run(lambda: self.gather(makers), timeout=self.timeout_s * waves)

    # -- primitives (coroutines) --------------------------------------------------------------
    async def cat(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if self.local is not None:
            return await self._blocking(self.local.read, path, start, end)
        if self.is_async:
            if start is None and end is None:
                return await self.fs._cat_file(path, **self._cat_kwargs)
            return await self.fs._cat_file(path, start=start, end=end)
        return await self._blocking(self.fs.cat_file, path, start=start, end=end)

    async def put(self, path: str, data: bytes) -> None:
        """Write a whole object so that readers see all of it or nothing."""
        if self.local is not None:
            await self._blocking(self.local.write, path, data)
        elif self.is_async:
            await self.fs._pipe_file(path, data)
        else:
            await self._blocking(self.fs.pipe_file, path, data)

    async def size(self, path: str) -> int | None:
        """Object size, or ``None`` when it does not exist."""
        if self.local is not None:
            return await self._blocking(self.local.size, path)
        try:
            if self.is_async:
                info = await self.fs._info(path)
            else:
                info = await self._blocking(self.fs.info, path)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    async def rm(self, path: str) -> None:
        try:
            if self.local is not None:
                await self._blocking(self.local.remove, path)
            elif self.is_async:
                await self.fs._rm_file(path)
            else:
                await self._blocking(self.fs.rm_file, path)
        except FileNotFoundError:
            pass

    async def find(self, root: str) -> dict[str, dict[str, Any]]:
        try:
            if self.local is not None:
                return await self._blocking(self.local.find)
            if self.is_async:
                return await self.fs._find(root, detail=True)
            return await self._blocking(self.fs.find, root, detail=True)
        except FileNotFoundError:
            return {}


    # -- the value-store interface (:class:`ValueIO`) ------------------------------------------
    async def _cat_or_none(self, path: str, start: int | None = None,
                           end: int | None = None) -> bytes | None:
        try:
            return await self.cat(path, start, end)
        except FileNotFoundError:
            return None

    def _get(self, name: str) -> bytes | None:
        return self.run(lambda: self._cat_or_none(name))

    def _get_sized(self, name: str, expect: int) -> bytes | None:
        return self.run(lambda: self._cat_or_none(name, 0, expect + 1))

    def _get_range(self, name: str, start: int, end: int) -> bytes | None:
        return self.run(lambda: self._cat_or_none(name, start, end))

    def _get_each(self, names: Sequence[str], use: Callable[[int, bytes | None], None],
                  expects: Sequence[int | None] | None = None) -> None:
        """Values read concurrently, each with one ranged read of the size expected plus a byte
        (a name with no size expected is not read: ``None``); a failed read fails the batch."""
        todo = [i for i in range(len(names)) if expects is None or expects[i] is not None]

        def make(i: int) -> Callable[[], Awaitable[bytes | None]]:
            if expects is None:
                return lambda: self._cat_or_none(names[i])
            return lambda: self._cat_or_none(names[i], 0, expects[i] + 1)  # type: ignore[operator]

        results = self.run_many([make(i) for i in todo]) if todo else []
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error
        got = dict(zip(todo, results))
        for i in range(len(names)):
            use(i, got.get(i))  # type: ignore[arg-type]

    def _head(self, name: str, length: int) -> tuple[bytes, int] | None:
        """The first ``length`` bytes and the size, asked for concurrently (one round trip,
        nothing past ``length`` downloaded)."""
        results = self.run_many([lambda: self._cat_or_none(name, 0, length),
                                 lambda: self.size(name)])
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error
        data, size = results
        return None if data is None or size is None else (data, size)  # type: ignore[return-value]

    def _exists(self, names: Sequence[str]) -> list[int | bool | BaseException]:  # type: ignore[override]
        """Per name its size (present), ``False`` (missing) or the exception its size call
        raised, with a bounded set of concurrent size calls; raises when the batch as a whole
        failed."""
        return [False if r is None else r
                for r in self.run_many([lambda p=p: self.size(p) for p in names])]

    def exists(self, names: Sequence[str]) -> list[bool | int | None]:
        """Per name its size (present), ``False`` (missing) or ``None`` (unknown: refused or
        failed); one failed size call does not void the others' answers."""
        if not self.breaker.allow():
            return [None] * len(names)
        self._count("remote_lookups", len(names))
        try:
            results = self._exists(names)
        except Exception as exc:  # noqa: BLE001 - the batch as a whole failed: all unknown
            self.failed(exc)
            return [None] * len(names)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            self.failed(error)
        else:
            self.breaker.success()
        return [None if isinstance(r, BaseException) else r for r in results]

    def _set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None]:
        """Upload whole objects, one after the other (the writer sends one per batch)."""
        for path, data in items:
            self.run(lambda path=path, data=data: self.put(path, data))
        return [None] * len(items)

    def _delete(self, names: Sequence[str]) -> None:
        """Delete objects concurrently (missing ones are fine)."""
        results = self.run_many([lambda p=p: self.rm(p) for p in names])
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
