"""The posix tier's reads: a chunk (or a layer range of one) into memory from ``ctx.allocate``.

A chunk still queued for writing is served from its object (whole, or its layers copied); a
victim whose file is not deleted yet is a miss. Otherwise the file is opened — through the
descriptor a pin holds (:mod:`.held`: even if another process unlinked it since), else by its
path (:func:`.fs.open_chunk`: no link followed, no blocking open) — read straight into the
memory object and verified (:class:`.io.ChunkFileIO`), and bumped in the shared LRU. Every
problem is a miss: a vanished file, an entry that is not a regular file, a damaged file or one
of another format version (:meth:`Reader.unusable_file`, the tier's one policy for those), an
I/O error, no memory.
"""

from __future__ import annotations

import os

from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj

from . import fs
from .directory import Directory, Warn
from .held import HeldFiles, fd_path
from .io import ChunkFileIO, CorruptChunk, ForeignChunk, layer_range_copy
from .writer import Writer


class Reader:
    """Reads of one tier's chunks, from its write queue or its files."""

    def __init__(self, directory: Directory, writer: Writer, held: HeldFiles, files: ChunkFileIO,
                 warn: Warn) -> None:
        self._dir = directory
        self._writer = writer
        self._held = held
        self.files = files  # its ``allocate`` (ctx.allocate) gives the memory of every read
        self._warn = warn
        self._cached = fs.CachedOpener(str(directory.root))
        #: what reads without waiting found wrong (a damaged file; None: no memory), acted on
        #: by the bounded read of the same file that follows (:meth:`_verdict`), not twice
        self._verdicts: dict[str, CorruptChunk | None] = {}
        self.counters = dict.fromkeys(
            ("reads", "disk_bytes_read", "pending_hits", "read_errors", "alloc_failures",
             "reads_without_wait"), 0)

    def _count(self, name: str, n: int = 1) -> None:
        with self._dir.lock:
            self.counters[name] += n

    def read(self, key: CacheKey, rel: str, layers: tuple[int, int] | None) -> MemoryObj | None:
        """The chunk ``key`` (file ``rel``), or ``layers=(first, count)`` of it; None on a miss."""
        if self._verdicts and self._verdict(rel):
            return None
        with self._dir.lock:
            queued = self._writer.pending.get(rel)
            if queued is not None and layers is None:  # not on disk yet: the bytes being written
                self.counters["pending_hits"] += 1
                return queued.ref_up()
            if rel in self._dir.reaper:  # evicted, its file not deleted yet
                return None
            if queued is not None and queued.meta.fmt == MemoryFormat.KV_PAGES:
                queued.ref_up()  # a layer range of a chunk still being written: copied from it
            else:
                queued = None
        if queued is not None:  # a layer-wise load of a chunk whose write has not finished
            try:
                out = layer_range_copy(queued, layers, self.files.allocate)  # type: ignore[arg-type]
            finally:
                queued.ref_down()
            if out is not None:
                self._count("pending_hits")
            return out
        held = self._held.dup(rel)  # pinned: read the file we hold, even if it was unlinked
        fd = None
        try:
            fd = self._open(rel, held)
            obj, size = self.files.read(fd, key, rel, layers)
        except FileNotFoundError:
            self.files.forget(rel)
            self._dir.vanished(rel)
            return None
        except fs.NotRegular as exc:  # a link, a FIFO...: never followed, never blocks
            self.files.forget(rel)
            self._dir.not_regular(rel, exc)
            return None
        except CorruptChunk as exc:
            self.unusable_file(rel, exc)
            return None
        except ValueError as exc:  # a layer range the chunk does not have: the caller's mistake
            self._warn("range", "bad layer range for %s: %s", key, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - OSError, or an I/O library's error: a miss
            self._count("read_errors")
            self._warn("read", "read of %s failed: %r", self._dir.path(rel), exc)
            return None
        finally:
            for d in (fd, held if held != fd else None):
                if d is not None:
                    os.close(d)
        if obj is None:
            self._count("alloc_failures")
            self._warn("alloc", "no memory to read chunks into; treated as misses")
            return None
        self._dir.touch(rel, size)
        with self._dir.lock:
            self.counters["reads"] += 1
            self.counters["disk_bytes_read"] += obj.nbytes
        return obj

    def read_nowait(self, key: CacheKey, rel: str) -> MemoryObj | None:
        """The chunk ``key`` (file ``rel``) where it can be read without waiting on the file
        system: from the write queue, or a file opened from the kernel's caches
        (:class:`.fs.CachedOpener`, or the descriptor a pin holds) and read from the page cache
        (:meth:`.ChunkFileIO.read_nowait`). ``None`` otherwise — with nothing counted, logged
        or deleted: the bounded read that follows (:meth:`read`) deals with whatever it is.
        The shared LRU's stamp of the file is bumped off this thread (:meth:`.Directory.touch`)."""
        # No lock while the write queue and the verdicts are empty (so are the victims and
        # the pins in :meth:`.Reaper.__contains__` and :meth:`.HeldFiles.dup`): a dict's
        # emptiness read without its lock is what a look under the lock would have seen at
        # that instant, and the look under the lock is released before the file is opened in
        # any case, so a write queued, a verdict, an eviction or a pin that lands after the
        # emptiness was read is ordered after this read's look, as it could be after the
        # locked one; the read then acts as it would have (the file is read and every layer
        # verified, or it is a miss the bounded read sorts out).
        if self._writer.pending or self._verdicts:
            with self._dir.lock:
                queued = self._writer.pending.get(rel)
                if queued is not None:
                    self.counters["pending_hits"] += 1
                    return queued.ref_up()
                if rel in self._verdicts:
                    return None
        if rel in self._dir.reaper:  # evicted, its file not deleted yet
            return None
        held = self._held.dup(rel)
        fd = st = None
        try:
            fd, st = (held, None) if held is not None else (self._cached.open(rel) or (None, None))
            read = None if fd is None else self.files.read_nowait(fd, key, rel, st)
        except CorruptChunk as exc:  # judged here, acted on by the bounded read (it may wait)
            with self._dir.lock:
                self._verdicts[rel] = exc
            return None
        except Exception:  # noqa: BLE001 - a wait (BlockingIOError) or any problem: asked again
            return None
        finally:
            for d in (fd, held if held != fd else None):
                if d is not None:
                    os.close(d)
        if read is None:
            return None
        obj, size = read
        if obj is None:  # no memory (counted by the allocator): a miss, said by the bounded read
            with self._dir.lock:
                self._verdicts[rel] = None
            return None
        self._dir.touch(rel, size, later=True)
        with self._dir.lock:
            self.counters["reads"] += 1
            self.counters["reads_without_wait"] += 1
            self.counters["disk_bytes_read"] += obj.nbytes
        return obj

    def _verdict(self, rel: str) -> bool:
        """Act on what a read without waiting found wrong with ``rel`` (:meth:`read_nowait`),
        as :meth:`read` would have: True if there was something (the read is then a miss)."""
        with self._dir.lock:
            if rel not in self._verdicts:
                return False
            exc = self._verdicts.pop(rel)
        if exc is None:
            self._count("alloc_failures")
            self._warn("alloc", "no memory to read chunks into; treated as misses")
        else:
            self.unusable_file(rel, exc)
        return True

    def close(self) -> None:
        self._cached.close()

    def unusable_file(self, rel: str, err: CorruptChunk) -> None:
        """The tier's policy for a file it cannot use, in one place: another format version's
        file is a miss left in place (rolling upgrades share a directory), counted as
        ``other_version``; a damaged one (wrong size, header, key or checksum) is a miss,
        logged with its path, deleted if it is still the file that was read, counted as
        ``corrupt``."""
        if isinstance(err, ForeignChunk):
            self._dir.other_version(rel, err)
            return
        self.files.forget(rel)
        self._held.drop(rel)
        self._dir.quarantine(rel, err)

    def _open(self, rel: str, held: int | None) -> int:
        """A private descriptor of ``rel``'s file: a fresh open of the ``held`` one (the file a
        pin keeps, even if unlinked since), else of the path (:func:`.fs.open_chunk`: no link
        followed, no blocking open, a regular file). Without O_DIRECT the ``held`` duplicate
        itself serves (reads name their offsets, so a shared open file description
        is harmless; only O_DIRECT, set on it per read, needs a description of its own)."""
        if held is not None:
            return fs.reopen(fd_path(held)) if self.files.direct else held
        return fs.open_chunk(self._dir.path(rel))
