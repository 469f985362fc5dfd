"""Atomic chunk-file writes, for every tier that writes files (posix, gds, fsspec's ``file://``).

A writer fills a temporary file in the final file's directory (:func:`~.names.temp_name`), then
renames it into place, so a reader in any process sees a whole file or none. With ``fsync`` the
file's data is flushed before the rename and the directory entry after it (and the entry of every
directory the write created, in its parent), so a store reported done survives a power cut. A
write that fails removes its temporary file; one that a crash cut short leaves a name
:func:`~.names.is_temp` recognises, which the tier's scan deletes once it is stale
(:func:`~.names.is_stale_temp`).

Cached KV reveals the prompts that made it, so files are private by default: the temporary file
is created here, ``0600`` (or the tier's ``file_mode``, exactly, whatever the umask, and its
``group``), and directories a write creates get the matching directory mode (``0700``). The
temporary file is created and renamed relative to its directory's descriptor; with
``no_follow`` that directory (a tier's shard) is never a symlink, so nothing is written outside
the tier's root.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .names import temp_name

#: chunk files: read and written by their owner only (the tier's ``file_mode`` widens it)
FILE_MODE = 0o600


def dir_mode_for(file_mode: int) -> int:
    """The mode of directories holding files of ``file_mode``: whoever may read (write) the files
    may also list (add to) the directory: 0600 -> 0700, 0640 -> 0750, 0660 -> 0770."""
    mode = 0o700
    for shift in (3, 0):  # group, others
        bits = (file_mode >> shift) & 0o7
        if bits:
            mode |= (bits | 0o1) << shift
    return mode


def fsync_path(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """fsync a file (any writer's data reaches the disk) or a directory (its entries do)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0) | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def discard_on_failure(tmp: str | os.PathLike[str]) -> Iterator[None]:
    """Remove the temporary file ``tmp`` if the block writing and renaming it fails, so a failed
    store never leaves a partial file behind (readers only ever see renamed, whole files)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def make_dirs(d: Path, mode: int, gid: int | None = None) -> list[Path]:
    """Create ``d`` and its missing ancestors with exactly ``mode`` (and group ``gid``); the
    directories created, deepest first. A directory that exists is left as it is."""
    missing: list[Path] = []
    while not os.path.lexists(d) and d.parent != d:
        missing.append(d)
        d = d.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, mode)
        except FileExistsError:  # another writer made it meanwhile: theirs, same rules
            continue
        set_mode(p, mode, gid)
    return missing


def set_mode(path: str | os.PathLike[str] | int, mode: int, gid: int | None = None) -> None:
    """Give a file (path or descriptor) kvplug just created exactly ``mode`` (the umask only
    narrows a create) and group ``gid``."""
    if isinstance(path, int):
        if gid is not None:
            os.fchown(path, -1, gid)
        os.fchmod(path, mode)  # after chown: a chown may clear set-id bits
    else:
        if gid is not None:
            os.chown(path, -1, gid, follow_symlinks=False)
        os.chmod(path, mode)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, fsync: bool = False, file_mode: int = FILE_MODE,
                gid: int | None = None, no_follow: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``, an empty file of ``file_mode`` (and group
    ``gid``) that the block opens for writing and fills (without ``O_EXCL``). On normal exit the
    file is (optionally fsynced and) renamed over ``path``, then the directory is fsynced, and
    with it the parent of each directory this call created; on any exception the temporary file
    is removed and the exception propagates.

    Missing directories are created with :func:`dir_mode_for` ``(file_mode)``. With
    ``no_follow`` the parent directory must not be a symlink (``OSError`` ``ELOOP``). ``OSError``
    (full disk, read-only directory...) reaches the caller, which decides whether that is a
    dropped store. :func:`directory_of` and :func:`atomic_create` are its two halves, for a
    writer that writes through the descriptor itself."""
    path = Path(path)
    with directory_of(path, fsync=fsync, file_mode=file_mode, gid=gid,
                      no_follow=no_follow) as dfd:
        name = temp_name(path.name)
        with atomic_create(dfd, path.name, fsync=fsync, file_mode=file_mode, gid=gid, tmp=name):
            yield path.parent / name


@contextlib.contextmanager
def directory_of(path: str | os.PathLike[str], *, fsync: bool = False,
                 file_mode: int = FILE_MODE, gid: int | None = None,
                 no_follow: bool = False) -> Iterator[int]:
    """A descriptor of the directory ``path`` goes in, for :func:`atomic_create`: created with
    its ancestors when missing (:func:`dir_mode_for` ``(file_mode)``, group ``gid``), never a
    symlink with ``no_follow`` (``OSError`` ``ELOOP``). Closed after the block; on its normal
    exit, with ``fsync``, the entry of each directory this call created is flushed in its
    parent (a store reported done survives a power cut)."""
    parent = os.path.dirname(os.fspath(path)) or "."  # (no pathlib: this runs on every store)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if no_follow else 0)
    created: list[Path] = []
    try:
        dfd = os.open(parent, flags)
    except FileNotFoundError:
        created = make_dirs(Path(parent), dir_mode_for(file_mode), gid)
        dfd = os.open(parent, flags)
    try:
        yield dfd
    finally:
        os.close(dfd)
    if fsync:
        for d in created:  # a directory this write created: its own entry, in its parent
            fsync_path(d.parent, directory=True)


@contextlib.contextmanager
def atomic_create(dfd: int, name: str, *, fsync: bool = False, file_mode: int = FILE_MODE,
                  gid: int | None = None, flags: int = 0, tmp: str | None = None
                  ) -> Iterator[int]:
    """Yield a descriptor, open for writing, of a new temporary file (``tmp``, else a fresh
    :func:`~.names.temp_name`) in the directory open as ``dfd``: exactly ``file_mode`` and group
    ``gid``, opened with ``flags`` added (``O_DIRECT``). On normal exit the file is (with
    ``fsync``) flushed, closed and renamed over ``name``, then (with ``fsync``) the directory is
    flushed; on any exception it is closed and removed, and the exception propagates. Never
    follows a link: the directory is the caller's, and the temporary name is created with
    ``O_EXCL | O_NOFOLLOW``."""
    tmp = tmp or temp_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags,
                 file_mode, dir_fd=dfd)
    try:
        try:
            set_mode(fd, file_mode, gid)  # exactly: the umask may have narrowed the create
            yield fd
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:  # never a partial file left behind (through the directory's fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    if fsync:
        os.fsync(dfd)
