"""What of a buffer or a file the kernel holds in memory (``mincore``), and dropping a file from
the page cache until it is gone: for tests of the read paths that differ on a page-cache miss.

``mincore`` looks without reading, where a probe read would not: a ``RWF_NOWAIT`` read that
misses starts readahead, so a test that probed a dropped file could find it cached again by the
time it read it (it did, beside a busy neighbour).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from .waits import wait_until

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(address: int, nbytes: int) -> int:
    """How many of the pages spanning ``[address, address + nbytes)`` are in memory."""
    start = address // PAGE * PAGE
    end = address + nbytes
    vec = (ctypes.c_ubyte * ((end - start + PAGE - 1) // PAGE))()
    if _libc.mincore(start, end - start, vec):
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


def cached_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache: mapped and asked, never read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return 0
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            return resident_pages(address, size)
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def drop_from_page_cache(path: Path) -> None:
    """Write ``path``'s pages back and drop them (``POSIX_FADV_DONTNEED``, advice the kernel may
    defer while a page is busy), until none of them is cached."""
    def dropped() -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return cached_pages(path) == 0

    wait_until(dropped, f"{path} dropped from the page cache")
