"""The one policy for a stored chunk that cannot be served, for every tier that reads chunks.

* **Corrupt** (damaged bytes, another key's chunk, a failed checksum or MAC, a size that is not
  what the header says): counted (``corrupt``), logged once, treated as a miss and deleted, so
  the next store writes it again. Where only a part was read through a header cached earlier (a
  layer range), the entry is forgotten but not deleted: another host may have rewritten it since.
* **Another format version** (a node of another kvplug version wrote it, a rolling upgrade):
  counted (``other_version``), logged once, a miss and left in place; remembered for
  :data:`OTHER_VERSION_TTL_S` so lookups miss it without a read and stores do not overwrite it.
  Only without a keyring: with ``auth_key_env`` an entry of another version is an
  authentication failure (:func:`kvplug.chunkfile.decode_header`), corrupt like any other.

:class:`BadEntries` applies it; :meth:`BadEntries.read_header` is the chunk-file parse with the
policy applied to what it raises. The tier says how an entry is deleted (a callable per call: a
remote delete, or a posix unlink of the very inode that was read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError, ChunkVersionError
from kvplug.logs import LogOnce

from .index import TTLSet

#: How long an entry of another format version is known to be one (lookups miss it meanwhile).
OTHER_VERSION_TTL_S = 60.0


class Unavailable(Exception):
    """A read of an entry's bytes found it missing or the store unavailable: a plain miss,
    never a verdict on the entry."""


class BadEntries:
    """Counts, logs once and acts on corrupt and other-version entries of one tier (thread-safe).
    ``what`` names an entry in log lines ("value", "chunk", "chunk file")."""

    def __init__(self, tier: str, log_once: LogOnce, what: str = "value",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tier = tier
        self._log_once = log_once
        self._what = what
        self._lock = threading.Lock()
        self._other = TTLSet(OTHER_VERSION_TTL_S, clock=clock)
        self._counts = {"corrupt": 0, "other_version": 0}

    def corrupt(self, name: str, why: str, delete: Callable[[], object] | None) -> None:
        """``name`` is corrupt: counted, logged once, and deleted with ``delete()`` (``None``:
        only part of it was read through an earlier header; forgotten by the caller, kept)."""
        with self._lock:
            self._counts["corrupt"] += 1
        self._log_once("corrupt", "tier %r: corrupt %s %s (%s) treated as a miss%s — further "
                       "ones are counted in stats (corrupt), not logged", self._tier, self._what,
                       name, why, " and deleted" if delete is not None else "")
        if delete is not None:
            delete()

    def other_version(self, name: str, why: object) -> None:
        """``name`` is of another format version: counted, logged once, remembered a while."""
        with self._lock:
            self._counts["other_version"] += 1
            self._other.add(name)
        self._log_once("other_version", "tier %r: %s %s is of another format version (%s); "
                       "treated as a miss and left in place", self._tier, self._what, name, why)

    def is_other(self, name: str) -> bool:
        """Whether ``name`` was recently found to be another version's (neither read, nor
        overwritten, nor deleted by this version meanwhile)."""
        with self._lock:
            return name in self._other

    def forget(self, name: str) -> None:
        """``name`` was deleted: what was known of it no longer holds."""
        with self._lock:
            self._other.discard(name)

    def read_header(self, name: str, read: cf.ReadAt, size: int | None, auth: cf.Keyring | None,
                    delete: Callable[[], object],
                    max_header: int | None = None) -> tuple[cf.ChunkHeader, bytes] | None:
        """:func:`kvplug.chunkfile.read_header` of entry ``name`` (a header of at most
        ``max_header`` bytes) with the policy applied: ``None`` for a corrupt entry (deleted),
        one of another version (left) or one that ``read`` found unavailable (raising
        :class:`Unavailable`: a plain miss)."""
        try:
            return cf.read_header(read, size, auth, max_header)
        except Unavailable:
            return None
        except ChunkVersionError as exc:
            self.other_version(name, exc)
            return None
        except ChunkFormatError as exc:
            self.corrupt(name, str(exc), delete)
            return None

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}
