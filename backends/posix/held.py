"""Pins that hold across processes: a pinned chunk file is kept open until its last unpin.

Other processes sharing the directory do not know this process's pins and may delete (evict) a
pinned file. An unlinked file stays readable through a descriptor that is still open, so every
pinned file is held open and reads of a pinned key go through that descriptor (reopened as
``/proc/self/fd/N``: a fresh open file of the same inode, usable by any reader, kvikio included).

Descriptors are bounded (``limit``): past the bound a pin is still taken, but only in this process
(this process never evicts it; another one may), counted as ``pins_without_fd``.
"""

from __future__ import annotations

import os
import resource
import threading

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
    """Open descriptors of pinned chunk files, by relative path, with a pin count each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self.without_fd = 0  # pins taken past the bound (or when an open failed)

    def hold(self, rel: str, path: str | None) -> bool:
        """Count one pin of ``rel`` and open ``path`` if it is not held yet (``None``: the file
        is still being written; :meth:`attach` opens it when it lands). False, counting nothing,
        when the file is gone."""
        with self._lock:
            if path is not None and rel not in self._fds:
                if len(self._fds) < self.limit:
                    try:
                        self._fds[rel] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        return False
                    except OSError:  # EMFILE, ENFILE...: a pin of this process only
                        self.without_fd += 1
                else:
                    self.without_fd += 1
            self._counts[rel] = self._counts.get(rel, 0) + 1
            return True

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
        Duplicated under the lock, so an unpin cannot close it and reuse its number meanwhile."""
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
