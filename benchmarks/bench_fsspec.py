"""fsspec tier vs raw s3fs on the same moto S3 server, same bytes, same run.

    .venv/bin/python -m benchmarks.bench_fsspec [--chunk-mib 4] [--chunks 10] [--rounds 3]

Measures (medians over rounds; raw and tier rounds interleaved so moto's slow-down as it fills
affects both alike):
* put MiB/s: raw ``pipe_file`` of the encoded chunk file, one after another, vs the tier's
  ``batched_put`` + ``flush`` with ``io_threads=1`` (same concurrency) and with the default pool;
* get MiB/s: raw ``cat_file`` vs ``StorageManager.get`` (header + checksums verified, bytes
  copied into a memory object), read by a second manager so no local state helps it;
* lookup latency: raw ``exists`` vs the tier's ``contains`` (negative cache off), 1 key and
  32 keys;
* the gain from concurrent fetches for a 32-chunk prefix: 32 sequential ``get`` vs the same
  ``get`` calls from 8 threads (as ``StorageManager.batched_get`` issues them).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import s3fs
import torch
from kvplug import chunkfile as cf
from kvplug.storage_manager import StorageManager
from kvplug.testing.conformance import make_key
from moto.server import ThreadedMotoServer

from benchmarks.remote_stores import chunk as _chunk

BUCKET = "kvplug-bench"
MiB = 1 << 20
LOOKUP_REPS = 20


def _manager(endpoint: str, prefix: str, **opts) -> StorageManager:
    options = {"url": f"s3://{BUCKET}/{prefix}", "negative_cache_s": 0.0, "timeout_s": 30.0,
               "storage_options": {"endpoint_url": endpoint, "key": "testing",
                                   "secret": "testing"}, **opts}
    return StorageManager({"tiers": [{"backend": "fsspec", "options": options,
                                      "timeout_s": 60.0}]})


def _start_moto(in_process: bool):  # noqa: ANN202
    """moto's S3 server on loopback: its own process by default (no GIL shared with us)."""
    if in_process:
        srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        srv.start()
        host, port = srv.get_host_and_port()
        return srv, f"http://{host}:{port}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from moto.server import main; main(sys.argv[1:])",
         "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.05)
    proc.stop = proc.terminate  # type: ignore[attr-defined]
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-chunk-mib", type=float, default=1.0)
    ap.add_argument("--in-process", action="store_true", help="ThreadedMotoServer in this process")
    args = ap.parse_args()
    for name in ("werkzeug", "moto", "botocore", "s3fs", "kvplug"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    srv, endpoint = _start_moto(args.in_process)
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing",
                           skip_instance_cache=True, use_listings_cache=False)
    fs.mkdir(BUCKET)
    n = args.chunks
    objs = [_chunk(args.chunk_mib, i) for i in range(n)]
    res: dict[str, list[float]] = {}

    def rec(name: str, value: float) -> None:
        res.setdefault(name, []).append(value)

    prefix = f"tier-{uuid.uuid4().hex[:6]}"
    # Long-lived managers, as in an engine: a writer host, a reader host (no local state about
    # what the writer stored), and a writer with a single I/O thread; all warmed up first.
    writer = _manager(endpoint, prefix)
    writer1 = _manager(endpoint, prefix, io_threads=1)
    reader = _manager(endpoint, prefix)
    backend = reader._tiers[0].backend
    for mgr in (writer, writer1, reader):
        mgr.lookup_prefix([make_key(10**6)])
        assert mgr.get(make_key(10**6)) is None
    fs.exists(f"{BUCKET}/warm-up")
    for r in range(args.rounds):
        keys = [make_key(r * 1000 + i) for i in range(n)]
        files = [(lambda h, b: h + b"".join(b))(*cf.encode_chunk(k, o))
                 for k, o in zip(keys, objs)]
        total = sum(len(f) for f in files) / MiB
        raw = f"{BUCKET}/raw-{r}"
        t = time.perf_counter()
        for i, f in enumerate(files):
            fs.pipe_file(f"{raw}/{i}", f)
        rec("raw_put", total / (time.perf_counter() - t))
        t = time.perf_counter()
        for i in range(n):
            fs.cat_file(f"{raw}/{i}")
        rec("raw_get", total / (time.perf_counter() - t))
        for _ in range(LOOKUP_REPS):
            t = time.perf_counter()
            fs.exists(f"{raw}/0")
            rec("raw_lookup1", (time.perf_counter() - t) * 1e3)
        fs.rm(raw, recursive=True)
        for mgr, name, ks in ((writer1, "tier_put_1thread", keys),
                              (writer, "tier_put_pool", [k.with_hash(k.chunk_hash + b"p")
                                                         for k in keys])):
            t = time.perf_counter()
            mgr.batched_put(ks, objs)
            assert mgr.flush(timeout=600)
            rec(name, total / (time.perf_counter() - t))
        t = time.perf_counter()
        got = [reader.get(k) for k in keys]
        rec("tier_get", total / (time.perf_counter() - t))
        assert all(g is not None and torch.equal(g.byte_view, o.byte_view)
                   for g, o in zip(got, objs)), "tier returned wrong bytes"
        for g in got:
            g.ref_down()
        for _ in range(LOOKUP_REPS):
            t = time.perf_counter()
            assert reader.lookup_prefix(keys[:1]).num_chunks == 1
            rec("tier_lookup1", (time.perf_counter() - t) * 1e3)
        fs.rm(f"{BUCKET}/{prefix}", recursive=True)

    # lookups of 32 keys and the 32-chunk prefix fetch
    pkeys = [make_key(10**5 + i) for i in range(32)]
    pobjs = [_chunk(args.prefix_chunk_mib, 1000 + i) for i in range(32)]
    writer.batched_put(pkeys, pobjs)
    assert writer.flush(timeout=600)
    paths = [backend.path_of(k) for k in pkeys]
    readers = ThreadPoolExecutor(max_workers=8)
    for _ in range(args.rounds):
        for _ in range(LOOKUP_REPS // 2):
            t = time.perf_counter()
            for p in paths:
                fs.exists(p)
            rec("raw_lookup32", (time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            assert reader.lookup_prefix(pkeys).num_chunks == 32
            rec("tier_lookup32", (time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        seq = [reader.get(k) for k in pkeys]
        rec("prefix_seq", time.perf_counter() - t)
        t = time.perf_counter()
        conc = list(readers.map(backend.get, pkeys))
        rec("prefix_conc", time.perf_counter() - t)
        assert all(o is not None for o in seq + conc)
        for o in seq + conc:
            o.ref_down()
    readers.shutdown()
    for mgr in (writer, writer1, reader):
        mgr.close()
    srv.stop()

    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"fsspec tier vs raw s3fs on moto {endpoint} — {n} x {args.chunk_mib:g} MiB chunks, "
          f"{args.rounds} rounds (medians)")
    rows = [
        ("put MiB/s", "raw_put", "tier_put_1thread", True),
        ("put MiB/s (tier pool of 8)", "raw_put", "tier_put_pool", True),
        ("get MiB/s", "raw_get", "tier_get", True),
        ("lookup 1 key, ms", "raw_lookup1", "tier_lookup1", False),
        ("lookup 32 keys, ms", "raw_lookup32", "tier_lookup32", False),
    ]
    print(f"{'':28} {'raw s3fs':>10} {'tier':>10} {'ratio':>7}")
    for label, a, b, higher in rows:
        ratio = med[b] / med[a] if higher else med[a] / med[b]
        print(f"{label:28} {med[a]:10.1f} {med[b]:10.1f} {ratio:6.2f}x")
    gain = med["prefix_seq"] / med["prefix_conc"]
    print(f"32-chunk prefix ({args.prefix_chunk_mib:g} MiB chunks): sequential get "
          f"{med['prefix_seq'] * 1e3:.0f} ms, 8 threads of get {med['prefix_conc'] * 1e3:.0f} "
          f"ms -> {gain:.2f}x")
    print("(ratio: tier/raw for throughput, raw/tier for latency; >= 0.9 is the goal)")


if __name__ == "__main__":
    main()
