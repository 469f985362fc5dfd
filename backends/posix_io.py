"""File I/O of the posix tier: atomic chunk writes and vectored reads straight into memory objects.

Writes go to a hidden temporary name in the chunk's shard directory and are renamed into place,
so a reader (in this or another process) sees a whole file or none. Reads use ``os.preadv`` into
the destination object's memory (no intermediate ``bytes``), then verify every layer checksum.
O_DIRECT is used where it was asked for, the file system accepts it and the buffers are aligned;
otherwise the same call goes through the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash
from kvplug import chunk_format as cf
from kvplug.errors import ChunkFormatError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

O_DIRECT = getattr(os, "O_DIRECT", 0)
IOV_MAX = 1024
TMP_SUFFIX = ".tmp"
_local = threading.local()


class CorruptChunk(Exception):
    """A chunk file that exists but must not be used; ``ino`` identifies the file that was read."""

    def __init__(self, reason: str, ino: int) -> None:
        super().__init__(reason)
        self.ino = ino


def _aligned_buffer(name: str, size: int) -> memoryview:
    """A per-thread, page-aligned scratch buffer of at least ``size`` bytes."""
    buf = getattr(_local, name, None)
    if buf is None or len(buf) < size:
        buf = memoryview(mmap.mmap(-1, cf.align_up(max(size, cf.ALIGN))))
        setattr(_local, name, buf)
    return buf


def _address(obj: MemoryObj) -> int:
    return obj.tensor.data_ptr()


def _io_all(op: Callable, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    """Run ``os.pwritev``/``os.preadv`` until every buffer is done; returns bytes moved.

    A read that hits end of file stops early (the caller compares the count)."""
    pending = [b for b in bufs if len(b)]
    total = 0
    i = 0
    while i < len(pending):
        n = op(fd, pending[i : i + IOV_MAX], offset)
        if n <= 0:
            if op is os.pwritev:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            break
        offset += n
        total += n
        while n and i < len(pending):
            if n >= len(pending[i]):
                n -= len(pending[i])
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0
    return total


def probe_o_direct(root: Path) -> str | None:
    """``None`` if O_DIRECT writes and reads work in ``root``, else why they do not."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    path = root / f".odirect-probe.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    buf = _aligned_buffer("probe", cf.ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            os.pwritev(fd, [buf[: cf.ALIGN]], 0)
            os.preadv(fd, [buf[: cf.ALIGN]], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return None


def write_chunk(
    path: Path | str,
    obj: MemoryObj,
    header: bytes,
    bufs: list[memoryview],
    *,
    fsync: bool = False,
    direct: bool = False,
) -> int:
    """Write a chunk (``header, bufs = chunk_format.encode_chunk(key, obj)``) at ``path``
    atomically; returns the file size. ``obj`` must stay referenced until this returns.

    Raises ``OSError`` (full disk, read-only directory...) after removing the temporary file."""
    path = Path(path)
    size = len(header) + sum(len(b) for b in bufs)
    layers = cf.chunk_layout(obj.meta)[0]
    whole = memoryview(obj.byte_view.numpy()) if obj.nbytes else None
    if whole is not None and len(bufs) == layers:  # no padding: one buffer for all layers
        bufs = [whole]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if direct and whole is not None and len(bufs) == 1 and _address(obj) % cf.ALIGN == 0:
        flags |= O_DIRECT
        head = _aligned_buffer("header", len(header))[: len(header)]
        head[:] = header
        header = head
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    with cf.discard_on_failure(tmp):
        try:
            _io_all(os.pwritev, fd, [memoryview(header), *bufs], 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return size


def read_chunk(
    path: Path | str,
    key: CacheKey,
    allocate: Callable[..., MemoryObj | None],
    layers: tuple[int, int] | None = None,
    *,
    direct: bool = False,
    known: tuple[str, cf.ChunkHeader] | None = None,
) -> tuple[MemoryObj | None, int, tuple[str, cf.ChunkHeader]]:
    """Read the chunk of ``key`` (or ``layers=(first, count)`` of it) into memory from ``allocate``.

    ``known`` is ``(digest, header)`` from an earlier read or write of this path: when the file's
    header bytes still hash to ``digest`` the header is not parsed again. Returns
    ``(obj, file_size, (digest, header))``; ``obj`` is ``None`` when ``allocate`` had no memory.
    Raises
    ``FileNotFoundError`` if there is no file, :class:`CorruptChunk` if the file is damaged,
    of another format version or holds another key, ``ValueError`` for a bad layer range."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
    try:
        st = os.fstat(fd)
        header = None
        if known is not None and known[1].file_size == st.st_size:
            need = known[1].header_bytes
            probe = _aligned_buffer("header", need)
            got = _io_all(os.preadv, fd, [probe[:need]], 0)
            if got == need and header_digest(probe[:need]) == known[0]:
                header, digest = known[1], known[0]
        if header is None:
            header, digest = _parse_header(fd, st)
        if header.key != key:
            raise CorruptChunk(f"file holds key {header.key}, not {key}", st.st_ino)
        first, count, meta = header.select(layers)
        obj = allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:
            return None, st.st_size, (digest, header)
        try:
            if count and header.layer_nbytes:
                dest = memoryview(obj.byte_view.numpy())
                pad = _aligned_buffer("pad", cf.ALIGN)
                offset, bufs = cf.read_buffers(header, dest, first, count, pad)
                want = sum(len(b) for b in bufs)
                if direct and (len(bufs) > 1 or (_address(obj) | want | offset) % cf.ALIGN):
                    _clear_direct(fd)  # unaligned: this read goes through the page cache
                if _io_all(os.preadv, fd, bufs, offset) != want:
                    raise CorruptChunk("file ended early (truncated while reading)", st.st_ino)
                if not cf.verify_layers(header, first, dest):
                    raise CorruptChunk("layer checksum mismatch", st.st_ino)
        except BaseException:
            obj.ref_down()
            raise
        return obj, st.st_size, (digest, header)
    finally:
        os.close(fd)


def header_digest(data) -> str:  # noqa: ANN001 - any buffer
    return xxhash.xxh3_128_hexdigest(data)


def _parse_header(fd: int, st: os.stat_result) -> tuple[cf.ChunkHeader, str]:
    try:
        probe = _aligned_buffer("probe", cf.HEADER_PROBE)
        got = _io_all(os.preadv, fd, [probe[: cf.HEADER_PROBE]], 0)
        need = cf.header_size(probe[: min(got, 8)])
        if need > got:
            big = _aligned_buffer("header", need)
            got = cf.HEADER_PROBE + _io_all(
                os.preadv, fd, [big[cf.HEADER_PROBE : need]], cf.HEADER_PROBE
            )
            big[: cf.HEADER_PROBE] = probe[: cf.HEADER_PROBE]
            probe = big
        header = cf.decode_header(probe[: min(got, need)], st.st_size)
    except ChunkFormatError as exc:
        raise CorruptChunk(str(exc), st.st_ino) from None
    return header, header_digest(probe[: header.header_bytes])


def _clear_direct(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
