"""The raw medium under a tier, for ``kvplug bench``: the same encoded chunk bytes the tier stores,
moved the plainest way its medium allows (plain files, redis-py, fsspec's ``pipe``/``cat``, a
second Mooncake client), so each bench row has a tier/raw ratio measured in the same run.

A backend offers its raw medium on its backend class, as it declares its other properties:

* ``bench_raw(options) -> RawTarget | None`` (a static method, optional): a :class:`RawTarget`
  over the medium the tier with these resolved options (its ``Options`` model) uses, or None
  where there is none for these options. It raises :class:`BenchError` for what the user fixes
  (an unreachable server), naming the option to check.
* ``bench_no_raw: str`` (optional): why a tier of this backend has no raw row, shown in the
  report when ``bench_raw`` is absent or returns None.

The reference backends keep theirs in ``backends/<family>/bench.py``; a third-party backend may
offer one the same way. Nothing here imports a client library: each raw medium imports its own
when it is opened.
"""

from __future__ import annotations

import uuid
import warnings
from abc import ABC, abstractmethod
from typing import Any

import torch

from . import chunkfile as cf
from .config import TierConfig
from .errors import KVPlugError
from .keys import CacheKey
from .memory import MemoryObj

#: shown when a backend says nothing about a raw medium
NO_RAW_KNOWN = "none known for this backend"


class BenchError(KVPlugError):
    """A setup problem the user fixes (bad value, unreachable server)."""


class RawTarget(ABC):
    """The medium under a tier, moved the plainest way: the same encoded chunk bytes the tier
    stores (header and layers), one value per file/key. A medium implements ``put``, ``get``,
    ``has`` and ``delete`` for a batch of names, and ``close`` where it holds something."""

    label = "raw"

    def __init__(self, what: str) -> None:
        #: what the medium is and how it is moved (the report's ``raw`` line)
        self.what = what
        self.prefix = f"kvplug-bench-raw-{uuid.uuid4().hex[:12]}"

    def name(self, key: CacheKey) -> str:
        return f"{self.prefix}-{key.chunk_hash.hex()}"

    def encode(self, key: CacheKey, obj: MemoryObj) -> list[Any]:
        header, bufs = cf.encode_chunk(key, obj)
        return [header, *bufs]

    def store(self, keys: list[CacheKey], objs: list[MemoryObj]) -> None:
        self.put([self.name(k) for k in keys], [self.encode(k, o) for k, o in zip(keys, objs)])

    def held(self, keys: list[CacheKey]) -> list[bool]:
        return self.has([self.name(k) for k in keys])

    def lookup(self, keys: list[CacheKey]) -> int:
        found = self.has([self.name(k) for k in keys])
        return next((i for i, f in enumerate(found) if not f), len(found))

    def load(self, keys: list[CacheKey]) -> list[Any]:
        return self.get([self.name(k) for k in keys])

    def release(self, got: Any) -> None:  # noqa: B027 - optional: a raw read is plain bytes
        """Give back what :meth:`load` returned (nothing to do for plain bytes)."""

    def payload(self, got: Any) -> torch.Tensor:
        """The layers of a whole chunk file read back (its header says where they are)."""
        data = memoryview(got)
        header = cf.decode_header(data, len(data))
        with warnings.catch_warnings():  # bytes from a client are read-only; only compared here
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(data, dtype=torch.uint8)
        return torch.cat([t[o : o + header.layer_nbytes] for o in header.data_offsets])

    def remove(self, keys: list[CacheKey]) -> None:
        if keys:
            self.delete([self.name(k) for k in keys])

    @abstractmethod
    def put(self, names: list[str], parts: list[list[Any]]) -> None:
        """Store each name's value, given as its parts (header, then layers) in order."""

    @abstractmethod
    def get(self, names: list[str]) -> list[Any]:
        """Each name's whole value (a bytes-like object), or None where it is missing."""

    @abstractmethod
    def has(self, names: list[str]) -> list[bool]:
        """Whether each name is held."""

    @abstractmethod
    def delete(self, names: list[str]) -> None:
        """Drop these names (a missing one is no error)."""

    def close(self) -> None:  # noqa: B027 - optional: a medium holding nothing needs none
        """Drop whatever the medium still holds of this run, and its client."""


def raw_medium(tier: TierConfig) -> tuple[RawTarget | None, str]:
    """The raw medium under ``tier`` (its backend class's ``bench_raw``, given the tier's resolved
    options) and what it is, or None and why there is none."""
    from .plugins import load_backend_class

    cls, _ = load_backend_class(tier.backend)
    make = getattr(cls, "bench_raw", None)
    model = getattr(cls, "Options", None)
    target = make(model.model_validate(tier.options) if model is not None else None) \
        if make is not None else None
    if target is not None:
        return target, target.what
    return None, getattr(cls, "bench_no_raw", NO_RAW_KNOWN)


__all__ = ["NO_RAW_KNOWN", "BenchError", "RawTarget", "raw_medium"]
