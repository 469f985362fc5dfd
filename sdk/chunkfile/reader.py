"""Reading a chunk file's header through any byte source (a file descriptor, an object store).

Every reader (posix, gds, fsspec, ``kvplug inspect``) finds out what a file holds the same way:
read :data:`~.format.HEADER_PROBE` bytes, learn the header's length from the first eight, read the
rest if the header is longer (never past the file's size), then :func:`~.format.decode_header`
checks everything against the file's size. Sizes come from the header only after they are
bounded: the header's own length by the engine's geometry (``max_header``:
:func:`~.format.max_header_bytes` of its layers; ``MAX_HEADER`` without one) and the file's size
where it is known, before more than the probe is read or anything is parsed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ChunkFormatError
from .format import HEADER_PROBE, ChunkHeader, decode_header, header_size

if TYPE_CHECKING:  # pragma: no cover
    from .auth import Keyring

#: ``read(offset, length) -> bytes``: at most ``length`` bytes at ``offset`` (fewer at the end).
ReadAt = Callable[[int, int], bytes]


def read_header(read: ReadAt, file_size: int | None, auth: Keyring | None = None,
                max_header: int | None = None) -> tuple[ChunkHeader, bytes]:
    """The checked header of a chunk file and its raw bytes (with ``auth``, the tier's keyring:
    authenticated, see :func:`~.format.decode_header`; ``max_header``: the most header bytes
    read, see :func:`~.format.header_size`). Raises
    :class:`~kvplug.errors.ChunkFormatError` for a damaged, foreign, truncated or (with ``auth``)
    unauthenticated file."""
    probe = read(0, HEADER_PROBE)
    need = header_size(probe[:8], max_header)
    if file_size is not None and need > file_size:  # never read (or allocate) past the file
        raise ChunkFormatError(f"file of {file_size} bytes is shorter than its header ({need})")
    if need > len(probe) and len(probe) == HEADER_PROBE:
        probe = bytes(probe) + read(HEADER_PROBE, need - HEADER_PROBE)
    header = decode_header(probe[:need] if len(probe) >= need else probe, file_size, auth,
                           max_header)
    return header, bytes(probe[: header.header_bytes])


def read_header_fd(fd: int, file_size: int | None = None, auth: Keyring | None = None,
                   max_header: int | None = None) -> tuple[ChunkHeader, bytes]:
    """:func:`read_header` of an open file (its size from ``fstat`` unless given)."""
    if file_size is None:
        file_size = os.fstat(fd).st_size
    return read_header(lambda offset, length: os.pread(fd, length, offset), file_size, auth,
                       max_header)
