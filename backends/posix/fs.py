"""Every file-system call of the posix tier under its root: no link followed, no open that can
block, nothing deleted or written outside the root.

Whoever can write the tier's directory (a shared cache, a group-writable root) may put a symlink,
a FIFO or a device where a chunk file or a shard directory should be. So a chunk path
``<root>/<shard>/<name>`` is never resolved as a whole: the shard directory is opened with
``O_DIRECTORY | O_NOFOLLOW`` and the file is opened, stat-ed or unlinked relative to that
descriptor (``openat``-style), with ``O_NOFOLLOW | O_NONBLOCK`` and an ``fstat`` that requires a
regular file. An entry that is a link, a FIFO or anything but a regular file raises
:class:`NotRegular` (a miss: counted, logged once, left in place); the root itself is the
operator's, resolved once at start. The flags and the regular-file check are
:mod:`kvplug.chunkfile.beneath`'s, the one rule every reader of such a directory follows.
"""

from __future__ import annotations

import errno
import os
import stat

from kvplug.chunkfile.beneath import DIR_FLAGS, READ_FLAGS, NotRegular, require_regular

__all__ = ["DIR_FLAGS", "READ_FLAGS", "NotRegular", "lstat_chunk", "open_chunk", "open_dir",
           "reopen", "require_regular", "touch_chunk", "touch_in", "unlink_chunk"]


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition(os.sep)
    return parent or os.sep, name


def open_dir(path: str) -> int:
    """A descriptor of the directory ``path``; :class:`NotRegular` if its last component is a
    symlink or not a directory, ``FileNotFoundError`` if it is missing."""
    try:
        return os.open(path, DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotRegular(exc.errno, "not a directory (a symlink or a file)", path) from None
        raise


def open_chunk(path: str, flags: int = 0) -> int:
    """Open the chunk file ``<root>/<shard>/<name>`` for reading (``flags`` added), neither the
    shard nor the file followed if a link, never blocking; a regular file or :class:`NotRegular`.
    ``FileNotFoundError`` if it is missing."""
    parent, name = _split(path)
    dfd = open_dir(parent)
    try:
        fd = os.open(name, READ_FLAGS | flags, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegular(exc.errno, "a symlink, not a chunk file", path) from None
        raise
    finally:
        os.close(dfd)
    return require_regular(fd, path)


def reopen(fd_path: str, flags: int = 0) -> int:
    """Open again a file this process holds (``/proc/self/fd/N``, a link by nature, so followed)
    for reading, never blocking; still checked to be a regular file."""
    return require_regular(os.open(fd_path, (READ_FLAGS & ~os.O_NOFOLLOW) | flags), fd_path)


def lstat_chunk(path: str) -> os.stat_result | None:
    """The ``stat`` of a chunk file, or None when it is missing or not a regular file (no link
    followed, the shard's included)."""
    parent, name = _split(path)
    try:
        dfd = open_dir(parent)
    except OSError:
        return None
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(dfd)
    return st if stat.S_ISREG(st.st_mode) else None


def unlink_chunk(path: str, ino: int | None = None) -> bool:
    """Delete the entry at a chunk path (a link itself, never its target) through its shard
    directory's descriptor, so nothing outside the root is ever deleted; with ``ino`` only if
    it is still that file. True if deleted; ``FileNotFoundError`` if it was gone, other
    ``OSError`` (a linked shard: :class:`NotRegular`) if it could not be."""
    parent, name = _split(path)
    dfd = open_dir(parent)
    try:
        if ino is not None and os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino != ino:
            return False
        os.unlink(name, dir_fd=dfd)
        return True
    finally:
        os.close(dfd)


def touch_chunk(path: str, stamp: float) -> None:
    """Set a chunk file's times to ``stamp`` (the LRU shared by processes), never through a link.
    ``FileNotFoundError`` if it is gone; other ``OSError`` (read-only...) as it comes."""
    parent, name = _split(path)
    dfd = open_dir(parent)
    try:
        touch_in(dfd, name, stamp)
    finally:
        os.close(dfd)


def touch_in(dir_fd: int, name: str, stamp: float) -> None:
    """:func:`touch_chunk` of the file ``name`` in the shard directory open as ``dir_fd``."""
    os.utime(name, (stamp, stamp), dir_fd=dir_fd, follow_symlinks=False)


def stat_in(dir_fd: int, name: str) -> os.stat_result | None:
    """The ``stat`` of the regular file ``name`` in the directory open as ``dir_fd`` (no link
    followed), or None when it is missing or not a regular file."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


class CachedOpener:
    """Opens chunk files below ``root`` without waiting on the file system: ``openat2`` with
    ``RESOLVE_CACHED`` (the path only from the kernel's lookup caches: ``EAGAIN`` where any I/O
    would be needed), ``RESOLVE_NO_SYMLINKS`` and ``RESOLVE_BENEATH`` (no link anywhere on the
    path, nothing outside the root), ``O_NONBLOCK``, then a regular file required. Linux 5.12+;
    where the kernel (or a seccomp filter) refuses it, nothing is opened (``None``) and reads
    take the bounded path."""

    #: ``openat2``'s number (the same on every Linux architecture) and its resolve flags
    SYS_OPENAT2 = 437
    RESOLVE = 0x04 | 0x08 | 0x20  # NO_SYMLINKS | BENEATH | CACHED

    def __init__(self, root: str) -> None:
        self._fd: int | None = None
        try:
            import ctypes

            self._fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            libc = ctypes.CDLL(None, use_errno=True)
            self._syscall = libc.syscall
            self._syscall.restype = ctypes.c_long
            self._get_errno = ctypes.get_errno
            how = (ctypes.c_uint64 * 3)(READ_FLAGS & ~os.O_NOFOLLOW, 0, self.RESOLVE)
            self._args = (ctypes.c_long(self.SYS_OPENAT2), ctypes.c_int(self._fd), None,
                          ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
            self._how = how
        except (OSError, AttributeError):
            self.close()

    def open(self, rel: str) -> tuple[int, os.stat_result] | None:
        """A descriptor of the regular file ``rel`` (relative to the root) opened without any
        wait, and its ``stat``; or None: not in the caches, missing, a link, not a regular
        file, or no ``openat2`` here (the bounded path then decides what it is)."""
        if self._fd is None:
            return None
        number, root, _, how, size = self._args
        fd = self._syscall(number, root, rel.encode(), how, size)
        if fd < 0:
            if self._get_errno() in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                self.close()  # no openat2 (or RESOLVE_CACHED) here: never asked again
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
