"""What the ``gds`` tier can do on this machine: probe once, then decide (pure logic, testable).

kvikio 26.10 cannot move a single byte without the CUDA driver (``libcuda.so.1``), not even into a
host buffer in its compatibility mode: every ``pread``/``pwrite`` first asks the driver what kind
of pointer it got. So the decision is:

=====================  =========================================================================
what is there          what the tier does
=====================  =========================================================================
no CUDA driver         refuses to start (message names ``posix`` and ``fallback: posix``), or
                       with ``fallback: posix`` runs as the posix tier over the same directory
driver, no kvikio      refuses (message names ``pip install 'kvplug[gds]'``), or falls back
driver + kvikio,       kvikio compatibility mode: its own POSIX threads, device buffers bounced
no GDS                 through kvikio's pinned bounce buffer (logged once)
everything             GPUDirect Storage: DMA between the file and device memory
=====================  =========================================================================
"""

from __future__ import annotations

import ctypes
import enum
import logging
from dataclasses import dataclass
from typing import Any

from kvplug.errors import KVPlugError
from kvplug.logs import LogOnce

logger = logging.getLogger("kvplug.backends.gds")
#: Mode decisions are logged once per process (many tiers and ranks start the same way).
log_once = LogOnce(logger)

DRIVER_LIB = "libcuda.so.1"
INSTALL_HINT = "pip install 'kvplug[gds]'  (CUDA 13 builds: 'kvplug[gds-cu13]'; see docs/gds.md)"


class GDSUnavailableError(KVPlugError, RuntimeError):
    """The gds tier cannot run here and no fallback was configured."""


class Mode(str, enum.Enum):
    GDS = "gds"  #: cuFile with GPUDirect Storage
    COMPAT = "compat"  #: kvikio compatibility mode (POSIX I/O inside kvikio)
    POSIX = "posix"  #: fallback: the posix tier over the same directory


@dataclass(frozen=True)
class Probe:
    """What was found. ``*_error`` say why something is missing."""

    driver: bool
    driver_error: str | None = None
    kvikio_version: str | None = None
    kvikio_error: str | None = None
    cuda_device: bool = False  # torch.cuda.is_available(): device memory can be allocated
    gds: bool = False  # kvikio.cufile_driver.properties.is_gds_available

    @property
    def kvikio(self) -> bool:
        return self.kvikio_version is not None


def _driver() -> tuple[bool, str | None]:
    try:
        lib = ctypes.CDLL(DRIVER_LIB)
    except OSError as exc:
        return False, str(exc)
    rc = lib.cuInit(0)
    if rc != 0:
        return False, f"{DRIVER_LIB} loads but cuInit failed with CUresult {rc}"
    return True, None


def probe() -> Probe:
    """Look at the machine (cheap; imports kvikio only when the driver is there)."""
    ok, why = _driver()
    if not ok:
        return Probe(driver=False, driver_error=why)
    try:
        import kvikio
        import kvikio.cufile_driver
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken native library
        return Probe(driver=True, kvikio_error=f"{type(exc).__name__}: {exc}")
    try:
        gds = bool(kvikio.cufile_driver.properties.is_gds_available)
    except Exception:  # noqa: BLE001 - libcufile absent or failing: no GDS
        gds = False
    import torch

    return Probe(driver=True, kvikio_version=str(kvikio.__version__),
                 cuda_device=torch.cuda.is_available(), gds=gds)


def decide(p: Probe, fallback: str, tier: str = "gds") -> Mode:
    """The mode to run in, or :class:`GDSUnavailableError` with what to do about it."""
    if not p.driver or not p.kvikio:
        if not p.driver:
            why = (f"there is no usable CUDA driver ({p.driver_error}); kvikio cannot read or "
                   "write any bytes without it, not even to host memory")
            fix = ("use the 'posix' backend for this directory instead, or set "
                   "'fallback: posix' in this tier's options to run as posix when no driver "
                   "is present")
        else:
            why = f"kvikio is not importable ({p.kvikio_error})"
            fix = (f"install it with: {INSTALL_HINT}; or set 'fallback: posix' in this tier's "
                   "options (or use the 'posix' backend)")
        if fallback == "posix":
            logger.warning("tier %r: gds is unavailable: %s; running as the posix tier over the "
                           "same directory (fallback: posix)", tier, why)
            return Mode.POSIX
        raise GDSUnavailableError(f"tier {tier!r} (backend 'gds') cannot start: {why}. To fix: "
                                  f"{fix}.")
    return Mode.GDS if p.gds else Mode.COMPAT


def kvikio_settings(opts: Any, mode: Mode) -> dict[str, Any]:
    """The ``kvikio.defaults`` values this tier's options ask for (only those that were set)."""
    out: dict[str, Any] = {}
    if opts.num_threads is not None:
        out["num_threads"] = int(opts.num_threads)
    if opts.task_size is not None:
        out["task_size"] = int(opts.task_size)
    if opts.gds_threshold is not None:
        out["gds_threshold"] = int(opts.gds_threshold)
    if opts.direct_io_read is not None:
        out["auto_direct_io_read"] = bool(opts.direct_io_read)
    if opts.direct_io_write is not None:
        out["auto_direct_io_write"] = bool(opts.direct_io_write)
    if mode is Mode.COMPAT:
        out["compat_mode"] = 1  # CompatMode.ON: say so instead of letting AUTO retry cuFile
    elif opts.compat_mode != "auto":
        out["compat_mode"] = {"on": 1, "off": 0}[opts.compat_mode]
    return out

