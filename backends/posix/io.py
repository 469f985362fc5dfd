"""File I/O of the posix tier: atomic chunk writes and vectored reads straight into memory objects.

Writes go through :func:`kvplug.chunkfile.atomic.atomic_create` (temporary name, rename, optional
fsync, all through the shard directory's descriptor), so a reader in this or another process
sees a whole file or none. Reads use ``os.preadv`` into
the destination object's memory (no intermediate ``bytes``), then verify every layer checksum.
O_DIRECT is used where it was asked for, the file system accepts it and the buffers are aligned;
otherwise the same call goes through the page cache. Headers are decoded by the chunk-file
library; this module only feeds it page-aligned buffers (what O_DIRECT needs). :class:`ChunkFileIO`
is the tier's part that uses them, with the header cache shared by every remote tier
(:class:`~kvplug.backends.common.chunks.HeaderCache`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from kvplug import chunkfile as cf
from kvplug.chunkfile.atomic import FILE_MODE, atomic_create, dir_mode_for, directory_of, make_dirs
from kvplug.errors import ChunkFormatError, ChunkVersionError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

from ..common.chunks import HeaderCache
from . import fs

logger = logging.getLogger("kvplug.backends.posix")

O_DIRECT = getattr(os, "O_DIRECT", 0)
RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
#: ``statfs`` types of file systems held in memory (tmpfs, ramfs): a read there never waits on a
#: device, and the kernel refuses ``RWF_NOWAIT`` on them (EOPNOTSUPP)
MEMORY_FILE_SYSTEMS = (0x01021994, 0x858458F6)
IOV_MAX = 1024
_local = threading.local()
_UNKNOWN = object()

#: ``(the parsed header, the header's bytes)`` of one chunk file, as
#: :meth:`kvplug.backends.common.chunks.HeaderCache.known` keeps them.
Known = tuple[cf.ChunkHeader, bytes]


class CorruptChunk(Exception):
    """A chunk file that exists but must not be used; ``ino`` identifies the file that was read."""

    def __init__(self, reason: str, ino: int) -> None:
        super().__init__(reason)
        self.ino = ino


class ForeignChunk(CorruptChunk):
    """A chunk file of another format version (a node before or after an upgrade wrote it):
    a miss, but never deleted by this version."""


def _aligned_buffer(name: str, size: int) -> memoryview:
    """A per-thread, page-aligned scratch buffer of at least ``size`` bytes."""
    buf = getattr(_local, name, None)
    if buf is None or len(buf) < size:
        buf = memoryview(mmap.mmap(-1, cf.align_up(max(size, cf.ALIGN))))
        setattr(_local, name, buf)
    return buf


def _address(obj: MemoryObj) -> int:
    return obj.tensor.data_ptr()


def _io_all(op: Callable, fd: int, bufs: Sequence[memoryview], offset: int,
            flags: int = 0, size: int | None = None) -> int:
    """Run ``os.pwritev``/``os.preadv`` until every buffer is done; returns bytes moved (one
    call in the usual case: up to ``IOV_MAX`` buffers, moved whole). ``flags``: a read's
    ``RWF_*`` flags (``RWF_NOWAIT``: ``BlockingIOError`` where it would wait); ``size``: the
    buffers' total length where the caller knows it (one call that moves it all is then the
    whole of the work: the lengths are not added up).

    A read that hits end of file stops early (the caller compares the count)."""
    if size is not None and len(bufs) <= IOV_MAX:
        n = op(fd, bufs, offset, flags) if flags else op(fd, bufs, offset)
        if n == size:
            return n
        if n <= 0:  # nothing moved: the general loop says what that is (end of file, EIO)
            return _io_all(op, fd, bufs, offset, flags)
        return n + _io_all(op, fd, _after(bufs, n), offset + n, flags)  # the rest
    total = 0
    while bufs:
        batch, bufs = bufs[:IOV_MAX], bufs[IOV_MAX:]
        want = sum(len(b) for b in batch)
        while want:
            n = op(fd, batch, offset, flags) if flags else op(fd, batch, offset)
            if n <= 0:
                if op is os.pwritev:
                    raise OSError(errno.EIO, "pwritev wrote nothing")
                return total
            total += n
            offset += n
            want -= n
            if want:
                batch = _after(batch, n)
    return total


def _after(bufs: Sequence[memoryview], n: int) -> list[memoryview]:
    """What is left of ``bufs`` once their first ``n`` bytes are moved."""
    rest: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        rest.append(memoryview(b)[n:] if n else b)
        n = 0
    return rest


def writable_dir(root: Path, file_mode: int = FILE_MODE, gid: int | None = None) -> str | None:
    """Create ``root`` if missing (exactly the directory mode of ``file_mode``: 0700 by default,
    and group ``gid``); ``None`` if stores can go there, else why not."""
    try:
        make_dirs(root, dir_mode_for(file_mode), gid)
    except OSError as exc:
        return f"cannot create {root} ({exc}): stores are disabled"
    if not root.is_dir():
        return f"{root} is not a directory: stores are disabled"
    if not os.access(root, os.W_OK):
        return f"directory {root} is not writable: stores are dropped, loads go on"
    return None


def wider_than(root: Path, file_mode: int) -> str | None:
    """Why an existing ``root`` is more open than ``file_mode`` asks (other users may list it
    or reach files in it), with the fix; None if it is not. kvplug never chmods a directory it
    did not create: the operator decides."""
    try:
        have = stat.S_IMODE(root.stat().st_mode)
    except OSError:
        return None
    want = dir_mode_for(file_mode)
    if not have & 0o077 & ~want:
        return None
    return (f"directory {root} is mode {have:04o}, wider than {want:04o} (file_mode "
            f"{file_mode:04o}): other local users may list it and read chunk files there (cached "
            f"KV reveals prompts); run `chmod {want & 0o777:o} {root}`, or set file_mode and group "
            "for a directory shared by one group")


def probe_o_direct(root: Path) -> str | None:
    """``None`` if O_DIRECT writes and reads work in ``root``, else why they do not."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    path = root / cf.temp_name("odirect-probe")
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


def nowait_read_flags(fd: int) -> int | None:
    """The ``preadv`` flags with which a read of ``fd``'s file system never waits:
    ``RWF_NOWAIT`` where the kernel honours it (a page-cache miss is ``BlockingIOError``), 0 on
    a file system held in memory; ``None`` where neither holds (no read can promise it)."""
    if not RWF_NOWAIT:
        return None
    try:
        os.preadv(fd, [bytearray(1)], 0, RWF_NOWAIT)
    except BlockingIOError:
        pass  # honoured: that byte was not cached
    except OSError as exc:
        if exc.errno != errno.EOPNOTSUPP:
            return None
        return 0 if _fs_type(fd) in MEMORY_FILE_SYSTEMS else None
    return RWF_NOWAIT


def _fs_type(fd: int) -> int | None:
    """``fstatfs``'s ``f_type`` of ``fd`` (its first field), or None."""
    try:
        buf = ctypes.create_string_buffer(512)  # larger than any struct statfs
        if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value
    except (OSError, AttributeError):
        return None


def direct_io_usable(root: Path, tier: str) -> bool:
    """Whether O_DIRECT works in ``root`` (:func:`probe_o_direct`); warns why not."""
    why = probe_o_direct(root)
    if why:
        logger.warning("tier %r: O_DIRECT is not supported in %s (%s); using buffered I/O "
                       "through the page cache", tier, root, why)
    return why is None


def write_chunk(
    path: Path | str,
    obj: MemoryObj,
    header: bytes,
    bufs: list[memoryview],
    *,
    fsync: bool = False,
    direct: bool = False,
    file_mode: int = FILE_MODE,
    gid: int | None = None,
    dir_fd: int | None = None,
    size: int | None = None,
) -> int:
    """Write a chunk (``header, bufs = chunkfile.encode_chunk(key, obj)``) at ``path``
    atomically; returns the file size. ``obj`` must stay referenced until this returns. The file
    gets ``file_mode`` and group ``gid``; a shard directory that is a symlink is refused.
    ``dir_fd``: the shard directory, open already (:func:`kvplug.chunkfile.atomic.directory_of`);
    the file is then created, written and renamed through it and the descriptor of its
    temporary file, the layers written from the object's own memory in one ``pwritev``.
    ``size``: the file's size (the header's and every buffer's bytes), where the caller knows it.

    Raises ``OSError`` (full disk, read-only directory...) after removing the temporary file."""
    if dir_fd is None:
        with directory_of(path, fsync=fsync, file_mode=file_mode, gid=gid, no_follow=True) as dfd:
            return write_chunk(path, obj, header, bufs, fsync=fsync, direct=direct,
                               file_mode=file_mode, gid=gid, dir_fd=dfd, size=size)
    if size is None:
        size = len(header) + sum(len(b) for b in bufs)
    flags = 0
    if direct and all(len(b) % cf.ALIGN == 0 and _view_address(b) % cf.ALIGN == 0 for b in bufs):
        flags = O_DIRECT  # every buffer aligned (the layers of an aligned object, unpadded)
        head = _aligned_buffer("header", len(header))[: len(header)]
        head[:] = header
        header = head
    with atomic_create(dir_fd, os.path.basename(path), fsync=fsync, file_mode=file_mode,
                       gid=gid, flags=flags) as fd:
        _io_all(os.pwritev, fd, [memoryview(header), *bufs], 0, size=size)
    return size


def _view_address(view: memoryview) -> int:
    """The address of a buffer's first byte (for the alignment O_DIRECT needs)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only (padding from a bytes object), or empty
        return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def _aligned_reader(fd: int, flags: int = 0) -> Callable[[int, int], memoryview]:
    """``read(offset, length)`` of ``fd`` into this thread's page-aligned buffer (O_DIRECT-safe
    for the aligned offsets and lengths a header read asks for), ``preadv`` flags ``flags``."""

    def read(offset: int, length: int) -> memoryview:
        buf = _aligned_buffer("header", offset + length)
        got = _io_all(os.preadv, fd, [buf[offset : offset + length]], offset, flags)
        return buf[offset : offset + got]

    return read


def read_checked_header(fd: int, st: os.stat_result, key: CacheKey,
                        known: Known | None = None, auth: cf.Keyring | None = None,
                        max_header: int | None = None, read_flags: int = 0) -> Known:
    """``(header, its bytes)`` of the open chunk file ``fd``, checked to hold ``key``. ``known``
    from an earlier read or write of the same path is reused when the file still starts with
    exactly its bytes (the parse is a pure function of them); a header longer than
    ``max_header`` (the engine's, ``ctx.header_limit``) is corrupt before it is read. Raises
    :class:`CorruptChunk` for a damaged file or one of another key, :class:`ForeignChunk` for one
    of another format version."""
    if known is not None and known[0].file_size == st.st_size:
        # bytes == bytes is a memcmp (a memoryview compared with bytes goes item by item)
        if bytes(_aligned_reader(fd, read_flags)(0, len(known[1]))) == known[1]:
            header, raw = known
            return _check_key(header, raw, key, auth, st.st_ino)
    try:
        header, raw = cf.read_header(_aligned_reader(fd, read_flags), st.st_size, auth,
                                     max_header)
    except ChunkVersionError as exc:
        raise ForeignChunk(str(exc), st.st_ino) from None
    except ChunkFormatError as exc:
        raise CorruptChunk(str(exc), st.st_ino) from None
    return _check_key(header, raw, key, auth, st.st_ino)


def _check_key(header: cf.ChunkHeader, raw: bytes, key: CacheKey, auth: cf.Keyring | None,
               ino: int) -> Known:
    if not cf.holds(header, key, auth):
        raise CorruptChunk(f"file holds key {header.key}, not {key}", ino)
    return header, raw


def _bytes_of(obj: MemoryObj) -> memoryview:
    """The object's memory as a flat byte view: the one its allocator keeps with the buffer
    (:attr:`~kvplug.memory.MemoryObj.flat_bytes`), else a uint8 tensor's numpy view (no torch
    views)."""
    flat = obj.flat_bytes
    if flat is not None:
        return flat
    t = obj.tensor
    if t.dtype == torch.uint8 and t.is_contiguous():
        return memoryview(t.numpy()).cast("B")
    return memoryview(obj.byte_view.numpy())


def read_chunk(
    fd: int,
    key: CacheKey,
    allocate: Callable[..., MemoryObj | None],
    layers: tuple[int, int] | None = None,
    *,
    direct: bool = False,
    known: Known | None = None,
    auth: cf.Keyring | None = None,
    max_header: int | None = None,
    read_flags: int = 0,
) -> tuple[MemoryObj | None, int, Known]:
    """Read the chunk of ``key`` (or ``layers=(first, count)`` of it) from the open chunk file
    ``fd`` (:func:`.fs.open_chunk`; the caller closes it, and must not share its open file
    description: ``direct`` sets ``O_DIRECT`` on it) into memory from ``allocate``, every
    ``preadv`` with ``read_flags`` (``RWF_NOWAIT``: ``BlockingIOError`` rather than a wait).

    ``known`` is ``(header, its bytes)`` from an earlier read or write of this path, and
    ``max_header`` the longest header read (see :func:`read_checked_header`): where the file is
    still its size and the read starts at layer 0, the header and the layers are read in one
    call (:func:`_read_in_one`). Returns ``(obj, file_size, (header, its bytes))``; ``obj`` is
    ``None`` when ``allocate`` had no memory. Raises :class:`CorruptChunk` if the file is damaged
    or holds another key (:class:`ForeignChunk`: of another format version), ``ValueError`` for
    a bad layer range."""
    if direct:
        _set_direct(fd, True)
    st = os.fstat(fd)
    if known is not None and known[0].file_size == st.st_size and (layers is None or
                                                                   layers[0] == 0):
        done = _read_in_one(fd, st, key, allocate, layers, direct, known, auth, read_flags)
        if done is not None:
            return done
        known = None  # the file starts with other bytes now: parsed again
    known = read_checked_header(fd, st, key, known, auth, max_header, read_flags)
    header = known[0]
    first, count, meta = header.select(layers)
    obj = allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
    if obj is None:
        return None, st.st_size, known
    try:
        if count and header.layer_nbytes:
            dest = _bytes_of(obj)
            pad = _aligned_buffer("pad", cf.ALIGN)
            offset, bufs = cf.read_buffers(header, dest, first, count, pad)
            want = sum(len(b) for b in bufs)
            if direct and (len(bufs) > 1 or (_address(obj) | want | offset) % cf.ALIGN):
                _set_direct(fd, False)  # unaligned: this read goes through the page cache
            if _io_all(os.preadv, fd, bufs, offset, read_flags, size=want) != want:
                raise CorruptChunk("file ended early (truncated while reading)", st.st_ino)
            if not cf.verify_layers(header, first, dest):
                raise CorruptChunk("layer checksum mismatch", st.st_ino)
    except BaseException:
        obj.ref_down()
        raise
    return obj, st.st_size, known


def _read_in_one(fd: int, st: os.stat_result, key: CacheKey,
                 allocate: Callable[..., MemoryObj | None], layers: tuple[int, int] | None,
                 direct: bool, known: Known, auth: cf.Keyring | None,
                 read_flags: int = 0) -> tuple[MemoryObj | None, int, Known] | None:
    """:func:`read_chunk` of layers from 0 with the header ``known``: one ``preadv`` of the
    header (into scratch memory) and the layers (straight into the object), then the header
    bytes compared with ``known``'s and every layer read verified while its bytes are still in
    the cache. ``None`` (nothing kept) when the file starts with other bytes now: the caller
    parses it again."""
    header, raw = known
    _check_key(header, raw, key, auth, st.st_ino)
    _, count, meta = header.select(layers)
    if header.header_bytes != len(raw):
        return None
    obj = allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
    if obj is None:
        return None, st.st_size, known
    try:
        head = _aligned_buffer("header", len(raw))[: len(raw)]
        bufs = [head]
        dest = None
        if count and header.layer_nbytes:
            dest = _bytes_of(obj)
            _, layer_bufs = cf.read_buffers(header, dest, 0, count, _aligned_buffer("pad", cf.ALIGN))
            bufs += layer_bufs
        want = sum(len(b) for b in bufs)
        if direct and (len(bufs) > 2 or (_address(obj) | want) % cf.ALIGN):
            _set_direct(fd, False)  # unaligned: this read goes through the page cache
        got = _io_all(os.preadv, fd, bufs, 0, read_flags, size=want)
        stale = got < len(raw) or bytes(head) != raw  # bytes == bytes: one memcmp
        if not stale and got != want:
            raise CorruptChunk("file ended early (truncated while reading)", st.st_ino)
        if not stale and dest is not None and not cf.verify_layers(header, 0, dest):
            raise CorruptChunk("layer checksum mismatch", st.st_ino)
    except BaseException:
        obj.ref_down()
        raise
    if stale:
        obj.ref_down()
        return None
    return obj, st.st_size, known


class ChunkFileIO:
    """How the posix tier moves one chunk's bytes between memory and its file: :func:`write_chunk`
    and :func:`read_chunk` (vectored, O_DIRECT where ``direct``), with the header of every file it
    wrote or read kept in a :class:`~kvplug.backends.common.chunks.HeaderCache` by relative path
    (a file that still starts with the same bytes is not parsed again); ``header_limit()`` is
    the longest header read (``ctx.header_limit``). The gds tier's
    :class:`kvplug.backends.gds.io.KvikioFileIO` moves the bytes through kvikio instead."""

    def __init__(self, allocate: Callable[..., MemoryObj | None], auth: cf.Keyring | None, *,
                 fsync: bool = False, direct: bool = False, file_mode: int = FILE_MODE,
                 gid: int | None = None,
                 header_limit: Callable[[], int | None] = lambda: None) -> None:
        self.allocate = allocate
        self.auth = auth
        self.header_limit = header_limit
        self.fsync, self.direct, self.file_mode, self.gid = fsync, direct, file_mode, gid
        self.headers = HeaderCache()
        self._nowait: int | None | object = _UNKNOWN  # read flags that never wait

    def prepare_write(self, key: CacheKey, rel: str,
                      obj: MemoryObj) -> tuple[int, Callable[[str, int | None], int]]:
        """The file's size and a function ``write_file(path, dir_fd)`` that writes it at a path
        (through its shard directory's descriptor ``dir_fd`` where the caller holds it open:
        :func:`write_chunk`); it returns the bytes written."""
        header, bufs, head = cf.encode_chunk_with_header(key, obj, self.auth)

        def write_file(path: str, dir_fd: int | None = None) -> int:
            written = write_chunk(path, obj, header, bufs, fsync=self.fsync, direct=self.direct,
                                  file_mode=self.file_mode, gid=self.gid, dir_fd=dir_fd,
                                  size=head.file_size)
            self.headers.put(rel, head, bytes(header))
            return written

        return head.file_size, write_file

    def read(self, fd: int, key: CacheKey, rel: str,
             layers: tuple[int, int] | None) -> tuple[MemoryObj | None, int]:
        """:func:`read_chunk` of the open file ``fd`` (a private open file description) of
        ``rel``: ``(obj or None when memory is full, file size)``; raises as it does."""
        obj, size, (header, raw) = read_chunk(fd, key, self.allocate, layers, direct=self.direct,
                                              known=self.headers.known(rel), auth=self.auth,
                                              max_header=self.header_limit())
        self.headers.put(rel, header, raw)
        return obj, size

    def read_nowait(self, fd: int, key: CacheKey, rel: str,
                    st: os.stat_result | None = None) -> tuple[MemoryObj | None, int] | None:
        """:meth:`read` of the whole chunk with no read that waits (:func:`nowait_read_flags`,
        learned from the first file), of a file whose header is known and still its first
        bytes (one ``preadv``: :func:`_read_in_one`; nothing parsed). ``None`` where that does
        not hold, or the file system cannot promise it (or with O_DIRECT, whose reads always
        wait on the device); ``BlockingIOError`` where a read would wait;
        :class:`CorruptChunk` for a damaged file. ``st``: ``fd``'s ``fstat``, where known."""
        known = self.headers.known(rel)
        if self.direct or known is None:  # a header is parsed (and judged) by a bounded read
            return None
        if self._nowait is _UNKNOWN:
            self._nowait = nowait_read_flags(fd)
        if self._nowait is None:
            return None
        st = st or os.fstat(fd)
        if known[0].file_size != st.st_size:
            return None
        done = _read_in_one(fd, st, key, self.allocate, None, False, known, self.auth,
                            self._nowait)
        return None if done is None else (done[0], done[1])

    def forget(self, rel: str) -> None:
        """The file of ``rel`` is gone or unusable: its header is not reused."""
        self.headers.pop(rel)

    def problem(self, path: str, rel: str) -> str | None:
        """Why the file at ``path`` (``rel`` under the root) is not a chunk of this tier: not a
        regular file, a header that fails its checks (with the keyring, its MAC), or — without a
        keyring, where names follow keys — a key that is not its name's; ``None`` when it is
        one, or when there is no file."""
        try:
            fd = fs.open_chunk(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return exc.strerror or str(exc)
        try:
            header, _ = cf.read_header_fd(fd, None, self.auth, self.header_limit())
        except ChunkFormatError as exc:
            return str(exc)
        finally:
            os.close(fd)
        if self.auth is None and cf.relative_chunk_path(header.key) != rel:
            return "it holds another key than its name's"
        return None


def layer_range_copy(obj: MemoryObj, layers: tuple[int, int],
                     allocate: Callable[..., MemoryObj | None]) -> MemoryObj | None:
    """Layers ``[first, first + n)`` of a ``KV_PAGES`` chunk copied into ``allocate`` memory;
    ``None`` for a range the chunk does not have or no memory."""
    first, n = layers
    if first < 0 or n < 1 or first + n > obj.tensor.shape[0]:
        return None
    src = obj.tensor[first:first + n]
    out = allocate(tuple(src.shape), src.dtype, obj.meta.fmt, obj.num_tokens)
    if out is not None:
        out.tensor.copy_(src)
    return out


def remove_if_same(path: str, ino: int) -> None:
    """Delete ``path`` if it is still the file (inode ``ino``) that was read; a file written
    there since, or none, is left alone (through its shard's descriptor: :mod:`.fs`)."""
    try:
        fs.unlink_chunk(path, ino)
    except OSError:
        pass


def _set_direct(fd: int, on: bool) -> None:
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | O_DIRECT) if on else (flags & ~O_DIRECT))
