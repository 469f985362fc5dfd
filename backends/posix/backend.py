"""The ``posix`` tier: one safetensors chunk file per key in a local (or shared) directory.

The backend is a composition; each part has one job:

* :mod:`.directory` — the index of the files under the tier's lock: startup scan (background),
  rescans, capacity and eviction (victims deleted by :mod:`.reaper`), the shared LRU, quotas,
  and the verdict on files that cannot be used;
* :mod:`.writer` — the write queue: stores never wait on the disk;
* :mod:`.reader` — reads from the queue or the files, every problem a miss;
* :mod:`.held` — pinned files held open, so other processes' evictions cannot take them;
* :mod:`.io` — the bytes of one chunk file (atomic writes, vectored reads, the header cache);
  :mod:`.fs` — every file-system call under the root (no link followed, no blocking open).

This module builds them from the tier's options and implements the hooks over them: lookups and
pins are the only logic of its own (they span the index, the write queue and the held files).

* Layout: ``<path>/<2 hex of the hash>/<safe key name>.safetensors`` (:mod:`kvplug.chunkfile`),
  names built only from the key's safe string form (keyed with ``auth``), so no input can
  escape ``path``; several processes may share a directory.
* Files are private (directories 0700, files 0600; ``file_mode``/``group`` for a group-shared
  directory). A full disk or read-only directory makes stores fail soft; loads go on. Every wait
  is bounded (a hung file system delays a store or ``close``, never stops serving).
"""

from __future__ import annotations

import grp
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvplug import chunkfile as cf
from kvplug.bench_raw import RawTarget
from kvplug.config import BaseOptions
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.logs import LogOnce
from kvplug.memory import MemoryObj
from kvplug.policies.eviction import LRUEviction
from kvplug.tier_calls import release
from pydantic import ByteSize, ConfigDict, Field, field_validator

from ..common.bad_entries import BadEntries
from .directory import Directory
from .held import HeldFiles, fd_limit
from .io import ChunkFileIO, direct_io_usable, wider_than, writable_dir
from .pin_store import OperatorPins, PinFile
from .reader import Reader
from .writer import Writer

logger = logging.getLogger("kvplug.backends.posix")
#: how long ``close`` waits for the scan, the writes and the deletes (each) before it goes on
CLOSE_WAIT_S = 60.0


class PosixOptions(BaseOptions):
    """The ``posix`` tier's options (``tiers: [{backend: posix, options: {...}}]``)."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="cache directory (created if missing)")
    capacity: ByteSize = Field(default=ByteSize(20 << 30), description="bytes on disk")
    fsync: bool = Field(default=False, description="fsync each file (and its directory)")
    io_threads: int = Field(
        default=2, ge=1, le=64,
        description="writer threads (2: writes to the page cache are mostly Python under the "
                    "GIL, so more threads queue on it; raise it with fsync on a slow disk)")
    o_direct: bool = Field(
        default=False, description="bypass the page cache where the file system allows it"
    )
    max_pending_writes: int = Field(
        default=256, ge=1, description="queued writes beyond this are dropped (counted)"
    )
    rescan_interval_s: float = Field(
        default=10.0, ge=0, description="re-read the directory at most this often when "
        "evicting (to see other processes' files); 0: before every write, so processes "
        "sharing the directory hold its capacity (plus their writes in flight)",
    )
    max_pinned_fds: int = Field(
        default=1024, ge=0, description="pinned files held open (at most 1/4 of the fd "
        "limit); pins past it protect against this process's eviction only",
    )
    file_mode: str = Field(
        default="0600", description="octal mode of chunk files (directories get the matching "
        "mode: 0600 -> 0700, 0640 -> 0750); widen it only for a group-shared directory",
    )
    group: str | int | None = Field(
        default=None, description="group (name or gid) of the files and directories kvplug "
        "creates, for a directory shared by the users of one group (with file_mode 0640/0660)",
    )

    @field_validator("file_mode", mode="before")
    @classmethod
    def _octal_mode(cls, v: object) -> str:
        """An octal string of permission bits the owner can read and write, without execute
        or set-id bits (``0600``, ``0640``, ``0660``)."""
        text = str(v).strip()
        try:
            mode = int(text, 8)
        except ValueError:
            raise ValueError(f"file_mode {text!r} is not an octal mode: write it like '0600' "
                             "or '0640'") from None
        if mode & ~0o777:
            raise ValueError(f"file_mode {text!r} has bits beyond the permission bits (0777): "
                             "set-id and sticky bits are not allowed; use e.g. '0640'")
        if mode & 0o600 != 0o600:
            raise ValueError(f"file_mode {text!r} does not let the owner read and write its "
                             "files: it must include 0600 (e.g. '0600' or '0640')")
        if mode & 0o111:
            raise ValueError(f"file_mode {text!r} has execute bits: chunk files are data; use "
                             "e.g. '0640'")
        return f"0{mode:03o}"

    @field_validator("group", mode="before")
    @classmethod
    def _known_group(cls, v: object) -> str | int | None:
        """A group that exists on this machine (by name), or a gid."""
        if v is None or isinstance(v, int):
            if isinstance(v, int) and v < 0:
                raise ValueError(f"group {v} is not a gid: use a group name or a gid >= 0")
            return v
        name = str(v).strip()
        if name.isdigit():
            return int(name)
        try:
            grp.getgrnam(name)
        except KeyError:
            raise ValueError(f"group {name!r} does not exist on this machine: name an existing "
                             "group (see `getent group`) or give a numeric gid") from None
        return name

    @property
    def mode(self) -> int:
        """:attr:`file_mode` as a number."""
        return int(self.file_mode, 8)

    @property
    def gid(self) -> int | None:
        """:attr:`group` as a gid (None: the creating process's group)."""
        if self.group is None or isinstance(self.group, int):
            return self.group
        return grp.getgrnam(self.group).gr_gid


class PosixBackend:
    """A directory of chunk files with a byte capacity."""

    Options = PosixOptions
    #: Victims are chosen by ``ctx.eviction``; ``lru`` is the index's own (shared mtime) LRU.
    eviction_policy = True
    #: Chunk files through kvplug.chunkfile with ctx.auth: ciphertext under ``encrypt: true``.
    encrypts = True
    #: A local directory: a small hit loads inside the engine step (``in_step_load_bytes``). A
    #: directory on a network filesystem is better served by the ``fsspec`` tier.
    local_medium = True

    @staticmethod
    def bench_raw(options: PosixOptions) -> RawTarget:
        """``kvplug bench``'s raw medium (:mod:`kvplug.bench_raw`): plain files in the same
        directory (.bench.RawFiles); the ``gds`` tier's too."""
        from .bench import RawFiles

        return RawFiles(str(options.path), bool(options.fsync))

    def __init__(self, ctx: TierContext) -> None:
        opts: PosixOptions = ctx.options
        self.name = ctx.name
        self.opts = opts
        #: The deployment's keyring (``auth_key_env``): MACs and keyed names; None = plain.
        self._auth = ctx.auth
        self.root = Path(opts.path).expanduser().resolve()
        self.capacity = int(opts.capacity)
        self._warnings = LogOnce(logger)
        existed = os.path.lexists(self.root)
        why_not = writable_dir(self.root, opts.mode, opts.gid)
        writable = why_not is None
        if why_not:
            self._log_once("dir", "%s", why_not)
        elif existed and (wider := wider_than(self.root, opts.mode)):
            logger.warning("tier %r: %s", self.name, wider)
        self.o_direct = bool(opts.o_direct and writable and direct_io_usable(self.root, self.name))
        policy = ctx.eviction
        self.directory = Directory(
            self.root, self.capacity, self.name, ctx.runtime, self._log_once,
            BadEntries(self.name, self._warnings, what="chunk file", clock=ctx.runtime.monotonic),
            policy=None if policy is None or isinstance(policy, LRUEviction) else policy,
            quotas=ctx.quotas, rescan_interval_s=opts.rescan_interval_s)
        self.held = HeldFiles(fd_limit(opts.max_pinned_fds), self.directory.open_held)
        self.files = self._chunk_io(ctx)
        self.writer = Writer(self.directory, self.held, self.files, ctx.runtime, self._log_once,
                             threads=opts.io_threads, max_pending=opts.max_pending_writes,
                             writable=writable)
        self.reader = Reader(self.directory, self.writer, self.held, self.files, self._log_once)
        self.operator_pins = OperatorPins(
            self.directory, self.held,
            PinFile(self.root, opts.mode, opts.gid, self.name, ctx.auth) if writable else None,
            ctx.max_pinned_fraction, self._pin,
            lambda rel: self.files.problem(self.directory.path(rel), rel))
        self._lock = self.directory.lock
        self._rt = ctx.runtime
        self.directory.start_scan(self.operator_pins.around_scan)

    def _chunk_io(self, ctx: TierContext) -> ChunkFileIO:
        """How chunk bytes move between memory and files (the gds tier: through kvikio)."""
        opts = self.opts
        return ChunkFileIO(ctx.allocate, ctx.auth, fsync=opts.fsync, direct=self.o_direct,
                           file_mode=opts.mode, gid=opts.gid, header_limit=ctx.header_limit)

    def _log_once(self, what: str, msg: str, *args: object) -> None:
        """Warn about one kind of problem once per tier (later ones are counted in stats)."""
        self._warnings(what, "tier %r: " + msg + " (further occurrences are counted in stats)",
                       self.name, *args)

    def _rel(self, key: CacheKey) -> str:
        """The chunk file of ``key`` relative to the root (keyed names with ``auth``)."""
        return cf.relative_chunk_path(key, self._auth)

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Wait until the startup scan has indexed every file; False on timeout."""
        return self.directory.indexed.wait(timeout)

    @hookimpl
    def tenant_usage(self) -> dict[str, int]:
        """Bytes of the files this process has indexed, per tenant id (from the file names)."""
        return self.directory.tenant_usage()

    @hookimpl
    def evict_tenant(self, tenant: str) -> list[int]:
        """Every unpinned file of ``tenant``, other processes' included: deleted now."""
        return self.directory.evict_tenant(tenant, lambda: list(self.writer.pending),
                                           self.writer.cancel_locked)

    # -- stores and reads -----------------------------------------------------------------------
    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        self.writer.enqueue(keys, [self._rel(k) for k in keys], objs)

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        return self.reader.read(key, self._rel(key), None)

    @hookimpl
    def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """:meth:`get` of each key in turn, in the calling thread: a read from the page cache
        costs less than handing it to another thread (``kvplug bench``: 96 keys of 256 KiB in
        one call ~2.5 GB/s, one bounded call per key ~0.5 GB/s on 2 cores). The StorageManager
        still spreads a large batch over its readers, one call per group of keys."""
        return self._each(keys, lambda key, rel: self.reader.read(key, rel, None))

    @hookimpl
    def batched_get_nowait(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """What can be read without waiting on the file system, on the caller's thread
        (:meth:`.Reader.read_nowait`): no hand-off to a pool thread for a chunk in the page
        cache. Every other key is ``None`` and read by :meth:`get`/:meth:`batched_get`."""
        return self._each(keys, self.reader.read_nowait)

    def _each(self, keys: Sequence[CacheKey],
              read: Callable[[CacheKey, str], MemoryObj | None]) -> list[MemoryObj | None]:
        """``read(key, relative path)`` of each key in turn; on an error the caller gets nothing
        and what was read so far is given back."""
        out: list[MemoryObj | None] = []
        try:
            for key in keys:
                out.append(read(key, self._rel(key)))
        except BaseException:
            release(out)
            raise
        return out

    @hookimpl
    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int) -> MemoryObj | None:
        return self.reader.read(key, self._rel(key), (first_layer, num_layers))

    # -- lookups, pins, eviction ----------------------------------------------------------------
    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        """From the index (a chunk still being written is a hit too: reads serve it from the
        queue), then a ``stat`` for files other processes wrote; another version's file is a
        miss. A pin protects a file from this process's eviction and, held open, from every
        other process's."""
        rels = [self._rel(k) for k in keys]
        index, pending = self.directory.index, self.writer.pending
        with self._lock:
            found = [rel in index or rel in pending for rel in rels]
        self.directory.find_unindexed(rels, found)
        for i, rel in enumerate(rels):
            if pin and found[i] and not self._pin(rel):
                found[i] = False
        return found

    def _pin(self, rel: str) -> bool:
        """Pin ``rel``: never evicted by this process, held open against others (:mod:`.held`),
        newest in the shared LRU. False (nothing pinned) when its file is gone."""
        index = self.directory.index
        with self._lock:
            index.pins.pin(rel)
            if rel in self.writer.pending:
                # counted under the tier lock, so the writer (which hands its file to the held
                # pins under the same lock, Writer._write) holds the file once it lands
                return self.held.hold(rel, None)
        if self.held.hold(rel, self.directory.path(rel)):
            self.directory.touch(rel)  # newest in the shared LRU: other processes evict it last
            return True
        with self._lock:
            index.pins.unpin(rel)
            index.remove(rel)
        return False

    @hookimpl
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        rels = [self._rel(key) for key in keys]
        with self._lock:
            self.directory.index.pins.unpin_all(rels)
        for rel in rels:
            self.held.release(rel)

    @hookimpl
    def operator_pin(self, keys: Sequence[CacheKey]) -> list[str]:
        return self.operator_pins.pin([self._rel(k) for k in keys])

    @hookimpl
    def operator_unpin(self, keys: Sequence[CacheKey]) -> list[bool]:
        return self.operator_pins.unpin([self._rel(k) for k in keys])

    @hookimpl
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        """LRU victims (``keys`` None): their files are deleted in the background (.reaper);
        named keys: deleted now (the caller wants those files gone, as other processes see)."""
        if keys is None:
            return self.directory.evict_lru(nbytes)
        return self.directory.evict([self._rel(k) for k in keys], self.writer.cancel_locked)

    # -- lifecycle ------------------------------------------------------------------------------
    @hookimpl
    def flush(self, timeout: float) -> bool:
        """Wait until every queued write and delete is done (the writer holds no object)."""
        deadline = self._rt.monotonic() + timeout
        if not self.writer.flush(timeout):
            return False
        return self.directory.reaper.drain(max(0.0, deadline - self._rt.monotonic()))

    @hookimpl
    def close(self) -> None:
        if not self.writer.stop():
            return
        scanning = not self.directory.stop_scanning(CLOSE_WAIT_S)
        if scanning:
            self._log_once("close_scan", "the startup scan of %s is still running after %.0f s "
                           "(a hung file system?); closing without it", self.root, CLOSE_WAIT_S)
        written = self.writer.close(CLOSE_WAIT_S)
        self.held.close()
        self.reader.close()
        if self.writer.writable and written and not scanning:
            # other processes may have written meanwhile: leave the bound kept
            try:
                self.directory.trim_to_capacity()
            except OSError as exc:
                self._log_once("close", "final capacity check of %s failed: %s", self.root, exc)
        if not self.directory.reaper.close(CLOSE_WAIT_S):  # every queued delete done
            self._log_once("close_deletes", "deletes of evicted files still running after %.0f "
                           "s; closing without them", CLOSE_WAIT_S)

    @hookimpl
    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {**self.writer.stats_locked(), **self.reader.counters,
                   **self.directory.stats_locked()}
        out.update(o_direct=int(self.o_direct), writable=int(self.writer.writable),
                   **self.held.stats(), **self.operator_pins.stats())
        return out
