"""Opening files below a root that others may write: no link followed, no open that can block.

Whoever can write a chunk directory (a shared cache, a group-writable root) may put a symlink, a
FIFO or a device where a chunk file or a directory should be. So a path below the root is never
resolved whole: each directory is opened relative to its parent's descriptor with ``O_DIRECTORY |
O_NOFOLLOW``, and a file relative to its directory's with ``O_NOFOLLOW | O_NONBLOCK`` and an
``fstat`` that requires a regular file. The root itself is the operator's (resolved as given).
Every reader of such a directory uses these: the posix and gds tiers (``backends/posix/fs.py``),
fsspec's ``file://`` store and ``kvplug inspect``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence

#: how a file below the root is opened for reading
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: how a directory below the root is opened (a symlink there fails with ELOOP)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegular(OSError):
    """The entry at a path (or a directory on the way) is not a regular file (directory): a
    symlink, a FIFO, a socket, a device. Never opened for I/O, never followed."""


def require_regular(fd: int, path: str) -> int:
    """``fd`` if it is a regular file; else closes it and raises :class:`NotRegular`."""
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(errno.EINVAL, f"not a regular file ({stat.filemode(mode)})", path)
    return fd


def open_subdir(fd: int, name: str, create_mode: int | None = None) -> int:
    """A descriptor of directory ``name`` in the directory open as ``fd``, never through a link
    (:class:`NotRegular` for a link or a file there); created with exactly ``create_mode`` where
    given and missing, else ``FileNotFoundError``."""
    made = False
    try:
        try:
            sub = os.open(name, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if create_mode is None:
                raise
            try:
                os.mkdir(name, create_mode, dir_fd=fd)
                made = True
            except FileExistsError:  # another writer made it meanwhile
                pass
            sub = os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotRegular(exc.errno, "not a directory (a symlink or a file)", name) from None
        raise
    if made:
        os.fchmod(sub, create_mode)  # exactly: the umask may have narrowed the mkdir
    return sub


@contextlib.contextmanager
def dir_below(root: str, dirs: Sequence[str], create_mode: int | None = None) -> Iterator[int]:
    """A descriptor of ``root/dirs[0]/dirs[1]/...``, reached one directory at a time (see
    :func:`open_subdir`), closed when the block ends."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in dirs:
            sub = open_subdir(fd, name, create_mode)
            os.close(fd)
            fd = sub
        yield fd
    finally:
        os.close(fd)


def open_below(root: str, rel: str) -> int:
    """A descriptor of the regular file ``root/rel`` (``/``-separated) for reading: no link
    followed on the way or at the end, never blocking; :class:`NotRegular` otherwise."""
    *dirs, name = rel.split("/")
    if not name or any(part in ("", ".", "..") for part in (*dirs, name)):
        raise NotRegular(errno.EINVAL, "not a path below the root", rel)
    with dir_below(root, dirs) as dfd:
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotRegular(exc.errno, "a symlink, not a file", rel) from None
            raise
    return require_regular(fd, rel)
