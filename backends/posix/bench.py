"""``kvplug bench``'s raw medium for file tiers (``posix``, ``gds``): plain files in the tier's
directory, the same encoded chunk bytes the tier writes (:mod:`kvplug.bench_raw`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from kvplug.bench_raw import RawTarget


class RawFiles(RawTarget):
    """Plain files in the tier's directory: ``os.pwritev`` (plus ``fsync`` when the tier fsyncs)
    and ``os.preadv`` into one buffer, ``os.stat`` for a lookup."""

    def __init__(self, root: str, fsync: bool) -> None:
        super().__init__(f"files in {root} (os.pwritev/os.preadv{', fsync' if fsync else ''})")
        self.dir = Path(root) / self.prefix
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.fsync = fsync

    def put(self, names: list[str], parts: list[list[Any]]) -> None:
        for name, bufs in zip(names, parts):
            fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.pwritev(fd, bufs, 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def get(self, names: list[str]) -> list[Any]:
        out: list[Any] = []
        for name in names:
            try:
                fd = os.open(self.dir / name, os.O_RDONLY)
            except FileNotFoundError:
                out.append(None)
                continue
            try:
                buf = bytearray(os.fstat(fd).st_size)
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            out.append(buf)
        return out

    def has(self, names: list[str]) -> list[bool]:
        return [os.path.exists(self.dir / n) for n in names]

    def delete(self, names: list[str]) -> None:
        for n in names:
            try:
                os.unlink(self.dir / n)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["RawFiles"]
