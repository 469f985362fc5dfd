"""The resp tier against a real redis-server that fails: killed mid-workload and restarted, full
(``allkeys-lru`` and ``noeviction``), hung (SIGSTOP). Through a real StorageManager: every chunk
that comes back is bit-exact, every failure is a miss or a dropped store (never an exception),
every call returns (bounds here only catch a hang), and the breaker trips and recovers.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

from tests.support import tier_workload
from tests.support.redis_server import RedisServer
from tests.support.tier_workload import HANG, put_random
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(180)



def manager(url: str, **opts) -> StorageManager:
    options = {"url": url, "timeout_s": 0.5, "negative_cache_s": 0, "breaker_threshold": 2,
               "breaker_backoff_s": 0.2, "breaker_max_backoff_s": 0.5, **opts}
    return StorageManager({"tiers": [{"backend": "resp", "timeout_s": 5.0, "options": options}],
                           "chunk_size": 16})


def put(mgr: StorageManager, i: int, seed: int | None = None) -> torch.Tensor:
    """Store chunk ``i`` of random bytes; its bytes (the reference)."""
    return put_random(mgr, make_key(i), i if seed is None else seed)


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    took = time.monotonic() - t0
    assert took < HANG, f"{fn.__name__} took {took:.1f}s: a call hung"
    return out


def get_exact(mgr: StorageManager, i: int, ref: torch.Tensor) -> bool:
    """Whether chunk ``i`` hit; a hit must be bit-exact."""
    return tier_workload.get_exact(mgr, make_key(i), ref)


def stats(mgr: StorageManager) -> dict[str, float]:
    return mgr.stats()["resp"]


def test_killed_mid_workload_and_restarted(tmp_path):
    srv = RedisServer(tmp_path / "redis")
    mgr = manager(srv.url)
    refs: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    hits = {"before": 0, "down": 0, "after": 0}
    phase = ["before"]
    stop = threading.Event()

    def workload() -> None:  # stores and reads round after round, whatever the server does
        i = 0
        try:
            while not stop.is_set() and i < 2000:
                refs[i] = put(mgr, i)
                timed(mgr.flush, timeout=HANG)
                for j in (i, i // 2):
                    if get_exact(mgr, j, refs[j]):
                        hits[phase[0]] += 1
                timed(mgr.lookup_prefix, [make_key(j) for j in range(max(0, i - 8), i + 1)])
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=workload)
    worker.start()
    try:
        wait_until(lambda: hits["before"] >= 10, "no hits before the kill")
        phase[0] = "down"
        srv.kill()
        wait_until(lambda: stats(mgr)["breaker_trips"] >= 1, "the breaker never tripped")
        wait_until(lambda: stats(mgr)["breaker_refused"] >= 5, "the breaker refused nothing")
        assert stats(mgr)["breaker_open"] == 1.0
        srv.restart()  # empty: no persistence
        phase[0] = "after"
        wait_until(lambda: hits["after"] >= 10, "no hits after the restart")
    finally:
        stop.set()
        worker.join(timeout=60)
        srv.stop()
        st = stats(mgr)
        mgr.close()
    print(json.dumps({"hits": hits, "stats": st}))
    assert not worker.is_alive()
    assert not errors, errors[0]
    assert st["breaker_open"] == 0.0, st
    assert st["corrupt"] == 0 and st["remote_errors"] + st["socket_timeouts"] >= 1, st
    assert st["dropped_down"] + st["put_errors"] >= 1, st  # stores while down were dropped
    assert mgr_faults(mgr) == 0


def mgr_faults(mgr: StorageManager) -> float:
    """Exceptions that escaped the tier's hooks (the manager counts them as tier faults)."""
    return sum(t.faults for t in mgr._tiers)


def test_restart_loses_values_they_are_misses(tmp_path):
    """A value stored before a restart of a server without persistence is a miss afterwards (in
    lookups and loads), and storing it again makes it a hit."""
    srv = RedisServer(tmp_path / "redis")
    mgr = manager(srv.url)
    try:
        refs = {i: put(mgr, i) for i in range(4)}
        assert mgr.flush(timeout=HANG)
        assert mgr.lookup_prefix([make_key(i) for i in range(4)]).num_chunks == 4
        srv.restart()
        time.sleep(1.1)  # past the tier's memory of what it wrote (trusted for 1 s)
        got = [timed(mgr.get, make_key(i), promote=False) for i in range(4)]
        assert got == [None] * 4
        assert timed(mgr.lookup_prefix, [make_key(i) for i in range(4)]).num_chunks == 0
        refs[0] = put(mgr, 0, seed=100)
        assert mgr.flush(timeout=HANG)
        assert get_exact(mgr, 0, refs[0])
        assert mgr_faults(mgr) == 0
    finally:
        mgr.close()
        srv.stop()


def test_full_store_allkeys_lru_evicts_silently(tmp_path):
    """With a small maxmemory and allkeys-lru the server evicts old values on its own: they are
    misses; recent ones hit exactly; no store is refused; nothing raises."""
    srv = RedisServer(tmp_path / "redis", maxmemory="6mb", policy="allkeys-lru")
    mgr = manager(srv.url, timeout_s=2.0)
    try:
        refs = {}
        for i in range(60):  # 15 MiB into ~5 MiB of room
            refs[i] = put(mgr, i)
            assert mgr.flush(timeout=HANG)
        hit = [get_exact(mgr, i, refs[i]) for i in range(60)]
        assert not all(hit[:10]), "nothing was evicted: the test would pass vacuously"
        assert hit[-1], "the most recent chunk is gone"
        found = mgr.lookup_prefix([make_key(i) for i in range(60)]).num_chunks
        assert found == (hit.index(False) if False in hit else 60)
        st = stats(mgr)
        print(json.dumps({"hits": hit.count(True), "stats": st}))
        assert st["dropped_full"] == 0 and st["corrupt"] == 0 and st["breaker_trips"] == 0, st
        assert mgr_faults(mgr) == 0
    finally:
        mgr.close()
        srv.stop()


def test_full_store_noeviction_drops_stores(tmp_path):
    """With noeviction the server refuses writes once full (OOM): those stores are dropped and
    counted, the breaker stays closed (the store answers), what was stored still hits exactly."""
    srv = RedisServer(tmp_path / "redis", maxmemory="6mb", policy="noeviction")
    mgr = manager(srv.url, timeout_s=2.0)
    try:
        refs = {}
        for i in range(40):
            refs[i] = put(mgr, i)
            assert mgr.flush(timeout=HANG)
        hit = [get_exact(mgr, i, refs[i]) for i in range(40)]
        st = stats(mgr)
        print(json.dumps({"hits": hit.count(True), "stats": st}))
        assert hit[0] and not hit[-1], hit
        assert st["dropped_full"] == hit.count(False) > 0, st
        assert st["written"] == hit.count(True), st
        assert st["breaker_trips"] == 0 and st["breaker_open"] == 0, st
        assert mgr.lookup_prefix([make_key(i) for i in range(40)]).num_chunks == hit.index(False)
        assert mgr_faults(mgr) == 0
    finally:
        mgr.close()
        srv.stop()


def test_hung_server_bounded_misses_then_recovers(tmp_path):
    """A server stopped with SIGSTOP (accepts connections, never answers): lookups, loads and
    stores return within the bound as misses / dropped stores; the breaker trips and then refuses
    without waiting; after SIGCONT the tier serves exact hits again."""
    srv = RedisServer(tmp_path / "redis")
    mgr = manager(srv.url)
    try:
        refs = {i: put(mgr, i) for i in range(3)}
        assert mgr.flush(timeout=HANG)
        assert get_exact(mgr, 0, refs[0])
        srv.pause()
        for i in range(3):
            assert timed(mgr.get, make_key(i), promote=False) is None
        assert timed(mgr.lookup_prefix, [make_key(9)]).num_chunks == 0
        refs[5] = put(mgr, 5)
        assert timed(mgr.flush, timeout=HANG)
        st = stats(mgr)
        print(json.dumps({"stats": st}))
        assert st["breaker_open"] == 1.0 and st["socket_timeouts"] >= 2, st
        refused = st["breaker_refused"]
        for i in range(20):  # while open: refused at once (no socket wait)
            assert timed(mgr.get, make_key(i % 3), promote=False) is None
        assert stats(mgr)["breaker_refused"] > refused
        srv.resume()
        wait_until(lambda: get_exact(mgr, 1, refs[1]), "no hit after SIGCONT")
        assert stats(mgr)["breaker_open"] == 0.0
        assert mgr_faults(mgr) == 0
    finally:
        mgr.close()
        srv.stop()


def _burst(mgr: StorageManager, server: RedisServer, n: int) -> list[torch.Tensor]:
    """Store ``n`` chunks in one ``batched_put`` while the server is hung (SIGSTOP: the one
    writer thread blocks on its first batch, everything else waits in the queue); resumed
    after. Their reference bytes."""
    objs, refs = [], []
    for i in range(n):
        obj = mgr.allocate(tier_workload.SHAPE, dtype=torch.uint8, num_tokens=16)
        obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(i)))
        objs.append(obj)
        refs.append(obj.byte_view.clone())
    server.pause()
    try:
        mgr.batched_put([make_key(i) for i in range(n)], objs)
    finally:
        server.resume()
        for obj in objs:
            obj.ref_down()
    return refs


def test_a_burst_of_stores_is_queued_not_dropped_by_default(tmp_path, caplog):
    """An engine stores a long prompt's chunks in one step: with the default queue bound the
    resp tier (and mooncake, fsspec: the same writer) keeps a burst of 300 while its store is
    busy, and writes every one (the old default, 64 queued stores, dropped 235 of them)."""
    server = RedisServer(tmp_path / "r")
    mgr = manager(server.url, timeout_s=30.0, io_threads=1, batch_bytes=1)
    try:
        refs = _burst(mgr, server, 300)
        assert mgr.flush(timeout=HANG)
        stats = mgr.stats()["resp"]
        assert stats["dropped_queue_full"] == 0 and stats["dropped_puts"] == 0, stats
        assert stats["written"] == 300
        for i in (0, 150, 299):
            assert tier_workload.get_exact(mgr, make_key(i), refs[i])
    finally:
        mgr.close()
        server.stop()


def test_a_full_write_queue_drops_counts_and_says_which_option(tmp_path, caplog):
    """Past ``max_pending_bytes`` (or ``max_pending_writes``) queued, a store is dropped at
    once (the engine never waits), counted as ``dropped_queue_full`` (and in the
    ``dropped_puts`` metric), and logged once naming the option that raises the bound; the
    queued ones are written."""
    server = RedisServer(tmp_path / "r")
    nbytes = torch.Size(tier_workload.SHAPE).numel()
    mgr = manager(server.url, timeout_s=30.0, io_threads=1, batch_bytes=1,
                  max_pending_bytes=20 * nbytes)
    try:
        with caplog.at_level("WARNING", logger="kvplug"):
            _burst(mgr, server, 60)
        assert mgr.flush(timeout=HANG)
        stats = mgr.stats()["resp"]
        assert 39 <= stats["dropped_queue_full"] <= 40, stats  # 20 queued, 1 with the writer
        assert stats["dropped_puts"] == stats["dropped_queue_full"]
        assert stats["written"] == 60 - stats["dropped_queue_full"]
        lines = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
        assert len(lines) == 1 and "max_pending_bytes" in lines[0], lines
    finally:
        mgr.close()
        server.stop()


class TrickleServer:
    """A TCP server speaking just enough RESP: ``HELLO`` gets the protocol, every other command
    but ``EXISTS`` ``+OK``, at once;
    ``EXISTS`` gets a valid integer reply sent one byte every ``gap`` seconds, each byte within
    the client's socket timeout (a server or network that trickles: a fault a real redis-server
    cannot be made to show)."""

    REPLY = b":" + b"0" * 17 + b"1\r\n"  # 21 bytes: the integer 1

    def __init__(self, gap: float) -> None:
        import socket

        self.gap = gap
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sent_whole = threading.Event()
        self.stop = threading.Event()
        self.server = threading.Thread(target=self._serve, daemon=True)
        self.server.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn) -> None:
        with conn:
            buf = b""
            while not self.stop.is_set():
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while b"\r\n" in buf:  # one command per array; answer by its name
                    command, buf = buf.upper(), b""
                    if b"HELLO" in command:  # redis-py's handshake (RESP3): the protocol
                        conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
                        continue
                    if b"EXISTS" not in command:
                        conn.sendall(b"+OK\r\n")
                        continue
                    for byte in self.REPLY:
                        if self.stop.wait(self.gap):
                            return
                        conn.sendall(bytes([byte]))
                    self.sent_whole.set()

    def close(self) -> None:
        import socket

        self.stop.set()
        try:  # wakes the accept() (closing the socket alone leaves it blocked on Linux)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.server.join(timeout=30)


def test_a_reply_trickled_within_the_socket_timeout_is_still_bounded_by_the_tier_timeout():
    """resp's socket timeout bounds each read, not a reply: a reply trickled a byte per 0.3 s
    (socket timeout 0.5 s) takes 6.3 s. Its calls therefore run on the tier's pool under the
    tier's ``timeout_s`` (1 s): the lookup is unknown (``None``), counted as a timeout, and
    answered before the server has sent the whole reply. Before: resp declared ``call_bound_s``
    (2 x 0.5 s x 1 failure), was called on the caller's thread, and the lookup waited for the
    whole reply (True, after 6.3 s)."""
    srv = TrickleServer(gap=0.3)
    mgr = StorageManager({"tiers": [{"backend": "resp", "timeout_s": 1.0, "options": {
        "url": f"redis://127.0.0.1:{srv.port}/0", "timeout_s": 0.5, "negative_cache_s": 0,
        "breaker_threshold": 1}}], "chunk_size": 16})
    try:
        assert not mgr._tiers[0].on_caller_thread
        answer = timed(mgr.holds, "resp", [make_key(1)])
        assert not srv.sent_whole.is_set()  # answered while the reply was still trickling
        assert answer is None and stats(mgr)["timeouts"] == 1
    finally:
        srv.close()
        mgr.close()
