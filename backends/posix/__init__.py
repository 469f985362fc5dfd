"""The ``posix`` tier: chunk files in a local or shared directory (entry point
``kvplug.backends.posix:PosixBackend``).

* :mod:`.backend`   — the tier's options and hooks, a composition of the parts below;
* :mod:`.directory` — the index of the files: scans, capacity, eviction, the shared LRU, quotas;
* :mod:`.index`     — the index itself (compact, LRU order, pins) and the directory scan;
* :mod:`.writer`    — the write queue; :mod:`.reader` — reads, every problem a miss;
* :mod:`.held`      — pinned files held open; :mod:`.reaper` — evicted files deleted off-thread;
* :mod:`.io`        — the bytes of one chunk file; :mod:`.fs` — every call under the root.
"""

from .backend import PosixBackend

__all__ = ["PosixBackend"]
