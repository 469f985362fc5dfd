"""Atomic chunk-file writes, for every tier that writes files (posix, gds, fsspec's ``file://``).

A writer fills a temporary file in the final file's directory (:func:`~.names.temp_name`), then
renames it into place, so a reader in any process sees a whole file or none. With ``fsync`` the
file's data is flushed before the rename and the directory entry after it (and the entry of every
directory the write created, in its parent), so a store reported done survives a power cut. A
write that fails removes its temporary file; one that a crash cut short leaves a name
:func:`~.names.is_temp` recognises, which the tier's scan deletes once it is stale
(:func:`~.names.is_stale_temp`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .names import temp_name


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


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; the block writes the whole file there. On normal
    exit the file is (optionally fsynced and) renamed over ``path``, then the directory is
    fsynced, and with it the parent of each directory this call created; on any exception the
    temporary file is removed and the exception propagates.

    The parent directory is created if missing. ``OSError`` (full disk, read-only directory...)
    reaches the caller, which decides whether that is a dropped store."""
    path = Path(path)
    tmp = path.parent / temp_name(path.name)
    created = _missing_dirs(path.parent) if fsync else []
    path.parent.mkdir(parents=True, exist_ok=True)
    with discard_on_failure(tmp):
        yield tmp
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, path)
    if fsync:
        fsync_path(path.parent, directory=True)
        for d in created:  # a directory this write created: its own entry, in its parent
            fsync_path(d.parent, directory=True)


def _missing_dirs(d: Path) -> list[Path]:
    """``d`` and its ancestors that do not exist yet, deepest first."""
    out: list[Path] = []
    while not d.exists() and d.parent != d:
        out.append(d)
        d = d.parent
    return out
