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
* **load** (``get``/``get_layers``): reads into memory from ``ctx.allocate`` — L1's host pool
  normally (kvikio POSIX reads into host memory, zero extra copies, then verified); if the first
  pool-owning tier hands out device memory, GDS DMAs file -> GPU.
* **load into the device** (:meth:`GDSBackend.load_into`): reads a chunk, or one layer per call
  for layer-wise loading, straight into a caller's CUDA tensor (the staging buffer gpu/ scatters
  from). GDS: file -> GPU by DMA; compat: through kvikio's bounce buffer. Verification copies
  each layer D2H to the pinned scratch (``verify_device: false`` skips only this; the header,
  sizes and key are always checked).

Without GDS the tier runs in kvikio's compatibility mode (logged once). Without a CUDA driver
kvikio cannot move any bytes, so the tier refuses to start, or runs as posix over the same
directory with ``fallback: posix`` (see :mod:`kvplug.backends.gds_probe`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch
from kvplug import chunk_format as cf
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from pydantic import ByteSize, Field

from . import gds_io
from .gds_probe import Mode, Probe, decide, kvikio_settings, log_once, probe
from .posix import PosixBackend
from .posix_io import CorruptChunk

logger = logging.getLogger("kvplug.backends.gds")

#: Replaced by tests of the decision logic only (a missing driver cannot be caused for real on a
#: machine that has one).
_probe = probe


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
        found: Probe = _probe()
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
        return _file_size(key, obj), lambda path: gds_io.write_chunk(
            path, key, obj, fsync=self.opts.fsync
        )

    def _read_file(self, path: str, key: CacheKey, layers: tuple[int, int] | None,
                   known: object) -> tuple[MemoryObj | None, int, object]:
        if self.mode is Mode.POSIX:
            return super()._read_file(path, key, layers, known)
        obj, size = gds_io.read_chunk(path, key, self._allocate, layers,
                                      verify_device=self.opts.verify_device)
        return obj, size, None

    # -- the device path --------------------------------------------------------------------------
    def load_into(self, key: CacheKey, dest: torch.Tensor, first_layer: int = 0,
                  num_layers: int | None = None) -> bool:
        """Read layers ``[first_layer, first_layer + num_layers)`` of ``key`` (all by default)
        straight into ``dest`` — a CUDA tensor (GDS: file -> GPU DMA) or a host tensor — whose
        bytes must equal those layers' bytes. For layer-wise loading call it once per layer.
        True on success; a miss, a corrupt file or an I/O error is ``False`` (logged once)."""
        rel = cf.relative_chunk_path(key)
        path = self._path(rel)
        if self.mode is Mode.POSIX:
            obj = self._read(key, None if num_layers is None else (first_layer, num_layers))
            if obj is None:
                return False
            try:
                dest.reshape(-1).view(torch.uint8).copy_(obj.byte_view)  # posix: H2D copy
            finally:
                obj.ref_down()
            return True
        try:
            header, ino = gds_io.read_header(path, key)
            count = header.num_layers - first_layer if num_layers is None else num_layers
            cf.check_layer_range(header, first_layer, count)
            gds_io.read_layers_into(path, header, ino, dest, first_layer, count,
                                    verify=self.opts.verify_device or not dest.is_cuda)
        except FileNotFoundError:
            return False
        except CorruptChunk as exc:
            self._quarantine(rel, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - bad range/size, OSError, kvikio RuntimeError
            self._count("read_errors")
            self._log_once("load_into", "load_into %s failed: %r", path, exc)
            return False
        self._touch(rel, header.file_size)
        with self._lock:
            self._counters["reads"] += 1
            self._counters["disk_bytes_read"] += dest.numel() * dest.element_size()
        return True

    @hookimpl
    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["gds_active"] = int(self.mode is Mode.GDS)
        out["compat_mode"] = int(self.mode is Mode.COMPAT)
        out["posix_fallback"] = int(self.mode is Mode.POSIX)
        return out


def _file_size(key: CacheKey, obj: MemoryObj) -> int:
    """Size of the chunk file of ``obj`` (header with placeholder checksums + aligned layers)."""
    layers, _, _ = cf.chunk_layout(obj.meta)
    header = cf.encode_header(key, obj.meta, ["0" * 16] * layers)
    return len(header) + (layers * cf.align_up(obj.nbytes // layers) if layers else 0)
