"""The ``gds`` tier: chunk files read and written with ``kvikio.CuFile`` (GPUDirect Storage).

It *is* the posix tier (same directory layout, index, LRU capacity, pins, temporary-name +
rename writes, corrupt-file handling — it subclasses :class:`PosixBackend`) with the byte moving
replaced by kvikio, so one directory is served by either tier interchangeably.

Copies on each path (GDS = cuFile with GPUDirect Storage; compat = kvikio compatibility mode):

* **store, host object** (the usual case: the connector gathers pages into L1's host pool):
  kvikio writes straight from the host object (one ``pwrite``; no staging, no device copy).
  LMCache's GDS tier copies such an object into a GPU buffer first and writes from there.
* **store, device object** (an object whose tensor is on the GPU): GDS: DMA GPU -> file, no
  host copy of the payload. compat: kvikio bounces it through its pinned bounce buffer.
  Both: each layer is also copied once D2H into a small pinned scratch to compute the format's
  xxh3 checksum (verification only; the write itself is not staged through it).
* **load** (``get``/``get_layers``, a whole chunk or a layer range): reads into memory from
  ``ctx.allocate`` — L1's host pool normally (kvikio POSIX reads into host memory, zero extra
  copies, then verified); if the first pool-owning tier hands out device memory, GDS DMAs
  file -> GPU (compat: through kvikio's bounce buffer) and verification copies each layer D2H to
  the pinned scratch (``verify_device: false`` skips only this; the header, sizes and key are
  always checked).

Without GDS the tier runs in kvikio's compatibility mode (logged once). Without a CUDA driver
kvikio cannot move any bytes, so the tier refuses to start, or runs as posix over the same
directory with ``fallback: posix`` (see :mod:`kvplug.backends.gds.probe`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from kvplug import chunkfile as cf
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from pydantic import ByteSize, Field

from ..posix import PosixBackend
from ..posix.io import Known
from . import io as gds_io
from .probe import Mode, Probe, decide, kvikio_settings, log_once, probe

logger = logging.getLogger("kvplug.backends.gds")


class GDSBackend(PosixBackend):
    """Chunk files through kvikio; posix layout, index and eviction."""

    class Options(PosixBackend.Options):
        fallback: Literal["none", "posix"] = Field(
            default="none", description="without a CUDA driver or kvikio: 'posix' runs this tier "
            "as posix over the same directory; 'none' refuses to start")
        num_threads: int | None = Field(
            default=None, ge=1, le=256, description="kvikio.defaults num_threads (I/O threads)")
        task_size: ByteSize | None = Field(
            default=None, description="kvikio.defaults task_size: a pread/pwrite is split into "
            "tasks of this size (kvikio default 4MiB)")
        gds_threshold: ByteSize | None = Field(
            default=None, description="kvikio.defaults gds_threshold: smaller I/O uses POSIX")
        direct_io_read: bool | None = Field(
            default=None, description="kvikio.defaults auto_direct_io_read (O_DIRECT reads of "
            "host buffers; kvikio default false)")
        direct_io_write: bool | None = Field(
            default=None, description="kvikio.defaults auto_direct_io_write (kvikio default true)")
        compat_mode: Literal["auto", "on", "off"] = Field(
            default="auto", description="kvikio compat mode; 'auto' uses GDS where available")
        verify_device: bool = Field(
            default=True, description="verify layer checksums of device reads (one D2H copy "
            "per layer into a pinned scratch)")

    def __init__(self, ctx: TierContext) -> None:
        opts: GDSBackend.Options = ctx.options
        found: Probe = probe()
        mode = decide(found, opts.fallback, ctx.name)
        if mode is Mode.GDS and opts.compat_mode == "on":
            mode = Mode.COMPAT
        self.mode = mode
        self.probe = found
        self.kvikio_config: dict[str, object] = {}
        if mode is not Mode.POSIX:
            import kvikio.defaults

            self.kvikio_config = kvikio_settings(opts, mode)
            if self.kvikio_config:
                kvikio.defaults.set(self.kvikio_config)  # process-wide (kvikio has one config)
            if mode is Mode.COMPAT:
                log_once("compat", "tier %r: GPUDirect Storage is not available (kvikio %s, "
                         "cuFile reports no GDS%s): using kvikio compatibility mode — POSIX "
                         "I/O, device buffers bounced through kvikio's pinned buffer",
                         ctx.name, found.kvikio_version,
                         "" if opts.compat_mode == "auto" else ", compat_mode: on")
            else:
                log_once("gds", "tier %r: GPUDirect Storage active (kvikio %s)", ctx.name,
                         found.kvikio_version)
        super().__init__(ctx)

    # -- byte moving (the posix tier's, through kvikio) -------------------------------------------
    def _prepare_write(self, key: CacheKey, rel: str, obj: MemoryObj) -> tuple[int, Callable[[str], int]]:
        if self.mode is Mode.POSIX:
            return super()._prepare_write(key, rel, obj)
        return _file_size(key, obj, self._auth), lambda path: gds_io.write_chunk(
            path, key, obj, fsync=self.opts.fsync, auth=self._auth, file_mode=self.opts.mode,
            gid=self._gid
        )

    def _read_file(self, fd: int, key: CacheKey, layers: tuple[int, int] | None,
                   known: Known | None) -> tuple[MemoryObj | None, int, Known | None]:
        if self.mode is Mode.POSIX:
            return super()._read_file(fd, key, layers, known)
        obj, size = gds_io.read_chunk(fd, key, self._allocate, layers,
                                      verify_device=self.opts.verify_device, auth=self._auth)
        return obj, size, None

    @hookimpl
    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["gds_active"] = int(self.mode is Mode.GDS)
        out["compat_mode"] = int(self.mode is Mode.COMPAT)
        out["posix_fallback"] = int(self.mode is Mode.POSIX)
        return out


def _file_size(key: CacheKey, obj: MemoryObj, auth: cf.Keyring | None = None) -> int:
    """Size of the chunk file of ``obj`` (known before its checksums are: they have a fixed
    length, so placeholders give the same header size; with ``auth``, tags and a MAC)."""
    key = cf.stored_key(key, auth)  # the header's key: its length sizes the header
    mac = auth.seal(key) if auth is not None else None
    sums = ["0" * (16 if mac is None else cf.auth.TAG_HEX)] * cf.chunk_layout(obj.meta)[0]
    header = cf.encode_header(key, obj.meta, sums, mac)
    return cf.make_header(key, obj.meta, sums, len(header)).file_size
