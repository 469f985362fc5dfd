"""The ``posix`` tier: chunk files in a local or shared directory (entry point
``kvplug.backends.posix:PosixBackend``).

* :mod:`.backend` — the hooks: write queue, reads, lookup and pins, capacity;
* :mod:`.index`   — which files exist, their LRU order and this process's pins;
* :mod:`.io`      — the bytes: atomic writes, vectored (optionally O_DIRECT) reads.
"""

from .backend import PosixBackend

__all__ = ["PosixBackend"]
