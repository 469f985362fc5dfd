"""Pins that hold across processes: a pinned chunk file is kept open until its last unpin.

Other processes sharing the directory do not know this process's pins and may delete (evict) a
pinned file. An unlinked file stays readable through a descriptor that is still open, so every
pinned file is held open and reads of a pinned key go through that descriptor (reopened as
``/proc/self/fd/N``: a fresh open file of the same inode, usable by any reader, kvikio included).

Descriptors are bounded (``limit``): past the bound a pin is still taken, but only in this process
(this process never evicts it; another one may), counted as ``pins_without_fd``. Files are opened
by the owner's ``opener`` (never following a link, never blocking: :mod:`.fs`) and never under
this class's lock, so a slow or hostile entry cannot stall every other pin and unpin.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable

_FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


def fd_path(fd: int) -> str:
    """A path that opens the file behind ``fd`` again (even after it was unlinked)."""
    return f"{_FD_DIR}/{fd}"


def fd_limit(wanted: int) -> int:
    """``wanted``, but at most a quarter of this process's descriptor limit."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return wanted
    return wanted if soft == resource.RLIM_INFINITY else min(wanted, max(soft // 4, 0))


class HeldFiles:
    """Open descriptors of pinned chunk files, by relative path, with a pin count each.

    ``opener(rel)`` opens the file of ``rel`` for reading: a descriptor, or None when there is
    no usable file (missing, or not a regular file); other ``OSError`` (EMFILE...) is a pin
    without a descriptor."""

    def __init__(self, limit: int, opener: Callable[[str], int | None]) -> None:
        self.limit = limit
        self._open = opener
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self.without_fd = 0  # pins taken past the bound (or when an open failed)

    def _try_open(self, rel: str) -> tuple[bool, int | None]:
        """Outside the lock: ``(usable, fd)`` for ``rel`` if it is not held and there is room
        (``fd`` None: not opened, past the bound or the open failed)."""
        with self._lock:
            if rel in self._fds or len(self._fds) >= self.limit:
                return True, None
        try:
            fd = self._open(rel)
        except OSError:  # EMFILE, ENFILE...: a pin of this process only
            return True, None
        return fd is not None, fd

    def _keep(self, rel: str, fd: int | None) -> int | None:
        """Under the lock: hold ``fd`` for ``rel``; the descriptor to close (one held already,
        by a racing pin, or none)."""
        if rel in self._fds:
            return fd
        if fd is None or len(self._fds) >= self.limit:
            self.without_fd += 1
            return fd
        self._fds[rel] = fd
        return None

    def hold(self, rel: str, path: str | None) -> bool:
        """Count one pin of ``rel`` and open its file if it is not held yet (``path`` ``None``:
        the file is still being written; :meth:`attach` opens it when it lands). False,
        counting nothing, when the file is gone or not a regular file."""
        fd = None
        if path is not None:
            usable, fd = self._try_open(rel)
            if not usable:
                return False
        with self._lock:
            extra = self._keep(rel, fd) if path is not None else None
            self._counts[rel] = self._counts.get(rel, 0) + 1
        if extra is not None:
            os.close(extra)
        return True

    def waits_for(self, rel: str) -> bool:
        """Whether a pin of ``rel`` waits for its file (pinned, not held, room to hold it): the
        writer opens a file it just wrote only then (:meth:`attach`)."""
        with self._lock:
            return rel in self._counts and rel not in self._fds and len(self._fds) < self.limit

    def attach(self, rel: str, fd: int | None) -> bool:
        """The file of a key that may have been pinned while it was written just landed,
        opened as ``fd`` by the writer: hold it if ``rel`` is pinned and not held yet (and
        there is room). False: not taken (the caller closes ``fd``). No I/O, so the writer
        calls it under its tier lock, atomically with the pin's look at the write queue."""
        with self._lock:
            if (fd is not None and rel in self._counts and rel not in self._fds
                    and len(self._fds) < self.limit):
                self._fds[rel] = fd
                return True
            return False

    def release(self, rel: str) -> None:
        """One pin of ``rel`` released; the last one closes its descriptor."""
        with self._lock:
            left = self._counts.get(rel, 0) - 1
            if left > 0:
                self._counts[rel] = left
                return
            self._counts.pop(rel, None)
            fd = self._fds.pop(rel, None)
        if fd is not None:
            os.close(fd)

    def drop(self, rel: str) -> None:
        """Stop holding ``rel``'s file (it was found damaged); its pins stay counted."""
        with self._lock:
            fd = self._fds.pop(rel, None)
        if fd is not None:
            os.close(fd)

    def dup(self, rel: str) -> int | None:
        """A private duplicate of ``rel``'s held descriptor (the caller closes it), or None.
        Duplicated under the lock, so an unpin cannot close it and reuse its number meanwhile;
        with no file held (the usual case) None without the lock: the emptiness read is what a
        look under it would have seen at that instant, and no descriptor is touched."""
        if not self._fds:
            return None
        with self._lock:
            fd = self._fds.get(rel)
            return None if fd is None else os.dup(fd)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            self._counts.clear()
        for fd in fds:
            os.close(fd)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"pinned_fds": len(self._fds), "pins_without_fd": self.without_fd}
