"""``kvplug bench``'s raw medium for the ``fsspec`` tier: the tier's filesystem through fsspec's
``pipe``/``cat`` (:mod:`kvplug.bench_raw`)."""

from __future__ import annotations

from typing import Any

from kvplug.bench_raw import RawTarget


class RawFsspec(RawTarget):
    """The tier's fsspec filesystem: ``pipe`` and ``cat`` of many paths at once, ``exists``."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        import fsspec

        super().__init__(f"fsspec pipe/cat on {url.split('://', 1)[0]}://")
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/") + "/" + self.prefix

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def put(self, names: list[str], parts: list[list[Any]]) -> None:
        self.fs.pipe({self._path(n): b"".join(p) for n, p in zip(names, parts)})

    def get(self, names: list[str]) -> list[Any]:
        paths = [self._path(n) for n in names]
        got = self.fs.cat(paths, on_error="omit")
        return [got.get(p) for p in paths]

    def has(self, names: list[str]) -> list[bool]:
        return [self.fs.exists(self._path(n)) for n in names]

    def delete(self, names: list[str]) -> None:
        self.fs.rm([self._path(n) for n in names])

    def close(self) -> None:
        try:
            self.fs.rm(self.root, recursive=True)
        except (FileNotFoundError, OSError):
            pass


__all__ = ["RawFsspec"]
