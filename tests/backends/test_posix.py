"""The posix tier: integrity (every damaged file is a miss), restart, capacity, failure modes."""

from __future__ import annotations

import errno
import logging
import os
import time

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.backends.posix import PosixBackend
from kvplug.backends.posix import directory as posix_dir
from kvplug.backends.posix import io as posix_io
from kvplug.hookspecs import TierContext
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, heap_memory_obj
from kvplug.runtime import Runtime
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key
from safetensors import safe_open


def obj_for(i: int, shape=(3, 2, 2500), dtype=torch.uint8, num_tokens=32):
    obj = heap_memory_obj(shape, dtype, MemoryFormat.KV_PAGES, num_tokens)
    gen = torch.Generator().manual_seed(i)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def backend(path, wait: bool = True, **opts) -> PosixBackend:
    """A posix tier over ``path``; with ``wait``, once its startup scan has indexed the files."""
    options = PosixBackend.Options(path=str(path), **opts)
    be = PosixBackend(TierContext("disk", options, heap_memory_obj))
    assert not wait or be.wait_indexed(60), "startup scan hung"
    return be


def put(be: PosixBackend, i: int, **kw):
    obj = obj_for(i, **kw)
    be.batched_submit_put(keys=[make_key(i)], objs=[obj])
    assert be.flush(timeout=30)
    assert obj.ref_count == 1, "the writer must drop its reference when done"
    return obj


def dir_bytes(root) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root) for f in files if f.endswith(cf.FILE_SUFFIX)
    )


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((4, 2, 4096), torch.uint8), ((3, 2, 1000), torch.bfloat16), ((2, 5, 3), torch.float32),
     ((6, 1, 8192), torch.int8)],
)
def test_round_trip_whole_and_layers(tmp_path, shape, dtype, o_direct):
    tiers = [
        {"backend": "local_cpu", "options": {"capacity": "4MiB"}},
        {"backend": "posix", "options": {"path": str(tmp_path), "o_direct": o_direct}},
    ]
    with StorageManager({"tiers": tiers, "chunk_size": 16}) as mgr:
        src = obj_for(7, shape, dtype, num_tokens=11)
        expect = src.byte_view.clone()
        layers_expect = src.tensor.clone()
        mgr.batched_put([make_key(7)], [src])
        assert mgr.flush(30)
        src.ref_down()
        disk = mgr.backend(1)
        mgr.evict([make_key(7)], tiers=[mgr.tier_names[0]])  # ...now only on disk
        assert mgr.lookup_prefix([make_key(7)]).tiers == ["posix"]
        got = mgr.get(make_key(7))
        assert got is not None and torch.equal(got.byte_view, expect)
        assert got.tensor.shape == shape and got.tensor.dtype == dtype and got.num_tokens == 11
        assert mgr.lookup_prefix([make_key(7)]).tiers == ["local_cpu"], "disk hit not promoted to L1"
        got.ref_down()
        for first, count in [(0, 1), (1, shape[0] - 1), (shape[0] - 1, 1)]:
            part = mgr.get_layers(make_key(7), first, count)
            assert part is not None and part.tensor.shape == (count, *shape[1:])
            want = layers_expect[first : first + count].reshape(-1).view(torch.uint8)
            assert torch.equal(part.byte_view, want)
            part.ref_down()
        assert disk.get_layers(key=make_key(7), first_layer=shape[0], num_layers=1) is None
        assert cf.chunk_path(tmp_path, make_key(7)).exists(), "a bad range must not delete the file"
        assert disk.stats()["corrupt"] == 0 and disk.stats()["o_direct"] == int(o_direct)


def test_o_direct_is_used_when_aligned_and_falls_back(tmp_path, monkeypatch, caplog):
    seen: list[int] = []
    real_open = os.open

    def spy(path, flags, *a, **kw):
        if str(path).startswith(str(tmp_path)):
            seen.append(flags)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(posix_io.os, "open", spy)
    be = backend(tmp_path / "d", o_direct=True)
    pool_obj = put(be, 1, shape=(2, 2, 4096))  # heap memory: maybe unaligned -> buffered write
    got = be.get(key=make_key(1))
    assert got is not None and torch.equal(got.byte_view, pool_obj.byte_view)
    assert any(f & posix_io.O_DIRECT for f in seen), "O_DIRECT was never used"
    be.close()
    # A file system that refuses O_DIRECT: logged once, buffered I/O, still correct.
    monkeypatch.setattr(posix_io, "probe_o_direct", lambda root: "EINVAL: not supported")
    seen.clear()
    with caplog.at_level(logging.WARNING, "kvplug.backends.posix"):
        be = backend(tmp_path / "e", o_direct=True)
    assert "O_DIRECT is not supported" in caplog.text and be.stats()["o_direct"] == 0
    put(be, 2)
    got = be.get(key=make_key(2))
    assert got is not None and not any(f & posix_io.O_DIRECT for f in seen)
    be.close()


def test_written_file_opens_with_safetensors(tmp_path):
    be = backend(tmp_path)
    src = put(be, 3, shape=(4, 2, 1000), dtype=torch.float16)
    path = cf.chunk_path(tmp_path, make_key(3))
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["model"] == make_key(0).model and f.metadata()["num_tokens"] == "32"
        layers = torch.stack([f.get_tensor(f"layer.{i}") for i in range(4)])
    assert torch.equal(layers.reshape(-1), src.byte_view)
    assert torch.equal(layers.view(-1).view(torch.float16).view(4, 2, 1000).view(torch.int16),
                       src.tensor.view(torch.int16))
    be.close()


def _damage_cases(data: bytes, head: cf.ChunkHeader):
    cuts = {0, 7, 8, 100, head.header_bytes - 1, head.header_bytes, len(data) - 1}
    for off in head.data_offsets:
        cuts |= {off + 1, off + head.layer_nbytes - 1, off + head.layer_nbytes}
    for cut in sorted(c for c in cuts if c < len(data)):
        yield f"truncated at {cut}", data[:cut]
    for pos in (0, 5, 9, 40, head.header_bytes // 2, head.header_bytes - 2):
        bad = bytearray(data)
        bad[pos] ^= 0x04
        yield f"header byte {pos} flipped", bytes(bad)
    for i, off in enumerate(head.data_offsets):
        for pos in (off, off + head.layer_nbytes - 1):
            bad = bytearray(data)
            bad[pos] ^= 0x01
            yield f"layer {i} byte {pos} flipped", bytes(bad)
    yield "appended junk", data + bytes(cf.ALIGN)


def test_every_damaged_file_is_a_counted_miss(tmp_path, caplog):
    be = backend(tmp_path)
    src = put(be, 5)
    path = cf.chunk_path(tmp_path, make_key(5))
    good = path.read_bytes()
    head = cf.decode_header(good, len(good))
    n = 0
    with caplog.at_level(logging.WARNING, "kvplug.backends.posix"):
        for what, data in _damage_cases(good, head):
            path.write_bytes(data)
            assert be.get(key=make_key(5)) is None, what
            assert not path.exists(), f"{what}: damaged file kept"
            n += 1
            assert be.stats()["corrupt"] == n
            assert be.contains(keys=[make_key(5)], pin=False) == [False]
            path.write_bytes(good)  # negative control: the intact file hits
            got = be.get(key=make_key(5))
            assert got is not None and torch.equal(got.byte_view, src.byte_view), what
            got.ref_down()
    assert str(path) in caplog.text
    assert be.get_layers(key=make_key(5), first_layer=1, num_layers=1) is not None
    be.close()


def test_wrong_key_is_a_deleted_miss(tmp_path):
    be = backend(tmp_path)
    put(be, 1)
    put(be, 2)
    p1, p2 = cf.chunk_path(tmp_path, make_key(1)), cf.chunk_path(tmp_path, make_key(2))
    p2.write_bytes(p1.read_bytes())  # key 1's file under key 2's name
    assert be.get(key=make_key(2)) is None and not p2.exists()
    assert be.stats()["corrupt"] == 1
    be.close()


def other_version_file(monkeypatch, k: CacheKey, i: int) -> bytes:
    """The bytes of a chunk file of ``k`` written by a node of another format version."""
    with monkeypatch.context() as m:
        m.setattr(cf.format, "FORMAT_VERSION", "2")
        header, bufs = cf.encode_chunk(k, obj_for(i))
    return header + b"".join(bytes(b) for b in bufs)


def test_other_format_version_is_a_miss_never_deleted(tmp_path, monkeypatch):
    """Rolling upgrade: a file of another format version is a miss for get, get_layers and
    contains (after the first read), and stays on disk: not quarantined, not removed by the
    startup scan; a file of our version that is damaged is still deleted (control)."""
    be = backend(tmp_path)
    put(be, 2)
    p1, p2 = cf.chunk_path(tmp_path, make_key(1)), cf.chunk_path(tmp_path, make_key(2))
    p1.parent.mkdir(parents=True, exist_ok=True)
    p1.write_bytes(other_version_file(monkeypatch, make_key(1), 1))
    assert be.get(key=make_key(1)) is None
    assert be.get_layers(key=make_key(1), first_layer=0, num_layers=1) is None
    assert be.contains(keys=[make_key(1)], pin=True) == [False], "an unreadable file was promised"
    assert p1.exists(), "another version's file was deleted by a reader"
    st = be.stats()
    assert st["corrupt"] == 0 and st["other_version"] >= 1 and st["pinned"] == 0
    be.close()
    again = backend(tmp_path, capacity=1 << 30)  # startup scan and trim leave it alone
    assert p1.exists() and again.get(key=make_key(1)) is None and p1.exists()
    data = bytearray(p2.read_bytes())
    data[cf.ALIGN + 10] ^= 1  # control: our own version, damaged (layer 0), is quarantined
    p2.write_bytes(bytes(data))
    assert again.get(key=make_key(2)) is None and not p2.exists()
    assert again.stats()["corrupt"] == 1
    again.close()


def test_restart_hits_and_other_managers_are_seen(tmp_path):
    cfg = {"tiers": [{"backend": "posix", "options": {"path": str(tmp_path)}}], "chunk_size": 16}
    srcs = [obj_for(i) for i in range(5)]
    with StorageManager(cfg) as a:
        a.batched_put([make_key(i) for i in range(5)], srcs)
    with StorageManager(cfg) as b, StorageManager(cfg) as c:
        assert b.backend(0).wait_indexed(60), "startup scan hung"  # the scan runs in the background
        assert b.stats()["posix"]["entries"] == 5, "index not rebuilt from the directory"
        assert b.lookup_prefix([make_key(i) for i in range(5)]).num_chunks == 5
        for i in range(5):
            got = b.get(make_key(i))
            assert got is not None and torch.equal(got.byte_view, srcs[i].byte_view)
            got.ref_down()
        c.batched_put([make_key(9)], [obj_for(9)])  # written by a live neighbour after b started
        c.flush()
        assert b.lookup_prefix([make_key(9)]).num_chunks == 1, "stat fallback missed a new file"
        c.evict([make_key(9)])  # evicted by the neighbour: b's stale index entry is a plain miss
        assert b.get(make_key(9)) is None and b.stats()["posix"]["corrupt"] == 0


def test_capacity_keeps_directory_bounded_and_pins_hold(tmp_path):
    file_size = cf.ALIGN + 3 * cf.align_up(2 * 2500)
    capacity = 10 * file_size + 100
    be = backend(tmp_path, capacity=capacity)
    put(be, 0)
    assert be.contains(keys=[make_key(0)], pin=True) == [True]
    for i in range(1, 40):
        put(be, i)
        assert dir_bytes(tmp_path) <= capacity
    assert be.contains(keys=[make_key(0), make_key(39), make_key(1)], pin=False) == [True, True, False]
    be.unpin(keys=[make_key(0)])
    put(be, 40)
    assert be.contains(keys=[make_key(0)], pin=False) == [False], "oldest unpinned file stayed"
    assert be.stats()["evictions"] >= 30 and be.stats()["bytes"] <= capacity
    be.close()
    small = backend(tmp_path, capacity=3 * file_size)  # a smaller bound applies at startup
    assert dir_bytes(tmp_path) <= 3 * file_size
    assert small.contains(keys=[make_key(40)], pin=False) == [True], "newest file evicted first"
    small.close()


def test_reads_bump_the_shared_lru(tmp_path, monkeypatch):
    monkeypatch.setattr(posix_dir, "_TOUCH_EVERY_S", 0.0)  # stamps are bumped at most 1/s
    file_size = cf.ALIGN + 3 * cf.align_up(2 * 2500)
    be = backend(tmp_path, capacity=3 * file_size)
    for i in range(3):
        put(be, i)
        time.sleep(0.01)
    be.get(key=make_key(0)).ref_down()  # 0 becomes the most recent, 1 the oldest
    other = backend(tmp_path, capacity=3 * file_size)  # another process's view: file mtimes
    put(other, 3)
    assert other.contains(keys=[make_key(0), make_key(1)], pin=False) == [True, False]
    be.close()
    other.close()


class SetClock(Runtime):
    """Real threads, and a wall clock the test sets (as the deterministic simulation keeps its
    own): what the tier stamps its LRU with."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def test_lru_stamps_are_the_runtimes_wall_clock(tmp_path):
    """A file's LRU stamp (its mtime, the order every process on the directory evicts in) is the
    tier's runtime's wall clock, on write and on a read's bump, never the kernel's: a simulated
    clock decides what a rescan evicts, whatever the real time and however fast it runs."""
    file_size = cf.ALIGN + 3 * cf.align_up(2 * 2500)
    base = 1_000_000_000.0  # 2001: the real clock is years later
    clock = SetClock(base)
    options = PosixBackend.Options(path=str(tmp_path), capacity=3 * file_size)
    be = PosixBackend(TierContext("disk", options, heap_memory_obj, runtime=clock))
    assert be.wait_indexed(60)
    for i, at in ((0, 3.0), (1, 1.0), (2, 2.0)):  # stamped out of their real order
        clock.now = base + at
        put(be, i)
    clock.now = base + 5.0
    be.get(key=make_key(1)).ref_down()  # 1 is the most recent now, 2 the oldest
    mtimes = [os.stat(tmp_path / be._rel(make_key(i))).st_mtime for i in range(3)]
    assert mtimes == [base + 3.0, base + 5.0, base + 2.0]
    other_opts = PosixBackend.Options(path=str(tmp_path), capacity=3 * file_size)
    other = PosixBackend(TierContext("disk", other_opts, heap_memory_obj,
                                     runtime=SetClock(base + 10.0)))  # another process's view
    assert other.wait_indexed(60)
    put(other, 3)
    assert other.contains(keys=[make_key(i) for i in range(4)], pin=False) == [True, True, False, True]
    be.close()
    other.close()


def test_full_disk_and_read_only_fail_soft(tmp_path, monkeypatch, caplog):
    be = backend(tmp_path)
    put(be, 1)

    def enospc(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(posix_io.os, "pwritev", enospc)
    with caplog.at_level(logging.WARNING, "kvplug.backends.posix"):
        for i in (2, 3):
            put(be, i)
    monkeypatch.undo()
    assert be.stats()["failed_puts"] == 2 and caplog.text.count("No space left") == 1
    assert not list(tmp_path.rglob("*.tmp")), "temporary file left behind"
    assert be.contains(keys=[make_key(2)], pin=False) == [False]
    got = be.get(key=make_key(1))  # loads go on
    assert got is not None
    be.close()
    # A directory that cannot be created (a file is in the way): starts, drops stores, misses.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    ro = backend(blocker / "cache")
    obj = obj_for(4)
    ro.batched_submit_put(keys=[make_key(4)], objs=[obj])
    assert ro.flush(5) and obj.ref_count == 1
    assert ro.get(key=make_key(4)) is None and ro.stats()["dropped_puts"] == 1
    ro.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    be = backend(tmp_path)
    put(be, 1)
    be.close()
    tmp_path.chmod(0o555)
    for shard in tmp_path.iterdir():
        shard.chmod(0o555)
    try:
        ro = backend(tmp_path)
        put(ro, 2)
        assert ro.get(key=make_key(1)) is not None and ro.get(key=make_key(2)) is None
        ro.close()
    finally:
        for shard in tmp_path.iterdir():
            shard.chmod(0o755)
        tmp_path.chmod(0o755)


def test_stale_temporary_files_are_cleaned(tmp_path):
    shard = tmp_path / "ab"
    shard.mkdir()
    old, fresh = shard / ".x.safetensors.1.aa.tmp", shard / ".y.safetensors.2.bb.tmp"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"being written")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    be = backend(tmp_path)
    assert not old.exists() and fresh.exists() and be.stats()["entries"] == 0
    be.close()


def test_queue_bound_drops_instead_of_blocking(tmp_path, monkeypatch):
    be = backend(tmp_path, io_threads=1, max_pending_writes=2)
    gate = __import__("threading").Event()
    real = posix_io.write_chunk
    written = []

    def held_write(*a, **k):
        gate.wait(60)  # only a hang guard: the test opens the gate
        written.append(real(*a, **k))
        return written[-1]

    monkeypatch.setattr(posix_io, "write_chunk", held_write)
    objs = [obj_for(i) for i in range(5)]
    be.batched_submit_put(keys=[make_key(i) for i in range(5)], objs=objs)
    assert not written, "submit blocked on I/O"  # it came back with every write still held
    assert be.stats()["dropped_puts"] == 3 and be.stats()["pending_writes"] == 2
    assert not be.flush(0.05)
    gate.set()
    assert be.flush(10) and all(o.ref_count == 1 for o in objs)
    assert be.contains(keys=[make_key(0), make_key(1), make_key(2)], pin=False) == [True, True, False]
    be.close()


def test_a_chunk_still_being_written_is_served_from_memory(tmp_path):
    """Right after a store, before the disk write finishes (a gated, slow disk), lookups hit and
    reads return the queued object's bytes — whole or a layer range (a layer-wise load); the file
    appears once the write is let through."""
    import threading

    from kvplug.storage_manager import StorageManager
    from kvplug.testing import fill_random, make_key

    mgr = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(tmp_path)}}]})
    disk = mgr.backend(0)
    gate = threading.Event()
    write = disk.writer._write
    disk.writer._write = lambda *args: (gate.wait(10), write(*args))
    obj = fill_random(mgr, seed=5)
    expect, layers = obj.byte_view.clone(), obj.tensor.clone()
    mgr.batched_put([make_key(1)], [obj])
    obj.ref_down()
    assert mgr.lookup_prefix([make_key(1)]).num_chunks == 1
    got = mgr.get(make_key(1))
    assert got is not None and torch.equal(got.byte_view, expect)
    got.ref_down()
    part = mgr.get_layers(make_key(1), 1, 1)  # from the queued write: the file is not there yet
    assert part is not None and torch.equal(part.tensor[0], layers[1])
    part.ref_down()
    assert not list(tmp_path.rglob("*.safetensors")), "the gate did not hold the write back"
    gate.set()
    assert mgr.flush(10)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1
    assert mgr.stats()["posix"]["pending_hits"] == 2
    mgr.close()


def test_pinned_files_held_open_are_bounded(tmp_path, monkeypatch):
    """At most max_pinned_fds pinned files are held open; further pins are taken in this process
    only (counted); a chunk pinned while still queued is held once it lands; unpin closes all."""
    be = backend(tmp_path, max_pinned_fds=2)
    for i in range(3):
        put(be, i)
    assert be.contains(keys=[make_key(i) for i in range(3)], pin=True) == [True] * 3
    st = be.stats()
    assert (st["pinned"], st["pinned_fds"], st["pins_without_fd"]) == (3, 2, 1)
    be.unpin(keys=[make_key(i) for i in range(3)])
    assert be.stats()["pinned_fds"] == 0 and be.stats()["pinned"] == 0
    gate = __import__("threading").Event()
    real = posix_io.ChunkFileIO.prepare_write

    def held_back(self, k, rel, obj):
        gate.wait(30)
        return real(self, k, rel, obj)

    monkeypatch.setattr(posix_io.ChunkFileIO, "prepare_write", held_back)
    be.batched_submit_put(keys=[make_key(7)], objs=[obj_for(7)])
    assert be.contains(keys=[make_key(7)], pin=True) == [True]  # queued, not on disk yet
    assert be.stats()["pinned_fds"] == 0
    gate.set()
    assert be.flush(timeout=30)
    assert be.stats()["pinned_fds"] == 1, "a file pinned while queued was not held once written"
    be.unpin(keys=[make_key(7)])
    assert be.stats()["pinned_fds"] == 0
    be.close()


def test_a_cached_header_is_reused_only_for_the_same_bytes(tmp_path, monkeypatch):
    """The header of a file the tier wrote is not parsed again on read (the header cache,
    ``common.chunks.HeaderCache``); a file rewritten since with another chunk of the same size
    (other header bytes: other checksums) is parsed again and served as it is now; one whose
    header bytes were damaged is a miss, deleted."""
    be = backend(tmp_path)
    put(be, 1)
    parses: list[int] = []
    real = cf.read_header
    monkeypatch.setattr(cf, "read_header", lambda *a, **k: (parses.append(1), real(*a, **k))[1])
    got = be.get(key=make_key(1))
    assert got is not None and parses == [], "the header the tier wrote was parsed again"
    got.ref_down()
    other = obj_for(2)  # another writer replaces the file: same key and size, other bytes
    header, bufs = cf.encode_chunk(make_key(1), other)
    path = os.path.join(str(be.root), cf.relative_chunk_path(make_key(1)))
    data = bytes(header) + b"".join(bytes(b) for b in bufs)
    assert len(data) == os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(data)
    got = be.get(key=make_key(1))
    assert got is not None and torch.equal(got.byte_view, other.byte_view), \
        "a rewritten file was read with the header cached for the old one"
    got.ref_down()
    assert parses == [1]
    with open(path, "r+b") as f:  # one bit of the header's checksums flipped, same size
        text = f.read(len(header))
        at = text.index(b'"checksums"') + 20
        f.seek(at)
        f.write(bytes([text[at] ^ 1]))
    assert be.get(key=make_key(1)) is None
    assert be.stats()["corrupt"] == 1 and not os.path.exists(path)
    be.close()
