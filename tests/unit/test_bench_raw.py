"""``kvplug bench``'s raw media, found through each backend class (:mod:`kvplug.bench_raw`).

The posix and resp raw rows run end to end in ``test_cli_bench.py``; here, without a server:
which raw medium each reference backend offers (``gds`` inherits posix's), why the others have
none, fsspec's medium moving random bytes through an in-memory filesystem, and a medium missing a
primitive refused when it is made."""

from __future__ import annotations

import os

import pytest
from kvplug.backends.fsspec.bench import RawFsspec
from kvplug.backends.posix.bench import RawFiles
from kvplug.bench_raw import RawTarget, raw_medium
from kvplug.config import TierConfig


def test_reference_backends_offer_their_raw_media(tmp_path) -> None:
    for backend in ("posix", "gds"):
        target, note = raw_medium(TierConfig(name="d", backend=backend,
                                             options={"path": str(tmp_path / backend)}))
        try:
            assert isinstance(target, RawFiles) and note == target.what
            assert str(tmp_path / backend) in note
        finally:
            target.close()
    target, note = raw_medium(TierConfig(name="s", backend="fsspec",
                                         options={"url": "memory://kvplug-bench-raw-test"}))
    assert isinstance(target, RawFsspec) and note == "fsspec pipe/cat on memory://"
    target.close()


def test_why_a_tier_has_no_raw_row() -> None:
    assert raw_medium(TierConfig(name="l1", backend="local_cpu", options={})) == (
        None, "local_cpu is memory itself: there is no medium under it")
    cluster = TierConfig(name="r", backend="resp",
                         options={"url": "redis://127.0.0.1:1", "cluster": True})
    assert raw_medium(cluster) == (  # decided before any connection (port 1: nothing there)
        None, "not measured for a cluster (redis-py's cluster client differs from the tier's)")


def test_fsspec_raw_medium_moves_the_bytes() -> None:
    target = RawFsspec(f"memory://kvplug-bench-raw-{os.getpid()}", {})
    values = [[os.urandom(17), os.urandom(4096)] for _ in range(3)]
    names = ["a", "b", "c"]
    try:
        target.put(names, values)
        assert target.get([*names, "missing"]) == [b"".join(v) for v in values] + [None]
        assert target.has(["b", "missing"]) == [True, False]
        target.delete(["b"])
        assert target.has(names) == [True, False, True]
    finally:
        target.close()
    assert not target.fs.exists(target.root)


def test_a_raw_medium_declares_every_primitive() -> None:
    class NoDelete(RawTarget):
        def put(self, names, parts): ...
        def get(self, names): ...
        def has(self, names): ...

    with pytest.raises(TypeError, match="delete"):
        NoDelete("incomplete")  # type: ignore[abstract]
