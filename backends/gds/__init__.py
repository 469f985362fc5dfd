"""The ``gds`` tier: the posix tier's directory read and written through kvikio (GPUDirect
Storage where the machine has it). Entry point ``kvplug.backends.gds:GDSBackend``.

* :mod:`.backend` — the tier (a :class:`~kvplug.backends.posix.PosixBackend` with kvikio I/O);
* :mod:`.io`      — chunk files through ``kvikio.CuFile``, device-aware checksums;
* :mod:`.probe`   — what this machine can do, and the mode the tier runs in.
"""

from .backend import GDSBackend

__all__ = ["GDSBackend"]
