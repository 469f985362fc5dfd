"""fsspec tier behaviour on memory:// and file://: lookup caching, back-pressure, slow stores,
credentials and object names."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time

import fsspec
import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.errors import ConfigError
from kvplug.keys import CacheKey
from kvplug.storage_manager import StorageManager
from kvplug.testing.conformance import fill_random, make_key

pytestmark = pytest.mark.timeout(60)
SECRET = "SuperSecretValue-123"


@pytest.fixture(autouse=True)
def _clean_memory_fs():
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    yield
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


def _mgr(url: str = "memory://kv", **opts) -> StorageManager:
    return StorageManager({"tiers": [{"backend": "fsspec", "options": {"url": url, **opts}}],
                           "chunk_size": 16})


def _backend(mgr: StorageManager):
    return mgr.backend(0)


def _put(mgr: StorageManager, ids) -> None:
    for i in ids:
        obj = fill_random(mgr, seed=i)
        mgr.batched_put([make_key(i)], [obj])
        obj.ref_down()
    assert mgr.flush(timeout=10)


def test_contains_is_batched_and_misses_are_cached():
    """One lookup of many keys; repeated misses within negative_cache_s cost no remote call;
    a chunk another host stores becomes visible once the negative entry expires."""
    with _mgr(negative_cache_s=0.4) as a, _mgr(negative_cache_s=0.0) as b:
        keys = [make_key(i) for i in range(32)]
        assert a.lookup_prefix(keys).num_chunks == 0
        assert a.stats()["fsspec"]["remote_lookups"] == 32
        for _ in range(5):
            assert a.lookup_prefix(keys[:1]).num_chunks == 0
        st = a.stats()["fsspec"]
        assert st["remote_lookups"] == 32 and st["negative_hits"] >= 5
        _put(b, range(1))
        time.sleep(0.5)
        assert a.lookup_prefix(keys).num_chunks == 1


def test_a_fresh_lookup_is_never_answered_by_a_remembered_miss():
    """Chunks another engine announced (a disaggregated producer's hand-off) are looked up
    ``fresh``: the tier forgets its remembered misses of them first, so a chunk stored since
    the miss is found at once, not when the memory expires (here: in a minute)."""
    with _mgr(negative_cache_s=60) as a, _mgr(negative_cache_s=0.0) as b:
        keys = [make_key(i) for i in range(4)]
        assert a.lookup_prefix(keys).num_chunks == 0  # the misses are remembered
        _put(b, range(3))
        assert a.lookup_prefix(keys).num_chunks == 0  # the control: hidden by the memory
        assert a.stats()["fsspec"]["negative_hits"] >= 1
        remote = a.stats()["fsspec"]["remote_lookups"]
        found = a.lookup_prefix(keys, pin=True, fresh=True)
        assert found.num_chunks == 3 and found.tiers == ["fsspec"] * 3
        assert a.stats()["fsspec"]["remote_lookups"] == remote + 4  # asked the store itself
        a.unpin(keys[:3], found.tiers)
        assert a.lookup_prefix(keys).num_chunks == 3  # the forgotten misses stay forgotten


def test_full_write_queue_drops_without_blocking():
    """With a stalled store, a full queue drops stores at once and counts them; refs released."""
    with _mgr(max_pending_writes=2, io_threads=1, timeout_s=1.0) as mgr:
        io = _backend(mgr).io
        real_put = io.put
        gate = threading.Event()  # the store answers only once the test opens it
        done = []

        async def slow_put(path, data):
            while not gate.is_set():
                await asyncio.sleep(0.01)
            await real_put(path, data)
            done.append(path)

        io.put = slow_put
        objs = [fill_random(mgr, seed=i) for i in range(10)]
        guard = threading.Timer(60, gate.set)  # only a hang guard: a blocking put ends one day
        guard.daemon = True
        guard.start()
        mgr.batched_put([make_key(i) for i in range(10)], objs)
        assert not done and not gate.is_set(), "batched_put waited for the stalled store"
        assert mgr.stats()["fsspec"]["dropped_queue_full"] >= 7
        guard.cancel()
        gate.set()
        assert mgr.flush(timeout=10)
        for o in objs:
            assert o.ref_count == 1
            o.ref_down()


def test_slow_store_times_out_and_opens_the_breaker():
    """A read that stalls past timeout_s is a miss within the bound; the breaker then refuses
    calls without waiting, and lets a probe through after the back-off."""
    with _mgr(timeout_s=0.3, breaker_threshold=1, breaker_backoff_s=0.5) as mgr:
        _put(mgr, range(1))
        io = _backend(mgr).io
        real_cat = io.cat
        calls, released = [], []

        async def stalled(*a, **k):
            calls.append(a)
            await asyncio.sleep(120)
            released.append(a)

        io.cat = stalled
        assert mgr.get(make_key(0)) is None
        assert len(calls) == 1 and not released  # back within the bound, the read still stalled
        assert mgr.get(make_key(0)) is None
        assert len(calls) == 1, "an open breaker must not call the store"
        st = mgr.stats()["fsspec"]
        assert st["timeouts"] == 1 and st["breaker_open"] == 1
        io.cat = real_cat
        time.sleep(0.6)
        got = mgr.get(make_key(0))
        assert got is not None
        got.ref_down()
        assert mgr.stats()["fsspec"]["breaker_open"] == 0


def test_credentials_never_logged(caplog, unused_port):
    """A failing S3 endpoint: logs and stats carry no secret, nor does the options repr."""
    pytest.importorskip("s3fs")
    caplog.set_level(logging.DEBUG, logger="kvplug")
    opts = {"endpoint_url": f"http://127.0.0.1:{unused_port}", "key": "AKIDEXAMPLE",
            "secret": SECRET, "client_kwargs": {"aws_session_token": SECRET + "tok"}}
    with _mgr("s3://bucket-x/kv", storage_options=opts, timeout_s=1.0,
              breaker_threshold=1) as mgr:
        obj = fill_random(mgr)
        mgr.batched_put([make_key(1)], [obj])
        obj.ref_down()
        mgr.flush(timeout=10)
        assert mgr.get(make_key(1)) is None
        assert mgr.lookup_prefix([make_key(1)]).num_chunks == 0
        text = caplog.text + repr(mgr.stats()) + repr(_backend(mgr).opts)
    assert "remote store failing" in caplog.text
    assert SECRET not in text


def test_redactor_scrubs_url_userinfo_and_secrets():
    from kvplug.backends.fsspec.io import Redactor

    r = Redactor("ftp://alice:pw-1234@host/x", {"password": "hunter22", "nested": {"token": "t0k3n"}})
    out = r("ftp://alice:pw-1234@host/x failed with hunter22 and t0k3n")
    assert "pw-1234" not in out and "hunter22" not in out and "t0k3n" not in out
    assert "host/x" in out


def test_bad_options_are_config_errors_without_secrets():
    with pytest.raises(ConfigError) as err:
        _mgr("", storage_options={"secret": SECRET})
    assert "url" in str(err.value) and SECRET not in str(err.value)
    with pytest.raises(ConfigError, match="bogus"):
        _mgr(bogus=1)


@pytest.mark.parametrize("model", ["../../etc/passwd", "a/b\\c", "..", "/abs", "x" * 500])
def test_object_names_cannot_escape_the_prefix(model):
    with _mgr("memory://kv/root") as mgr:
        key = CacheKey(model, "bfloat16", "LBHNC-bs16", 2, 1, b"\x01" * 32)
        path = _backend(mgr).path_of(key)
        assert path.startswith("/kv/root/")
        rest = path[len("/kv/root/"):].split("/")
        assert len(rest) == 3 and ".." not in rest and all(rest)
        obj = fill_random(mgr)
        mgr.batched_put([key], [obj])
        obj.ref_down()
        assert mgr.flush(timeout=10)
        assert all(p.startswith("/kv/root/") for p in fsspec.filesystem("memory").store)


def test_file_url_shares_the_posix_layout(tmp_path):
    """namespace_dirs=False writes <root>/<2 hex>/<key>.safetensors atomically (no temp left)."""
    with _mgr(f"file://{tmp_path}", namespace_dirs=False) as mgr:
        _put(mgr, range(3))
        got = mgr.get(make_key(2))
        assert got is not None
        got.ref_down()
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 3 and all(f.count("/") == 1 for f in files), files
    assert all(f.endswith(".safetensors") for f in files)


def test_file_url_writes_through_the_shared_temp_name_rule(tmp_path, monkeypatch):
    """file:// stores are renamed into place from a temporary name that every tier's scan
    recognises (kvplug.chunkfile.is_temp), not from a rule of fsspec's own."""
    import os

    from kvplug import chunkfile as cf

    renamed: list[str] = []
    real_replace = os.replace

    def replace(src, dst, **kw):  # (relative to the directory's descriptor: kw has it)
        renamed.append(os.path.basename(src))
        real_replace(src, dst, **kw)

    monkeypatch.setattr("kvplug.chunkfile.atomic.os.replace", replace)
    with _mgr(f"file://{tmp_path}", namespace_dirs=False) as mgr:
        _put(mgr, range(2))
    assert len(renamed) == 2 and all(cf.is_temp(name) for name in renamed), renamed

def test_file_url_never_follows_a_symlinked_directory(tmp_path):
    """A writer of the directory replaces a shard and a namespace directory with symlinks to a
    directory elsewhere: stores there are dropped, never written outside the root; a chunk file
    put outside under the right name is never served; an eviction through the link deletes
    nothing outside (the negative control: a real directory of the same name works)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    for namespace_dirs in (False, True):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        with _mgr(f"file://{root}", namespace_dirs=namespace_dirs, negative_cache_s=0) as mgr:
            path = _backend(mgr).path_of(make_key(1))
            linked = os.path.dirname(path) if not namespace_dirs else \
                os.path.dirname(os.path.dirname(path))
            os.symlink(outside, linked)
            _put(mgr, [1])
            assert not any(outside.rglob("*")), "a store was written outside the root"
            planted = outside / os.path.relpath(path, linked)
            planted.parent.mkdir(parents=True, exist_ok=True)
            real = fill_random(mgr, seed=1)
            header, bufs = cf.encode_chunk(make_key(1), real)
            planted.write_bytes(header + b"".join(bytes(b) for b in bufs))
            real.ref_down()
            assert mgr.get(make_key(1)) is None, "a chunk outside the root was served"
            mgr.evict([make_key(1)])
            assert planted.exists(), "an eviction deleted a file outside the root"
            os.unlink(linked)
            _put(mgr, [1])  # the control: a real directory there works
            got = mgr.get(make_key(1))
            assert got is not None
            got.ref_down()
        shutil.rmtree(outside)
        outside.mkdir()


def test_file_url_fifos_named_like_chunks_never_block_its_threads(tmp_path):
    """Two FIFOs named like chunks (as many as the tier has I/O threads): reads of them are
    misses, and a stored chunk and a new store still work (its threads are free)."""
    root = tmp_path / "root"
    fifos = []
    with _mgr(f"file://{root}", namespace_dirs=False, io_threads=2, timeout_s=2,
              negative_cache_s=0) as mgr:
        try:
            _put(mgr, [0])
            for i in (1, 2):
                path = _backend(mgr).path_of(make_key(i))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.mkfifo(path)
                fifos.append(path)
            assert mgr.get(make_key(1)) is None and mgr.get(make_key(2)) is None
            got = mgr.get(make_key(0))
            assert got is not None, "a stored chunk missed after reads of FIFOs"
            got.ref_down()
            _put(mgr, [3])
            got = mgr.get(make_key(3))
            assert got is not None, "a new store missed after reads of FIFOs"
            got.ref_down()
            assert mgr.stats()["fsspec"]["timeouts"] == 0
        finally:
            for path in fifos:  # a reader blocked in open (the finding) is let go
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass


def test_layer_reads_are_ranged_and_verified():
    with _mgr() as mgr:
        obj = fill_random(mgr, (6, 2, 4096))
        data = obj.byte_view.clone().view(6, -1)
        mgr.batched_put([make_key(0)], [obj])
        obj.ref_down()
        assert mgr.flush(timeout=10)
        for first, n in [(0, 1), (2, 3), (5, 1), (0, 6)]:
            part = mgr.get_layers(make_key(0), first, n)
            assert part is not None and torch.equal(part.byte_view, data[first:first + n].reshape(-1))
            part.ref_down()
        assert mgr.get_layers(make_key(0), 5, 2) is None
        # Formerly through the deleted get_many (only tests called it); now the live get path.
        many = [_backend(mgr).get(make_key(0)), _backend(mgr).get(make_key(1))]
        assert many[1] is None and torch.equal(many[0].byte_view, data.reshape(-1))
        many[0].ref_down()


def test_old_module_path_still_loads_with_a_deprecation_warning():
    """A config written before the move to the fsspec package keeps working, and says where the
    class lives now."""
    with pytest.warns(DeprecationWarning, match="kvplug.backends.fsspec:FsspecBackend"):
        mgr = StorageManager({"tiers": [{
            "backend": "kvplug.backends.fsspec_remote:FsspecBackend",
            "options": {"url": "memory://kv"}}], "chunk_size": 16})
    with mgr:
        from kvplug.backends.fsspec import FsspecBackend

        assert isinstance(_backend(mgr), FsspecBackend)
        _put(mgr, range(1))
        got = mgr.get(make_key(0))
        assert got is not None
        got.ref_down()


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_store_dropped_for_capacity_does_not_keep_the_breakers_trial_call():
    """With the breaker open, the first call after the back-off is its one trial. A store that is
    then dropped because pinned objects fill the capacity must not take that trial with it:
    once the pin is gone, the next store reaches the (healthy) store and closes the breaker."""
    with _mgr(breaker_threshold=1, breaker_backoff_s=0.05) as probe_mgr:
        _put(probe_mgr, [0])
        chunk_bytes = int(probe_mgr.stats()["fsspec"]["bytes_put"])
    fsspec.filesystem("memory").store.clear()
    with _mgr(capacity=chunk_bytes, breaker_threshold=1, breaker_backoff_s=0.05) as mgr:
        backend = _backend(mgr)
        _put(mgr, [0])
        assert mgr.lookup_prefix([make_key(0)], pin=True).num_chunks == 1
        backend.breaker.failure("injected: the store looked down")
        assert backend.breaker.is_open
        time.sleep(0.1)  # past the back-off: the next call is the trial
        _put(mgr, [1])  # no room: the pinned chunk 0 fills the capacity
        assert mgr.stats()["fsspec"]["written"] == 1
        mgr.unpin([make_key(0)], ["fsspec"])
        _put(mgr, [2])
        st = mgr.stats()["fsspec"]
        assert st["written"] == 2, f"the trial call was lost; the breaker never closes: {st}"
        assert not backend.breaker.is_open


def test_a_chunk_read_again_is_one_request():
    """A chunk whose header this tier read before is read again with one ranged read of its
    known size (plus one byte, so a longer object shows), not a header read, a size call and a
    body read; what comes back is parsed and verified as ever. An object replaced by one of
    another size falls back to the header read, which finds it without downloading it."""
    with _mgr() as mgr:
        _put(mgr, range(2))
        io = _backend(mgr).io
        calls: list[str] = []
        real_cat, real_size = io.cat, io.size

        async def cat(path, start=None, end=None):
            calls.append("cat")
            return await real_cat(path, start, end)

        async def size(path):
            calls.append("size")
            return await real_size(path)

        io.cat, io.size = cat, size
        ref = mgr.get(make_key(0))
        assert ref is not None and sorted(calls) == ["cat", "cat", "size"], calls
        calls.clear()
        again = mgr.get(make_key(0))
        assert again is not None and torch.equal(again.byte_view, ref.byte_view)
        assert calls == ["cat"], calls
        fs = fsspec.filesystem("memory")
        path = _backend(mgr).path_of(make_key(0))
        fs.pipe_file(path, fs.cat_file(path) + bytes(1 << 20))  # longer: junk appended
        calls.clear()
        assert mgr.get(make_key(0)) is None
        assert mgr.stats()["fsspec"]["corrupt"] == 1 and not fs.exists(path)
        for obj in (ref, again):
            obj.ref_down()


def _counting(io, calls: list[str]) -> None:
    """Record each ``cat`` (with its byte range) and ``size`` the tier's I/O makes."""
    real_cat, real_size = io.cat, io.size

    async def cat(path, start=None, end=None):
        calls.append("cat" if start is None else f"cat {start}..{end}")
        return await real_cat(path, start, end)

    async def size(path):
        calls.append("size")
        return await real_size(path)

    io.cat, io.size = cat, size


def test_a_first_read_is_one_ranged_request_once_the_layout_is_known():
    """Once the tier has read one chunk, a chunk it never read is read with one ranged read of
    that chunk's size plus a byte (the stored bytes choose no size), not a header read, a size
    call and a body read; in a batch too. Control: an object longer than the layout (junk
    appended) is read header first after that one request and is a corrupt miss, deleted."""
    with _mgr() as mgr:
        _put(mgr, range(5))
        calls: list[str] = []
        _counting(_backend(mgr).io, calls)
        first = mgr.get(make_key(0))
        assert first is not None and sorted(calls)[-1] == "size", calls  # header first
        fs = fsspec.filesystem("memory")
        size = len(fs.cat_file(_backend(mgr).path_of(make_key(1))))
        calls.clear()
        got = mgr.get(make_key(1))
        assert got is not None and calls == [f"cat 0..{size + 1}"], calls
        calls.clear()
        many = mgr.batched_get([make_key(2), make_key(3)])
        assert all(m is not None for m in many) and calls == [f"cat 0..{size + 1}"] * 2, calls
        for obj, i in ((first, 0), (got, 1), *zip(many, (2, 3))):
            ref = fill_random(mgr, seed=i)
            assert torch.equal(obj.byte_view, ref.byte_view)
            for o in (obj, ref):
                o.ref_down()
        path = _backend(mgr).path_of(make_key(4))
        fs.pipe_file(path, fs.cat_file(path) + bytes(1 << 20))
        calls.clear()
        assert mgr.get(make_key(4)) is None
        assert calls[0] == f"cat 0..{size + 1}" and "size" in calls, calls
        assert mgr.stats()["fsspec"]["corrupt"] == 1 and not fs.exists(path)
