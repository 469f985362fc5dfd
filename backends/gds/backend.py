"""The ``gds`` tier: chunk files read and written with ``kvikio.CuFile`` (GPUDirect Storage).

It *is* the posix tier (same directory layout, index, LRU capacity, pins, temporary-name +
rename writes, corrupt-file handling — it subclasses :class:`PosixBackend`) with the byte moving
part replaced (:class:`.io.KvikioFileIO` for posix's :class:`~kvplug.backends.posix.io.ChunkFileIO`),
so one directory is served by either tier interchangeably.

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
from typing import Literal

from kvplug.errors import ConfigError
from kvplug.hookspecs import TierContext, hookimpl
from pydantic import ByteSize, Field

from ..posix import PosixBackend
from ..posix.io import ChunkFileIO
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
        if mode is not Mode.POSIX and ctx.auth is not None and ctx.auth.encrypts:
            raise ConfigError(
                f"tier {ctx.name!r} (backend 'gds'): encrypt: true cannot be kept through kvikio "
                "(GPUDirect Storage moves the bytes between file and memory without the CPU, "
                "which is what encrypts and decrypts them); serve this directory with the "
                "'posix' backend (same files), or drop encrypt")
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

    def _chunk_io(self, ctx: TierContext) -> ChunkFileIO:
        """The posix tier's byte moving, through kvikio (posix's own in the posix fallback)."""
        if self.mode is Mode.POSIX:
            return super()._chunk_io(ctx)
        opts: GDSBackend.Options = ctx.options
        return gds_io.KvikioFileIO(ctx.allocate, ctx.auth, fsync=opts.fsync, file_mode=opts.mode,
                                   gid=opts.gid, verify_device=opts.verify_device,
                                   header_limit=ctx.header_limit)

    @hookimpl
    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["gds_active"] = int(self.mode is Mode.GDS)
        out["compat_mode"] = int(self.mode is Mode.COMPAT)
        out["posix_fallback"] = int(self.mode is Mode.POSIX)
        return out

