"""The posix tier's files against a hostile directory: links never followed, nothing deleted
outside the root, no entry that blocks an open, private modes."""

from __future__ import annotations

import grp
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.backends.posix import PosixBackend
from kvplug.hookspecs import TierContext
from kvplug.memory import MemoryFormat, heap_memory_obj
from kvplug.testing import make_key

HANG_S = 30.0  # only catches a hang; nothing here takes more than a fraction of it


def obj_for(i: int, nbytes: int = 3 * 2 * 2500):
    obj = heap_memory_obj((3, 2, nbytes // 6), torch.uint8, MemoryFormat.KV_PAGES, 32)
    gen = torch.Generator().manual_seed(i)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def backend(path, wait: bool = True, **opts) -> PosixBackend:
    be = PosixBackend(TierContext("disk", PosixBackend.Options(path=str(path), **opts),
                                  heap_memory_obj))
    assert not wait or be.wait_indexed(HANG_S), "startup scan hung"
    return be


def put(be: PosixBackend, i: int) -> None:
    obj = obj_for(i)
    be.batched_submit_put(keys=[make_key(i)], objs=[obj])
    assert be.flush(timeout=HANG_S)
    obj.ref_down()


def valuable(d: Path, name: str = "model.safetensors") -> tuple[Path, bytes]:
    """A file someone cares about, named like a chunk file, outside the tier's root."""
    d.mkdir(parents=True, exist_ok=True)
    data = os.urandom(20_000)
    (d / name).write_bytes(data)
    return d / name, data


def finishes(fn, *args) -> object:
    """``fn(*args)`` on a thread that must finish within HANG_S (a blocking open hangs it)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} hung"
    return out[0] if out else None


# -- finding 3: a symlinked shard directory -----------------------------------------------------

@pytest.fixture
def linked_shard(tmp_path):
    """``root/<shard of key 1>`` is a symlink to a directory outside the root holding a
    valuable ``*.safetensors`` file and a real chunk file of key 1."""
    root, outside = tmp_path / "root", tmp_path / "models"
    root.mkdir()
    target, data = valuable(outside)
    other = backend(tmp_path / "other")  # a real chunk of key 1, in the linked directory
    put(other, 1)
    other.close()
    real = cf.chunk_path(tmp_path / "other", make_key(1))
    shutil.copy(real, outside / real.name)
    os.symlink(outside, root / cf.shard_of(make_key(1)))
    return root, outside, target, data


def test_startup_trim_never_deletes_through_a_linked_shard(linked_shard):
    root, outside, target, data = linked_shard
    be = backend(root, capacity=1000)  # far below the linked files: a trim would take them
    try:
        assert target.read_bytes() == data, "start-up trim deleted a file outside the root"
        assert len(list(outside.iterdir())) == 2
        assert be.stats()["entries"] == 0, "files behind a linked shard were indexed"
    finally:
        be.close()
    assert target.read_bytes() == data, "the final trim at close deleted a file outside the root"


def test_eviction_never_deletes_through_a_linked_shard(linked_shard):
    root, outside, target, data = linked_shard
    be = backend(root, capacity=40_000, rescan_interval_s=0)
    try:
        # a lookup through the link must not index (and later evict) the file behind it
        assert be.contains([make_key(1)], pin=False) == [False]
        assert be.get(make_key(1)) is None
        for i in range(2, 12):  # capacity pressure: rescans and LRU evictions
            put(be, i)
        be.evict(None, 1 << 40)
        assert be.evict([make_key(1)], 0) == 0, "evicted a file behind a linked shard"
        assert be.flush(HANG_S)
    finally:
        be.close()
    assert target.read_bytes() == data, "eviction deleted a file outside the root"
    assert len(list(outside.iterdir())) == 2


def test_a_put_never_writes_through_a_linked_shard(linked_shard):
    root, outside, _, _ = linked_shard
    be = backend(root)
    try:
        before = sorted(p.name for p in outside.iterdir())
        (outside / cf.chunk_name(make_key(1))).unlink()  # the chunk is not there: a put would write
        put(be, 1)
        assert sorted(p.name for p in outside.iterdir()) == [n for n in before
                                                             if n != cf.chunk_name(make_key(1))]
        assert be.stats()["failed_puts"] == 1
    finally:
        be.close()


# -- finding 4: entries that block an open, links at chunk paths --------------------------------

def test_a_fifo_at_a_chunk_path_never_hangs_lookup_get_or_unpin(tmp_path):
    be = backend(tmp_path)
    fifo = cf.chunk_path(tmp_path, make_key(1))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    try:
        assert finishes(be.contains, [make_key(1)], True) == [False]
        assert finishes(be.get, make_key(1)) is None
        assert finishes(be.get_layers, make_key(1), 0, 1) is None
        finishes(be.unpin, [make_key(1)])
        assert finishes(be.evict, None, 1 << 30) == 0
        put(be, 1)  # the next store replaces the FIFO with a real chunk file
        got = finishes(be.get, make_key(1))
        assert got is not None and torch.equal(got.byte_view, obj_for(1).byte_view)
        got.ref_down()
    finally:
        try:  # a reader hung on the FIFO (the failure this test catches) is released by a writer
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        finishes(be.close)


def test_a_fifo_left_by_a_crash_never_hangs_the_startup_scan(tmp_path):
    fifo = cf.chunk_path(tmp_path, make_key(1))
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    be = finishes(backend, tmp_path)
    try:
        assert finishes(be.contains, [make_key(1)], True) == [False]
        assert finishes(be.get, make_key(1)) is None
        assert be.stats()["not_regular"] == 1, "a FIFO at a chunk path is counted"
    finally:
        finishes(be.close)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "a foreign entry is left in place"


def test_a_symlink_at_a_chunk_path_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    writer = backend(elsewhere)
    put(writer, 1)
    writer.close()
    real = cf.chunk_path(elsewhere, make_key(1))
    data = real.read_bytes()
    root = tmp_path / "root"
    link = cf.chunk_path(root, make_key(1))
    link.parent.mkdir(parents=True)
    os.symlink(real, link)  # a valid chunk of the key, but through a link
    be = backend(root)
    try:
        assert be.contains([make_key(1)], pin=True) == [False]
        be.unpin([make_key(1)])
        assert be.get(make_key(1)) is None
        assert be.get_layers(make_key(1), 0, 1) is None
        be.evict([make_key(1)], 0)
        be.evict(None, 1 << 30)
        assert be.flush(HANG_S)
    finally:
        be.close()
    assert real.read_bytes() == data, "the link's target was touched"


# -- finding 6: private by default -------------------------------------------------------------

@pytest.fixture
def open_base():
    """A base directory other users can traverse (0755, unlike pytest's 0700 tmp_path), so a
    mode check below it means something."""
    base = Path(tempfile.mkdtemp(prefix="kvplug-modes-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def modes(root: Path) -> dict[str, int]:
    f = cf.chunk_path(root, make_key(1))
    return {"root": stat.S_IMODE(root.stat().st_mode),
            "shard": stat.S_IMODE(f.parent.stat().st_mode),
            "file": stat.S_IMODE(f.stat().st_mode)}


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_files_and_directories_are_private_by_default(open_base, umask):
    old = os.umask(umask)
    try:
        be = backend(open_base / "cache" / "kvplug")
        put(be, 1)
        be.close()
    finally:
        os.umask(old)
    assert modes(open_base / "cache" / "kvplug") == {"root": 0o700, "shard": 0o700, "file": 0o600}
    leftovers = [p for p in (open_base / "cache" / "kvplug").rglob("*") if cf.is_temp(p.name)]
    assert not leftovers


def test_file_mode_and_group_for_a_shared_directory(open_base):
    gid = grp.getgrnam("nogroup").gr_gid
    old = os.umask(0o077)  # the owner's umask never narrows what the operator asked for
    try:
        be = backend(open_base / "shared", file_mode="0640", group="nogroup")
        put(be, 1)
        be.close()
    finally:
        os.umask(old)
    root = open_base / "shared"
    assert modes(root) == {"root": 0o750, "shard": 0o750, "file": 0o640}
    f = cf.chunk_path(root, make_key(1))
    assert {root.stat().st_gid, f.parent.stat().st_gid, f.stat().st_gid} == {gid}
    be = backend(root, group=gid)  # a numeric gid is accepted too
    be.close()


@pytest.mark.parametrize(("opts", "match"), [
    ({"file_mode": "rw-r-----"}, "octal"),
    ({"file_mode": "0400"}, "owner"),
    ({"file_mode": "0750"}, "execute"),
    ({"file_mode": "4600"}, "0o7777|permission bits"),
    ({"group": "no-such-group-kvplug"}, "no-such-group-kvplug"),
])
def test_bad_mode_or_group_options_are_clear_errors(tmp_path, opts, match):
    with pytest.raises(ValueError, match=match):
        PosixBackend.Options(path=str(tmp_path), **opts)


def test_an_existing_wider_root_is_warned_about_not_changed(open_base, caplog):
    root = open_base / "theirs"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with caplog.at_level(logging.WARNING, logger="kvplug.backends.posix"):
        be = backend(root)
        put(be, 1)
        be.close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o755, "an operator's directory was chmod-ed"
    warned = [r.getMessage() for r in caplog.records if "0755" in r.getMessage()]
    assert len(warned) == 1 and str(root) in warned[0] and "chmod 700" in warned[0], warned
    assert modes(root)["file"] == 0o600


def test_another_user_cannot_read_a_chunk(open_base):
    if shutil.which("runuser") is None or os.geteuid() != 0:
        pytest.skip("needs root and runuser to act as another user")
    be = backend(open_base / "cache")
    put(be, 1)
    be.close()
    f = cf.chunk_path(open_base / "cache", make_key(1))
    as_nobody = ["runuser", "-u", "nobody", "--", "cat", str(f)]
    got = subprocess.run(as_nobody, capture_output=True, timeout=HANG_S)
    assert got.returncode != 0 and not got.stdout, "another local user read a chunk"
    # negative control: the same command reads a file that is meant to be public
    public = open_base / "public.txt"
    public.write_bytes(b"hello")
    os.chmod(public, 0o644)
    ok = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(public)],
                        capture_output=True, timeout=HANG_S)
    assert ok.returncode == 0 and ok.stdout == b"hello"


def test_the_default_root_is_private(open_base, monkeypatch):
    monkeypatch.delenv("KVPLUG_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(open_base / "xdg"))
    from kvplug.config import default_cache_dir, default_tiers

    (disk,) = [t for t in default_tiers() if t.backend == "posix"]
    be = backend(disk.options["path"])
    put(be, 1)
    be.close()
    assert Path(disk.options["path"]).parent == default_cache_dir() == open_base / "xdg" / "kvplug"
    for d in (default_cache_dir(), default_cache_dir() / "chunks"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert modes(default_cache_dir() / "chunks")["file"] == 0o600


def test_a_hung_startup_scan_delays_stores_never_hangs_close(tmp_path, monkeypatch):
    """Every wait of the tier is bounded: a scan stuck on a hung file system makes the writer
    skip its store (counted) and ``close`` go on without it."""
    from kvplug.backends.posix import backend as posix_mod
    from kvplug.backends.posix import directory as posix_dir

    gate = threading.Event()
    real_scan = posix_dir.scan

    def stuck(root, *a, **kw):
        gate.wait(HANG_S)
        return real_scan(root, *a, **kw)

    monkeypatch.setattr(posix_dir, "scan", stuck)
    monkeypatch.setattr(posix_dir, "INDEX_WAIT_S", 0.5)
    monkeypatch.setattr(posix_mod, "CLOSE_WAIT_S", 0.5)
    be = backend(tmp_path, wait=False)
    try:
        obj = obj_for(1)
        be.batched_submit_put(keys=[make_key(1)], objs=[obj])
        assert be.flush(HANG_S / 2), "a write waited for the stuck scan without a bound"
        obj.ref_down()
        assert be.stats()["skipped_puts"] == 1 and be.stats()["indexed"] == 0
        finishes(be.close)
    finally:
        gate.set()
