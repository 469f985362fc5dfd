"""The posix tier's byte paths: one read call per file whose header is known, writes through the
shard directory's descriptor with a batched hand-off, and what stays a miss on either path."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.backends.posix import PosixBackend
from kvplug.backends.posix import io as posix_io
from kvplug.backends.posix import writer as posix_writer
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.memory import MemoryFormat, heap_memory_obj
from kvplug.testing import make_key

from tests.support.page_cache import drop_from_page_cache


def random_obj(i: int, shape=(4, 2, 4096)):
    obj = heap_memory_obj(shape, torch.uint8, MemoryFormat.KV_PAGES, 32)
    gen = torch.Generator().manual_seed(1000 + i)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def backend(path, **opts) -> PosixBackend:
    be = PosixBackend(TierContext("disk", PosixBackend.Options(path=str(path), **opts),
                                  heap_memory_obj))
    assert be.wait_indexed(60)
    return be


def store(be: PosixBackend, objs: dict[int, object]) -> None:
    be.batched_submit_put(keys=[make_key(i) for i in objs], objs=list(objs.values()))
    assert be.flush(timeout=30)


class Spy:
    """Counts calls of ``os.preadv`` made by the posix tier's I/O module."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[int] = []
        real = os.preadv

        def preadv(fd, bufs, offset, *flags):
            self.calls.append(offset)
            return real(fd, bufs, offset, *flags)

        monkeypatch.setattr(posix_io.os, "preadv", preadv)


@pytest.mark.parametrize("shape", [(4, 2, 4096), (3, 2, 1000), (1, 1, 64)])  # padded or not
def test_a_known_header_is_read_with_the_layers_in_one_call(tmp_path, monkeypatch, shape):
    """A file the tier wrote (its header cached) is read with one ``preadv`` (header and
    layers), the bytes equal what was stored; a layer range from layer 0 too; a range further
    in reads the header, then the layers (negative control: two calls)."""
    be = backend(tmp_path)
    src = random_obj(1, shape)
    store(be, {1: src})
    spy = Spy(monkeypatch)
    got = be.get(key=make_key(1))
    assert got is not None and torch.equal(got.byte_view, src.byte_view)
    assert spy.calls == [0], f"a read of a known file took {len(spy.calls)} calls"
    got.ref_down()
    if shape[0] > 1:
        spy.calls.clear()
        part = be.get_layers(key=make_key(1), first_layer=0, num_layers=shape[0] - 1)
        assert part is not None and torch.equal(part.tensor, src.tensor[: shape[0] - 1])
        assert spy.calls == [0]
        part.ref_down()
        spy.calls.clear()
        part = be.get_layers(key=make_key(1), first_layer=1, num_layers=1)
        assert part is not None and torch.equal(part.tensor[0], src.tensor[1])
        assert len(spy.calls) == 2
        part.ref_down()
    assert be.stats()["corrupt"] == 0
    be.close()


def test_a_damaged_layer_under_a_known_header_is_a_deleted_miss(tmp_path):
    """The one-call read verifies every layer it read: one flipped payload byte (the header the
    tier cached still matches) is a miss, counted, the file deleted; a neighbour is still read."""
    be = backend(tmp_path)
    objs = {1: random_obj(1), 2: random_obj(2)}
    store(be, objs)
    path = cf.chunk_path(tmp_path, make_key(1))
    head = cf.read_header_fd(os.open(path, os.O_RDONLY))[0]
    with open(path, "r+b") as f:
        f.seek(head.data_offsets[2] + 17)
        byte = f.read(1)
        f.seek(head.data_offsets[2] + 17)
        f.write(bytes([byte[0] ^ 0x40]))
    assert be.get(key=make_key(1)) is None
    assert be.stats()["corrupt"] == 1 and not path.exists()
    got = be.get(key=make_key(2))
    assert got is not None and torch.equal(got.byte_view, objs[2].byte_view)
    got.ref_down()
    be.close()


def test_a_file_cut_short_while_its_header_is_known_is_a_miss(tmp_path, monkeypatch):
    """A file truncated after the size check (another process cutting it while it is read): the
    one-call read comes back short and the read is a miss, counted, never bytes."""
    be = backend(tmp_path)
    store(be, {1: random_obj(1)})
    path = cf.chunk_path(tmp_path, make_key(1))
    real = os.preadv

    def cut_then_read(fd, bufs, offset, *flags):
        os.truncate(path, os.path.getsize(path) - 4096)  # after fstat, before the read
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(posix_io.os, "preadv", cut_then_read)
    assert be.get(key=make_key(1)) is None
    monkeypatch.undo()
    assert be.stats()["corrupt"] == 1 and be.stats()["reads"] == 0
    be.close()


def test_a_store_opens_its_shard_once_and_its_file_again_only_for_a_pin(tmp_path, monkeypatch):
    """A write opens the shard directory once (check, create, rename through it) and does not
    open the file it wrote again unless a pin waits for it (the pinned case is
    ``test_posix.test_pinned_files_held_open_are_bounded``)."""
    be = backend(tmp_path)
    store(be, {0: random_obj(0)})  # the shard directories exist from here on
    opened: list[str] = []
    real = posix_writer._open_quietly
    monkeypatch.setattr(posix_writer, "_open_quietly", lambda p: (opened.append(p), real(p))[1])
    dirs: list[str] = []
    real_dir = getattr(posix_writer, "directory_of", None)

    def spy_dir(path, **kw):
        dirs.append(str(path))
        return real_dir(path, **kw)

    monkeypatch.setattr(posix_writer, "directory_of", spy_dir, raising=False)
    objs = {i: random_obj(i) for i in range(1, 6)}
    store(be, objs)
    assert opened == [], "a file nobody pinned was opened again after its write"
    assert len(dirs) == 5
    for i, obj in objs.items():
        got = be.get(key=make_key(i))
        assert got is not None and torch.equal(got.byte_view, obj.byte_view)
        got.ref_down()
        assert os.stat(cf.chunk_path(tmp_path, make_key(i))).st_mode & 0o777 == 0o600
    be.close()


def test_one_call_s_writes_reach_the_threads_as_one_job_per_thread(tmp_path, monkeypatch):
    """96 keys in one ``batched_submit_put`` are at most ``io_threads`` jobs for the writer
    threads, every key written (bytes compared), nothing left queued."""
    be = backend(tmp_path, io_threads=2)
    jobs: list[int] = []
    real = be.writer._pool.submit

    def spy(fn, *args):
        jobs.append(len(args[0]) if isinstance(args[0], list) else 1)  # keys in this job
        return real(fn, *args)

    monkeypatch.setattr(be.writer._pool, "submit", spy)
    objs = {i: random_obj(i, (2, 1, 4096)) for i in range(96)}
    store(be, objs)
    assert sorted(jobs) == [48, 48]
    assert be.stats()["writes"] == 96 and be.stats()["pending_writes"] == 0
    for i, obj in objs.items():
        assert obj.ref_count == 1
        got = be.get(key=make_key(i))
        assert got is not None and torch.equal(got.byte_view, obj.byte_view)
        got.ref_down()
    be.close()


def test_a_write_that_fails_midway_leaves_no_file(tmp_path, monkeypatch):
    """A write cut off inside the temporary file (the disk fills after half the bytes) leaves
    neither the chunk nor its temporary file; the store is counted failed, a later one works."""
    be = backend(tmp_path)
    real = os.pwritev
    seen = threading.Event()

    def half_then_full(fd, bufs, offset, *a):
        seen.set()
        real(fd, [bytes(memoryview(bufs[0])[:100])], offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(posix_io.os, "pwritev", half_then_full)
    be.batched_submit_put(keys=[make_key(1)], objs=[random_obj(1)])
    assert be.flush(30) and seen.is_set()
    assert be.stats()["failed_puts"] == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".kvplug-pins"]
    assert be.contains(keys=[make_key(1)], pin=False) == [False]
    monkeypatch.undo()
    src = random_obj(1)
    store(be, {1: src})
    got = be.get(key=make_key(1))
    assert got is not None and torch.equal(got.byte_view, src.byte_view)
    got.ref_down()
    be.close()


def test_vectored_io_finishes_short_transfers_in_order(tmp_path):
    """``_io_all`` moves every byte of every buffer in order when the kernel moves fewer per call
    (a short write, past IOV_MAX buffers) and a read stops at the end of the file."""
    data = os.urandom(5000)
    bufs = [memoryview(data)[i : i + 3] for i in range(0, 5000, 3)]  # 1667 buffers > IOV_MAX
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        calls = []

        def short_write(f, buffers, off):
            calls.append(len(buffers))
            return os.pwritev(f, [bytes(b"".join(bytes(x) for x in buffers))[:700]], off)

        assert posix_io._io_all(short_write, fd, bufs, 0) == 5000
        assert os.pread(fd, 6000, 0) == data and len(calls) > 3
        out = [bytearray(100) for _ in range(60)]  # 6000 bytes asked, 5000 there
        assert posix_io._io_all(os.preadv, fd, [memoryview(b) for b in out], 0) == 5000
        assert b"".join(out)[:5000] == data
    finally:
        os.close(fd)


# -- reads without waiting (batched_get_nowait) --------------------------------------------------
class Bounded:
    """A wrapper on one tier counting its bounded reads (the calls handed to its pool)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl(wrapper=True)
    def get(self, key):
        self.calls.append("get")
        return (yield)

    @hookimpl(wrapper=True)
    def batched_get(self, keys):
        self.calls.append("batched_get")
        return (yield)


def posix_manager(root):
    from kvplug.storage_manager import StorageManager

    mgr = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(root)}}]})
    spy = Bounded()
    mgr.add_wrapper(spy, tiers=["posix"])
    return mgr, spy


def stored_in(mgr, n: int, shape=(4, 2, 4096)) -> dict[int, torch.Tensor]:
    want = {}
    for i in range(n):
        obj = mgr.allocate(shape, torch.uint8, num_tokens=32)
        obj.tensor.copy_(random_obj(i, shape).tensor)
        want[i] = obj.tensor.clone()
        mgr.batched_put([make_key(i)], [obj])
        obj.ref_down()
    assert mgr.flush(30)
    return want


def test_a_chunk_in_the_page_cache_is_read_on_the_callers_thread(tmp_path):
    """Files just written are in the page cache: ``get`` and ``batched_get`` read them on the
    calling thread (no bounded call handed to the tier's pool), with the stored bytes."""
    mgr, spy = posix_manager(tmp_path)
    want = stored_in(mgr, 20)
    got = mgr.get(make_key(0))
    assert got is not None and torch.equal(got.tensor, want[0])
    got.ref_down()
    objs = mgr.batched_get([make_key(i) for i in range(20)] + [make_key(404)])
    assert objs[20] is None
    for i, obj in enumerate(objs[:20]):
        assert obj is not None and torch.equal(obj.tensor, want[i])
        obj.ref_down()
    assert spy.calls == ["get"], "only the key never stored is asked the bounded way"
    st = mgr.stats()["posix"]
    assert st["reads_without_wait"] == 21 and st["hits"] == 21 and st["misses"] == 1
    mgr.close()


def test_a_chunk_only_on_the_device_is_read_the_bounded_way(tmp_path):
    """A file dropped from the page cache (``POSIX_FADV_DONTNEED``) would need a device read: it
    is not read on the caller's thread but by the bounded call, with the stored bytes. On a file
    system held in memory (tmpfs) nothing waits, so the caller's thread reads it. The file is
    seen dropped (``mincore``) after the file system's probe, whose missed read starts
    readahead that could bring it back."""
    mgr, spy = posix_manager(tmp_path)
    want = stored_in(mgr, 1, (4, 8, 4096))
    path = cf.chunk_path(tmp_path, make_key(0))
    fd = os.open(path, os.O_RDONLY)
    try:
        in_memory = posix_io.nowait_read_flags(fd) == 0
    finally:
        os.close(fd)
    if not in_memory:
        drop_from_page_cache(path)
    got = mgr.get(make_key(0))
    assert got is not None and torch.equal(got.tensor, want[0])
    got.ref_down()
    assert spy.calls == ([] if in_memory else ["get"])
    assert mgr.stats()["posix"]["reads_without_wait"] == int(in_memory)
    mgr.close()


def test_a_damaged_or_linked_entry_is_left_to_the_bounded_read(tmp_path):
    """A read without waiting that finds a damaged file or a symlink does nothing about it
    (returns nothing, counts nothing, deletes nothing); the bounded read that follows counts it
    once and deletes the damaged file; the link is never followed."""
    mgr, spy = posix_manager(tmp_path)
    stored_in(mgr, 2)
    path = cf.chunk_path(tmp_path, make_key(0))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        f.write(b"\xff\x00\xff\x00\xff")
    disk = mgr.backend(0)
    assert disk.batched_get_nowait(keys=[make_key(0)]) == [None]
    assert path.exists() and disk.stats()["corrupt"] == 0
    assert mgr.get(make_key(0)) is None
    assert disk.stats()["corrupt"] == 1 and not path.exists()
    secret = tmp_path.parent / f"{tmp_path.name}-secret"
    secret.write_bytes(b"x" * 4096)
    other = cf.chunk_path(tmp_path, make_key(1))
    other.unlink()
    other.symlink_to(secret)
    assert disk.batched_get_nowait(keys=[make_key(1)]) == [None]
    assert mgr.get(make_key(1)) is None and secret.read_bytes() == b"x" * 4096
    assert spy.calls == ["get", "get"]
    mgr.close()


def test_a_pinned_chunk_is_read_through_its_held_file_without_waiting(tmp_path, monkeypatch):
    """A chunk pinned by a lookup and then deleted by another process is read on the caller's
    thread through the file the pin holds open, and its LRU stamp (the file's mtime) is bumped
    off that thread."""
    from kvplug.backends.posix import directory as posix_dir

    monkeypatch.setattr(posix_dir, "_TOUCH_EVERY_S", -1.0)  # every read bumps the stamp
    mgr, spy = posix_manager(tmp_path)
    want = stored_in(mgr, 1)
    path = cf.chunk_path(tmp_path, make_key(0))
    assert mgr.lookup_prefix([make_key(0)], pin=True).num_chunks == 1
    os.utime(path, (1_000_000, 1_000_000))  # after the pin's own bump
    got = mgr.get(make_key(0))
    assert got is not None and torch.equal(got.tensor, want[0])
    got.ref_down()
    deadline = time.monotonic() + 30  # a hang guard: the bump runs on the reaper's thread
    while os.stat(path).st_mtime < 2_000_000:
        assert time.monotonic() < deadline, "the LRU stamp was never bumped"
        time.sleep(0.01)
    path.unlink()  # another process evicts it
    got = mgr.get(make_key(0))
    assert got is not None and torch.equal(got.tensor, want[0])
    got.ref_down()
    assert spy.calls == []
    assert mgr.stats()["posix"]["reads_without_wait"] == 2
    mgr.unpin([make_key(0)], tiers=["posix"])
    mgr.close()
