"""The resp tier's reads in place (pipelined ``GET`` replies received straight into L1's pool,
:mod:`kvplug.backends.resp.replies`) against a real redis-server started by the test: the checks
shared with mooncake (tests/support/in_place_reads.py), a server that hangs in the middle of a read
(the connection is dropped, never reused out of step) and a reply stream the reader refuses."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from kvplug.storage_manager import StorageManager
from kvplug.testing.conformance import make_key

from tests.support import in_place_reads
from tests.support.redis_server import redis_server  # noqa: F401 - fixture
from tests.support.tier_workload import HANG
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(120)


def tier(url: str, **opts) -> dict:
    return {"backend": "resp", "timeout_s": 5.0, "options": {
        "url": url, "timeout_s": 0.5, "negative_cache_s": 0, "breaker_threshold": 2,
        "breaker_backoff_s": 0.2, "breaker_max_backoff_s": 0.5, **opts}}


def test_reads_land_in_the_pool_checked(redis_server):  # noqa: F811 - fixture
    in_place_reads.reads_land_in_the_pool_checked(lambda: tier(redis_server.url))


def test_damaged_short_or_vanished_values_are_misses(redis_server):  # noqa: F811 - fixture
    in_place_reads.damaged_short_or_vanished_values_are_misses(lambda: tier(redis_server.url))


def test_server_hung_in_the_middle_of_a_read_then_exact_again(redis_server):  # noqa: F811
    """SIGSTOP while a pipelined read of 16 MiB streams into the pool: bounded misses (the
    socket timeout), the half-read connection is dropped; after SIGCONT every chunk is exact."""
    writer = StorageManager({"tiers": [tier(redis_server.url)], "chunk_size": 16})
    reader = StorageManager({"tiers": [in_place_reads.L1, tier(redis_server.url)],
                             "chunk_size": 16})
    try:
        refs = in_place_reads._store(writer, {i: (4, 4, 1 << 18) for i in range(5)})  # 4 MiB
        keys = [make_key(i) for i in range(5)]
        first = reader.get(keys[0], promote=False)  # teaches the layout
        assert first is not None
        first.ref_down()
        stop = threading.Timer(0.002, redis_server.pause)
        stop.start()
        t0 = time.monotonic()
        got = reader.batched_get(keys[1:])
        took = time.monotonic() - t0
        stop.join()
        redis_server.resume()
        assert took < HANG
        for i, g in enumerate(got, start=1):  # stopped before, during or after the read:
            if g is not None:  # whatever came back is exact
                assert torch.equal(g.byte_view, refs[i]), f"chunk {i} differs"
                g.ref_down()
        reader.evict(keys, tiers=["l1"])
        deadline = time.monotonic() + 30
        while True:
            got = reader.batched_get(keys)
            if all(g is not None for g in got):
                break
            for g in got:
                if g is not None:
                    g.ref_down()
            assert time.monotonic() < deadline, reader.stats()["resp"]
            time.sleep(0.3)
        for i, g in enumerate(got):
            assert torch.equal(g.byte_view, refs[i]), f"chunk {i} differs after the hang"
            g.ref_down()
        assert reader.stats()["resp"]["corrupt"] == 0
    finally:
        redis_server.resume()
        reader.close()
        writer.close()


def test_bulk_reader_places_values_and_refuses_what_is_not_a_get_reply():
    """Over a real socket pair: a value of the expected length lands in its pieces (split across
    the reader's line reads), another length is received whole and the stream stays in step, a
    nil or an error reply is ``None``; ``EXISTS`` replies read as hits and misses; a reply of
    another kind raises."""
    import numpy as np
    from kvplug.backends.resp.replies import BulkReader, ProtocolError

    a, b = socket.socketpair()
    b.settimeout(HANG)  # only turns a hang into a failure
    try:
        value = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes()
        a.sendall(b"$5000\r\n" + value + b"\r\n$3\r\nabc\r\n$-1\r\n_\r\n-WRONGTYPE x\r\n"
                  + b"$5000\r\n" + value + b"\r\n")
        dest = np.full(5000, 0xAB, dtype=np.uint8)
        head = np.full(100, 0xAB, dtype=np.uint8)
        pieces = [(head.ctypes.data, 100), (dest.ctypes.data + 100, 4900)]
        reader = BulkReader(b)
        assert reader.bulk_into(pieces) == 5000
        assert head.tobytes() == value[:100] and dest[100:].tobytes() == value[100:]
        assert [reader.bulk_into(pieces) for _ in range(4)] == [bytearray(b"abc"), None, None, None]
        dest[:] = 0
        head[:] = 0
        assert reader.bulk_into(pieces) == 5000 and reader.drained()
        assert head.tobytes() + dest[100:].tobytes() == value
        a.sendall(b":1\r\n:0\r\n:2\r\n-NOPERM x\r\n")
        assert [reader.integer() for _ in range(4)] == [True, False, True, None]
        assert reader.drained()
        a.sendall(b"$1\r\n")
        with pytest.raises(ProtocolError):
            BulkReader(b).integer()
        for junk in (b"+OK\r\n", b"$12x\r\n", b"$" + b"9" * 80 + b"\r\n", b"$3\r\nabcXY"):
            a.sendall(junk)
            with pytest.raises(ProtocolError):
                BulkReader(b).bulk_into([(head.ctypes.data, 3)])
            b.setblocking(False)  # discard what is left of the junk
            try:
                b.recv(1024)
            except BlockingIOError:
                pass
            b.settimeout(HANG)
    finally:
        a.close()
        b.close()


def test_encoded_chunks_are_read_whole(redis_server):  # noqa: F811 - fixture
    in_place_reads.encoded_chunks_are_read_whole(lambda: tier(redis_server.url))


def test_partial_tails_keep_the_layout(redis_server):  # noqa: F811 - fixture
    in_place_reads.partial_tails_keep_the_layout(lambda: tier(redis_server.url))


def test_tier_alone_reads_in_place_into_heap_memory(redis_server):  # noqa: F811 - fixture
    """With no L1 in front (an engine with the resp tier alone, ``kvplug bench``), chunks are
    still received straight into their memory objects (heap memory: a socket receives into any
    memory) rather than parsed by redis-py into bytes and copied: ``reads_in_place`` counts
    them, and every byte matches."""
    writer = StorageManager({"tiers": [tier(redis_server.url)], "chunk_size": 16})
    reader = StorageManager({"tiers": [tier(redis_server.url)], "chunk_size": 16})
    try:
        refs = in_place_reads._store(writer, {i: (4, 2, 12288) for i in range(6)})
        keys = [make_key(i) for i in range(6)]
        first = reader.get(keys[0], promote=False)  # read whole: teaches the layout
        assert first is not None and torch.equal(first.byte_view, refs[0])
        first.ref_down()
        got = [reader.get(keys[1], promote=False), *reader.batched_get(keys[2:])]
        for i, g in enumerate(got, start=1):
            assert g is not None and torch.equal(g.byte_view, refs[i]), f"chunk {i} differs"
            g.ref_down()
        stats = reader.stats()["resp"]
        assert stats["reads_in_place"] == 5, stats
        assert stats["corrupt"] == 0 and stats["layout_misses"] == 0
    finally:
        reader.close()
        writer.close()


def test_the_connection_is_made_at_start_not_by_the_first_lookup(redis_server):  # noqa: F811
    """The tier connects to the server when it starts (in the background), so an engine's first
    lookup and load do not pay the client's set-up and a TCP connection: the server counts no
    new connection for them."""
    server = redis_server.client()
    before = server.info("stats")["total_connections_received"]
    mgr = StorageManager({"tiers": [tier(redis_server.url)], "chunk_size": 16})
    try:
        wait_until(lambda: server.info("stats")["total_connections_received"] > before,
                   "the tier to connect at start", HANG)
        wait_until(lambda: not [t for t in threading.enumerate()  # its connection released
                                if t.name == "kvplug-resp-connect"],
                   "the start-up connection to be back in the tier's pool", HANG)
        started = server.info("stats")["total_connections_received"]
        assert started == before + 1
        assert mgr.lookup_prefix([make_key(1)]).num_chunks == 0
        assert mgr.get(make_key(1)) is None
        assert server.info("stats")["total_connections_received"] == started
    finally:
        mgr.close()


@pytest.mark.parametrize("l1", [False, True], ids=["alone", "l1"])
def test_a_header_read_again_is_not_parsed_again_but_still_checked(redis_server, l1):  # noqa: F811
    """A chunk read again whose header bytes equal the ones parsed before reuses that parse
    (``headers_reused``: the parse is a pure function of the bytes), read whole or in place;
    every check still runs on what was read: a value whose header then differs by one byte, or
    whose payload does, is a corrupt miss, never served."""
    writer = StorageManager({"tiers": [tier(redis_server.url)], "chunk_size": 16})
    tiers = [in_place_reads.L1, tier(redis_server.url)] if l1 else [tier(redis_server.url)]
    reader = StorageManager({"tiers": tiers, "chunk_size": 16})
    server = redis_server.client()
    try:
        refs = in_place_reads._store(writer, {i: (4, 2, 12288) for i in range(3)})
        keys = [make_key(i) for i in range(3)]
        for _ in range(3):  # read whole (learns the layout), then in place
            for g, i in zip(reader.batched_get(keys), range(3)):
                assert g is not None and torch.equal(g.byte_view, refs[i])
                g.ref_down()
            if l1:
                reader.evict(keys, tiers=["l1"])
        stats = reader.stats()["resp"]
        assert stats["headers_reused"] == 6, stats  # every read but each chunk's first
        name = writer.backend(0).name_of(keys[1])
        good = server.get(name)
        at = {"header": 45, "payload": len(good) - 5}  # 45: in the header's own checksum
        for where, pos in at.items():
            bad = bytearray(good)
            bad[pos] ^= 0x01
            server.set(name, bytes(bad))
            corrupt = reader.stats()["resp"]["corrupt"]
            got = reader.batched_get(keys[1:2])[0]
            assert got is None, f"a value with a flipped {where} byte was served"
            assert reader.stats()["resp"]["corrupt"] == corrupt + 1, where
            server.set(name, good)  # deleted as corrupt: back for the next case
    finally:
        reader.close()
        writer.close()
