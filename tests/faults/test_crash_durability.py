"""Crash mid-write: no store a tier reported done is lost, no torn chunk is served.

* SIGKILL at random moments: a real child process stores chunks to the posix tier (``fsync:
  true``) or to the fsspec tier over ``file://`` and reports over a pipe every store its tier's
  ``flush`` said was done; the parent kills it at a random moment, many times. After each kill,
  a restart checks every chunk file on disk is whole and verifies (header and layer checksums,
  bytes equal to what that key was given) or is absent, every acknowledged store survived and
  loads through a fresh tier, the index is rebuilt from the directory, and temporary files are
  never mistaken for chunks and are deleted once they are stale (older than
  ``chunkfile.TEMP_MAX_AGE_S``; the test ages them with ``os.utime``).
* Power cut (the directory entry): a SIGKILL never loses what reached the page cache, so the
  durability of a rename is checked by the order of the system calls instead: ``os.open``,
  ``os.fsync`` and ``os.replace`` are wrapped in-process (they still run) and the recorded order
  must be: data written, the file fsynced, renamed, then its directory fsynced, and the parent of
  every directory the write created fsynced too (else a new shard directory's own entry can be
  lost). Without ``fsync`` no fsync call is made (the control). This checks what kvplug asks the
  kernel for, not the disk's honesty; no real power was cut.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support.crash_campaign import run_campaign

pytestmark = pytest.mark.timeout(600)

KILLS = 8  # per tier: 16 SIGKILLs in all (benchmarks/crash_soak.py runs more)


@pytest.mark.parametrize("kind", ["posix", "fsspec"])
def test_sigkill_mid_write_loses_nothing_acknowledged(tmp_path, kind):
    fig = run_campaign(kind, tmp_path / "store", kills=KILLS, seed=16)
    assert fig["kills"] == KILLS
    assert fig["bad_files"] == [] and fig["lost_acknowledged"] == []
    assert fig["index_mismatch"] == []  # a restarted tier indexes exactly the files on disk
    assert fig["stale_temps_left"] == 0  # aged temporary files are deleted at restart
    # not vacuous: many stores were acknowledged and checked, and kills cut writes short
    assert fig["acknowledged"] >= KILLS and fig["files_checked"] >= KILLS
    # killed with stores submitted and not reported done, or a write left half-way
    assert fig["kills_in_flight"] + fig["kills_with_temp_left"] > 0


@pytest.mark.parametrize("kind", ["posix", "fsspec"])
def test_restart_deletes_stale_temps_and_ignores_fresh_ones(tmp_path, kind):
    """A crashed writer's temporary file (part of a chunk) is never indexed or read; once older
    than TEMP_MAX_AGE_S a restarting tier deletes it; a fresh one (a live writer's) is kept."""
    from kvplug import chunkfile as cf

    from tests.support.crash_campaign import check_file, key_for, make_tier, payload_for

    root = tmp_path / "store"
    tier = make_tier(kind, root)
    key = key_for(3, 1)
    tier.batched_submit_put([key], [payload_for(key)])
    assert tier.flush(30)
    tier.close()
    final = root / cf.relative_chunk_path(key)
    assert check_file(final) is None
    data = final.read_bytes()
    stale = final.parent / cf.temp_name(final.name)
    fresh = final.parent / cf.temp_name(final.name)
    for t in (stale, fresh):
        t.write_bytes(data[: len(data) // 2])  # what a writer killed half-way leaves
    old = time.time() - cf.TEMP_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    tier = make_tier(kind, root)
    try:
        assert not stale.exists() and fresh.exists()
        assert tier.stats()["entries"] == 1  # the chunk, not the temporary file
        obj = tier.get(key)
        assert obj is not None and obj.nbytes == payload_for(key).nbytes
        obj.ref_down()
    finally:
        tier.close()


def test_check_file_detects_damage(tmp_path):
    """The control for the campaign's check: a flipped byte or a cut file is reported."""
    from kvplug import chunkfile as cf

    from tests.support.crash_campaign import check_file, key_for, make_tier, payload_for

    root = tmp_path / "store"
    tier = make_tier("posix", root)
    key = key_for(4, 2)
    tier.batched_submit_put([key], [payload_for(key)])
    assert tier.flush(30)
    tier.close()
    path = root / cf.relative_chunk_path(key)
    data = bytearray(path.read_bytes())
    data[len(data) - 100_000] ^= 1
    path.write_bytes(data)
    assert "checksum" in check_file(path)
    path.write_bytes(data[: len(data) // 2])
    assert "header" in check_file(path)


def _record_syscalls(monkeypatch):
    """Wrap os.open/os.fsync/os.replace/os.mkdir (they still run): the calls, in order, by path."""
    calls: list[tuple[str, str]] = []
    fds: dict[int, str] = {}
    real_open, real_fsync, real_replace, real_mkdir = os.open, os.fsync, os.replace, os.mkdir

    def at(path, dir_fd):  # a path relative to a directory descriptor, as a full path
        return os.fspath(path) if dir_fd is None else os.path.join(fds[dir_fd], path)

    def op(path, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        fds[fd] = at(path, dir_fd)
        return fd

    def fsync(fd):
        calls.append(("fsync", fds.get(fd, "?")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        calls.append(("replace", at(dst, kw.get("dst_dir_fd"))))
        return real_replace(src, dst, **kw)

    def mkdir(path, mode=0o777, **kw):
        calls.append(("mkdir", os.fspath(path)))
        return real_mkdir(path, mode, **kw)

    monkeypatch.setattr(os, "open", op)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "mkdir", mkdir)
    return calls


@pytest.mark.parametrize("fsync", [True, False])
def test_power_cut_order_file_then_rename_then_directories(tmp_path, monkeypatch, fsync):
    from kvplug import chunkfile as cf
    from kvplug.backends.posix import PosixBackend
    from kvplug.hookspecs import TierContext
    from kvplug.memory import heap_memory_obj

    from tests.support.crash_campaign import key_for, payload_for

    root = tmp_path / "store"
    be = PosixBackend(TierContext("disk", PosixBackend.Options(path=str(root), fsync=fsync),
                                  heap_memory_obj))
    assert be.wait_indexed(60)  # the startup scan's syscalls are not the writes recorded below
    calls = _record_syscalls(monkeypatch)
    try:
        for i in range(2):  # the second file goes into an existing shard directory
            key = key_for(1, 0) if i == 0 else key_for(1, 0).with_hash(
                key_for(1, 0).chunk_hash[:1] + key_for(2, 7).chunk_hash[1:])
            obj = payload_for(key)
            be.batched_submit_put([key], [obj])
            assert be.flush(30)
    finally:
        monkeypatch.undo()
        be.close()
    final = str(root / cf.relative_chunk_path(key_for(1, 0)))
    shard = os.path.dirname(final)
    if not fsync:
        assert [c for c in calls if c[0] == "fsync"] == []
        return
    first = calls[: calls.index(("replace", final)) + 1]
    after = calls[len(first):]
    fsyncs = [p for c, p in first if c == "fsync"]
    assert len(fsyncs) == 1 and cf.is_temp(os.path.basename(fsyncs[0])), first  # data, pre-rename
    assert ("mkdir", shard) in first  # the write created the shard directory ...
    # ... so after the rename: the shard (the file's entry), then the root (the shard's entry)
    assert after[:2] == [("fsync", shard), ("fsync", str(root))], after
    second = [c for c in after[2:] if c[0] in ("fsync", "replace")]
    assert [c[0] for c in second] == ["fsync", "replace", "fsync"]  # existing shard: no root
    assert second[2] == ("fsync", shard)
