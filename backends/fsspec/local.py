"""The fsspec tier's ``file://`` store under the posix tier's rules: no link followed, no open
that can block, nothing written, read or deleted outside the root.

fsspec's own local filesystem resolves every path whole: a shard or namespace directory that a
writer of the directory replaced by a symlink sends writes, reads and deletes elsewhere, and a
FIFO named like a chunk blocks the I/O thread that opens it for good. So a ``file://`` tier does
not go through it: every object path ``<root>/<dir>/.../<name>`` is reached from the root's
descriptor one directory at a time (``O_DIRECTORY | O_NOFOLLOW``, missing ones created with the
tier's private mode), and the object is opened, stat-ed, renamed into place or unlinked relative
to its directory's descriptor, with the posix tier's flags (:mod:`kvplug.chunkfile.beneath`:
``O_NOFOLLOW | O_NONBLOCK`` and an ``fstat`` that requires a regular file). A link, a FIFO or anything but a
regular file where an object should be is a missing object (a miss, never opened, never
followed); the root is the operator's, resolved once at start.

Why keep ``file://`` rather than refuse it for the posix tier: the fsspec tier is how a directory
on a network filesystem is used as a remote tier (its loads never run inside the engine step,
unlike a ``local_medium`` tier's), and with these calls it has posix's defences; the posix tier
stays the one for a local disk (pins, shared LRU, quotas).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvplug import chunkfile as cf
from kvplug.chunkfile import beneath
from kvplug.chunkfile.atomic import FILE_MODE, atomic_create, dir_mode_for, make_dirs


class LocalFiles:
    """Objects under one local root, by the path the tier names them (``<root>/...``); every
    call raises ``FileNotFoundError`` for an object that is missing or is not a regular file."""

    def __init__(self, root: str, file_mode: int = FILE_MODE) -> None:
        self.file_mode = file_mode
        self.dir_mode = dir_mode_for(file_mode)
        self.prefix = root.rstrip("/")
        with contextlib.suppress(OSError):  # not creatable now: every store fails, counted
            make_dirs(Path(self.prefix), self.dir_mode)
        self.real = os.path.realpath(self.prefix)

    def _parts(self, path: str) -> tuple[list[str], str]:
        """The directories below the root and the name of object ``path``."""
        rel = path[len(self.prefix) + 1:] if path.startswith(self.prefix + "/") else ""
        parts = rel.split("/")
        if not rel or any(p in ("", ".", "..") for p in parts):
            raise FileNotFoundError(errno.ENOENT, "not an object under the tier's root", path)
        return parts[:-1], parts[-1]

    def _open(self, path: str) -> int:
        """A descriptor of object ``path`` for reading: a regular file, never blocking."""
        dirs, name = self._parts(path)
        try:
            return beneath.open_below(self.real, "/".join((*dirs, name)))
        except beneath.NotRegular:
            raise FileNotFoundError(errno.ENOENT, "a link or not a regular file", path) from None

    @contextlib.contextmanager
    def _dir(self, path: str, create: bool = False) -> Iterator[tuple[int, str]]:
        """``(descriptor of object path's directory, its name)``, the directory reached one at
        a time below the root (created, private, where ``create``)."""
        dirs, name = self._parts(path)
        try:
            with beneath.dir_below(self.real, dirs, self.dir_mode if create else None) as dfd:
                yield dfd, name
        except beneath.NotRegular:
            raise FileNotFoundError(errno.ENOENT, "a link or a file where a directory should "
                                    "be", path) from None

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes ``[start, end)`` (all of them by default)."""
        fd = self._open(path)
        try:
            size = os.fstat(fd).st_size
            begin = 0 if start is None else max(0, start)
            stop = size if end is None else min(end, size)
            out = bytearray()
            while begin + len(out) < stop:
                got = os.pread(fd, stop - begin - len(out), begin + len(out))
                if not got:
                    break
                out += got
            return bytes(out)
        finally:
            os.close(fd)

    def size(self, path: str) -> int | None:
        """The object's size, ``None`` when it is missing or not a regular file."""
        try:
            with self._dir(path) as (dfd, name):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def write(self, path: str, data: bytes) -> None:
        """The whole object, atomically (temporary name, rename), private (``file_mode``)."""
        with self._dir(path, create=True) as (dfd, name), \
                atomic_create(dfd, name, file_mode=self.file_mode) as fd:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]

    def remove(self, path: str) -> None:
        """Delete the entry (a link itself, never its target; nothing outside the root)."""
        with self._dir(path) as (dfd, name):
            os.unlink(name, dir_fd=dfd)

    def _walk(self) -> Iterator[tuple[str, str, int, os.stat_result]]:
        """``(directory path, name, directory fd, stat)`` of every regular file below the root,
        no link followed."""
        for top, name, dfd, st in beneath.entries_below(self.real):
            if stat.S_ISREG(st.st_mode):
                yield top, name, dfd, st

    def find(self) -> dict[str, dict[str, Any]]:
        """Every regular file below the root: ``{path: {"size", "mtime"}}`` (paths as the tier
        names them)."""
        return {self.prefix + os.path.join(top, name)[len(self.real):]:
                {"size": st.st_size, "mtime": st.st_mtime} for top, name, _dfd, st in self._walk()}

    def remove_stale_temps(self) -> int:
        """Delete the temporary files that writers killed mid-write left below the root (older
        than ``chunkfile.TEMP_MAX_AGE_S``: no live write takes that long); how many."""
        now = time.time()
        removed = 0
        for _top, name, dfd, st in self._walk():
            if cf.is_stale_temp(name, st.st_mtime, now):
                with contextlib.suppress(OSError):  # removed by another process meanwhile
                    os.unlink(name, dir_fd=dfd)
                    removed += 1
        return removed
