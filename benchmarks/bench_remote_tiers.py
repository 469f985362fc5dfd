"""Remote in-memory stores: each kvplug tier against its raw client, same server, same run.

    .venv/bin/python -m benchmarks.bench_remote_tiers [--chunks 16] [--rounds 5] [--stores resp,mooncake]

* resp tier vs ``redis`` (hiredis parser) on a ``redis-server`` this script starts on 127.0.0.1
  (a free port, no persistence, 2 GiB ``maxmemory``);
* mooncake tier vs Mooncake's ``MooncakeDistributedStore`` (``upsert``, ``get``,
  ``batch_is_exist``) on a ``mooncake_master`` this script starts on 127.0.0.1. Mooncake's clients
  listen on every interface, so with mooncake the script re-runs itself in a private network
  namespace (``unshare -n``, loopback only; needs root).

Servers are stopped at the end. Medians over rounds; raw and tier rounds interleaved:

* put MiB/s at 1 and 4 MiB: raw ``SET`` / ``upsert`` of the encoded chunk (the same bytes the tier stores),
  one after another, vs the tier's ``batched_put`` + ``flush`` (pipelined batches from its
  writer threads, encoding and checksums included), with ``io_threads=1`` and the default 4;
* get MiB/s at 1 and 4 MiB: raw ``GET`` / ``get`` vs ``StorageManager.get`` on a second manager (no local
  state about what the writer stored; an L1 pool in front, as in an engine, not promoted into):
  each chunk read in place into a memory object of the pool (resp: its own reply reader;
  mooncake: ``batch_get_into_multi_buffers``), the header and every layer's checksum verified;
* get MiB/s at 1 and 4 MiB, as the connector loads: ``StorageManager.batched_get`` of the
  chunks (the tier's ``batched_get`` hook: one pipeline / batch call, promoted into that
  manager's L1) vs the raw one-by-one ``GET`` / ``get``;
* a batched lookup of 64 keys (ms): raw pipelined ``EXISTS`` x 64 / ``batch_is_exist`` vs ``lookup_prefix`` of 64
  keys, and vs the tier's ``contains`` hook called directly (without the StorageManager's
  bounded call on a tier thread); negative cache off, so every key is asked of the server.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kvplug import chunkfile as cf
from kvplug.storage_manager import StorageManager
from kvplug.testing.conformance import make_key

from benchmarks.remote_stores import MiB, Raw, private_network_for, started
from benchmarks.remote_stores import chunk as _chunk

LOOKUP_KEYS = 64
LOOKUP_REPS = 20


def _manager(tier: dict, l1: bool = False, **opts) -> StorageManager:
    """A manager over the tier; with ``l1`` an L1 pool in front (as in an engine), so reads land
    in the pool's (prefaulted) memory."""
    t = {**tier, "options": {**tier["options"], "negative_cache_s": 0.0, **opts}}
    tiers = [{"backend": "local_cpu", "options": {"capacity": "128MiB"}}] if l1 else []
    return StorageManager({"tiers": [*tiers, t]})


def _check_and_release(got: list, objs: list) -> None:
    assert all(g is not None and torch.equal(g.byte_view, o.byte_view)
               for g, o in zip(got, objs)), "tier returned wrong bytes"
    for g in got:
        g.ref_down()


def measure(store: str, raw: Raw, tier: dict, args: argparse.Namespace,
            res: dict[str, list[float]]) -> None:
    """Raw client and tier rounds, interleaved, on the same store; medians go to ``res``."""

    def rec(name: str, value: float) -> None:
        res.setdefault(f"{store}:{name}", []).append(value)

    writer = _manager(tier)
    writer1 = _manager(tier, io_threads=1)
    reader = _manager(tier, l1=True)
    breader = _manager(tier, l1=True)  # batched_get promotes into its L1, as the connector's does
    backend = reader.backend(1)
    try:
        for mib in (1, 4):
            objs = [_chunk(mib, i) for i in range(args.chunks)]
            for r in range(args.rounds):
                keys = [make_key(mib * 10**6 + r * 1000 + i) for i in range(args.chunks)]
                files = [(lambda h, b: h + b"".join(b))(*cf.encode_chunk(k, o))
                         for k, o in zip(keys, objs)]
                total = sum(o.nbytes for o in objs) / MiB
                names = [f"raw:{mib}:{r}:{i}" for i in range(args.chunks)]
                t = time.perf_counter()
                for name, f in zip(names, files):
                    raw.put(name, f)
                rec(f"raw_put_{mib}", total / (time.perf_counter() - t))
                t = time.perf_counter()
                for name in names:
                    raw.one(name)
                rec(f"raw_get_{mib}", total / (time.perf_counter() - t))
                raw.delete(names)
                pkeys = [k.with_hash(k.chunk_hash + b"p") for k in keys]
                for mgr, label, ks in ((writer1, "tier1", keys), (writer, "tier", pkeys)):
                    t = time.perf_counter()
                    mgr.batched_put(ks, objs)
                    assert mgr.flush(timeout=600)
                    rec(f"{label}_put_{mib}", total / (time.perf_counter() - t))
                t = time.perf_counter()
                got = [reader.get(k, promote=False) for k in keys]
                rec(f"tier_get_{mib}", total / (time.perf_counter() - t))
                _check_and_release(got, objs)
                t = time.perf_counter()
                got = breader.batched_get(pkeys)
                rec(f"tier_bget_{mib}", total / (time.perf_counter() - t))
                _check_and_release(got, objs)
                writer.evict(keys + pkeys)
                breader.evict(pkeys)
        lkeys = [make_key(9 * 10**6 + i) for i in range(LOOKUP_KEYS)]
        small = [_chunk(1 / 64, i) for i in range(LOOKUP_KEYS)]
        writer.batched_put(lkeys, small)
        assert writer.flush(timeout=600)
        lnames = [writer.backend(0).name_of(k) for k in lkeys]
        for _ in range(args.rounds * LOOKUP_REPS):
            t = time.perf_counter()
            assert all(raw.lookup(lnames))
            rec("raw_lookup", (time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            assert reader.lookup_prefix(lkeys).num_chunks == LOOKUP_KEYS
            rec("tier_lookup", (time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            assert all(backend.contains(lkeys, pin=False))
            rec("hook_lookup", (time.perf_counter() - t) * 1e3)
    finally:
        for mgr in (writer, writer1, reader, breader):
            mgr.close()


def report(store: str, client: str, res: dict[str, list[float]], args: argparse.Namespace) -> None:
    med = {k.split(":", 1)[1]: statistics.median(v) for k, v in res.items()
           if k.startswith(store + ":")}
    print(f"\n{store} tier vs {client} — {args.chunks} chunks per size, {args.rounds} rounds "
          "(medians)")
    print("| figure | raw client | tier | ratio |\n|---|---|---|---|")
    for mib in (1, 4):
        for what, raw_k, tier_k in (("put MiB/s (tier io_threads=1)", "raw_put", "tier1_put"),
                                    ("put MiB/s (tier io_threads=4)", "raw_put", "tier_put"),
                                    ("get MiB/s (StorageManager.get, one by one)", "raw_get",
                                     "tier_get"),
                                    ("get MiB/s (batched_get, as the connector loads)",
                                     "raw_get", "tier_bget")):
            a, b = med[f"{raw_k}_{mib}"], med[f"{tier_k}_{mib}"]
            print(f"| {mib} MiB {what} | {a:.0f} | {b:.0f} | {b / a:.2f}x |")
    a = med["raw_lookup"]
    for what, k in (("StorageManager.lookup_prefix", "tier_lookup"),
                    ("the contains hook", "hook_lookup")):
        print(f"| lookup of {LOOKUP_KEYS} keys, ms ({what}) | {a:.2f} | {med[k]:.2f} | "
              f"{a / med[k]:.2f}x |")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stores", default="resp,mooncake", help="comma-separated: resp, mooncake")
    args = ap.parse_args()
    stores = args.stores.split(",")
    private_network_for(stores, __spec__.name)
    logging.getLogger("kvplug").setLevel(logging.ERROR)
    res: dict[str, list[float]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="kvplug-bench-remote-"))
    try:
        for name in stores:
            with started(name, workdir, maxmemory="2gb", segment="256MiB",
                         buffer="256MiB") as store:
                raw = store.make_raw()
                try:
                    measure(name, raw, store.tier(), args, res)
                finally:
                    raw.close()
            report(name, store.client, res, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
