"""Remote reads against the raw client, interleaved round by round: where a tier's load time goes.

    .venv/bin/python -m benchmarks.bench_remote_reads [--mib 1,4] [--chunks 16] [--rounds 15] \
        [--stores resp,mooncake,fsspec]

Against a ``redis-server`` / ``mooncake_master`` / moto's S3 server (in this process) this
script starts on 127.0.0.1 (with mooncake it re-runs itself in a private network namespace, as
bench_remote_tiers.py does), chunks stored by the tier are read, in every round one case after
another, the order rotated by one each round (so a load spike on this shared machine, or being
first, favours no case):

* ``raw batch``: resp: redis-py (hiredis) ``GET`` of every chunk in one pipeline; mooncake:
  ``get_batch`` of a second client of the same master; fsspec: s3fs ``cat`` of every path
  (concurrent requests);
* ``raw one by one``: redis-py ``GET`` / Mooncake ``get`` / s3fs ``cat_file`` per chunk;
* ``tier batched_get, alone``: ``StorageManager.batched_get`` of the chunks, the resp tier alone
  in the manager (no L1, as ``kvplug bench`` drives it, or an engine with that tier only); and
  for resp the same with the tier's reads in place turned off (``in place off``: the read path
  of a tier alone without them: redis-py's reply copied into a heap object; mooncake reads
  into registered memory only, so alone it copies either way);
* ``tier batched_get, L1 in front``: as an engine loads (reads in place into L1's pool; evicted
  from L1 before each read, so every round reads the server);
* ``tier get one by one, alone``: ``StorageManager.get`` per chunk (the bench's batch of 1); for
  a tier called on the caller's thread (``call_bound_s``: resp) also ``handed off``, the same
  calls through the tier's pool.

Every chunk the tier returns is compared byte for byte with what was stored (outside the timed
part). Printed per case: the median over rounds of MiB/s, of the ratio to the raw client of the
same shape in the same round (batch for batches, one by one for single gets) and to the faster
of the two raw shapes in that round (Mooncake's ``get_batch`` is slower than its ``get`` one by
one here), and the median CPU time of this process per MiB read (``time.process_time``, all threads: the client's own
cost, which moves far less with the machine's load than wall time does).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kvplug.storage_manager import StorageManager
from kvplug.testing.conformance import make_key

from benchmarks.remote_stores import MiB, Raw, chunk, private_network_for, started


def measure(store: str, tier: dict, raw: Raw, mib: float, chunks: int, rounds: int) -> None:
    tier = {**tier, "options": {**tier["options"], "negative_cache_s": 0.0,
                                "max_pending_writes": 4096}}
    l1 = {"backend": "local_cpu", "name": "l1",
          "options": {"capacity": f"{int(chunks * mib * 3) + 64}MiB"}}
    writer = StorageManager({"tiers": [tier]})
    alone = StorageManager({"tiers": [tier]})
    with_l1 = StorageManager({"tiers": [l1, tier]})
    before = None
    extra: list[StorageManager] = []
    if store == "resp":
        before = StorageManager({"tiers": [tier]})
        before.backend(0)._into_pool = False  # reads in place off: redis-py + a copy
    elif store == "fsspec":
        from kvplug.backends.common.chunks import HeaderCache

        before = StorageManager({"tiers": [tier]})
        off = before.backend(0)  # no header nor layout known: 3 requests a read (header first)
        off._headers = HeaderCache(0)
        off._learn = lambda header: None
    objs = [chunk(mib, i) for i in range(chunks)]
    keys = [make_key(int(mib * 1000) * 10**6 + i) for i in range(chunks)]
    try:
        writer.batched_put(keys, objs)
        assert writer.flush(timeout=600), "stores did not finish"
        backend = writer.backend(0)
        names = [backend.name_of(k) if store != "fsspec" else backend.path_of(k) for k in keys]
        cases: dict[str, tuple[Callable[[], list], str | None]] = {
            "raw batch": (lambda: raw.batch(names), None),
            "raw one by one": (lambda: [raw.one(n) for n in names], None),
            "tier batched_get, alone": (lambda: alone.batched_get(keys), "raw batch"),
            "tier batched_get, L1 in front": (lambda: with_l1.batched_get(keys), "raw batch"),
            "tier get one by one, alone": (lambda: [alone.get(k, promote=False) for k in keys],
                                           "raw one by one"),
        }
        off = "header cache off" if store == "fsspec" else "in place off"
        if before is not None:
            cases[f"tier batched_get, alone, {off}"] = (lambda: before.batched_get(keys),
                                                        "raw batch")
            cases[f"tier get one by one, alone, {off}"] = (
                lambda: [before.get(k, promote=False) for k in keys], "raw one by one")
        if alone._tiers[0].on_caller_thread:  # called on this thread: the same calls handed off too
            handed = StorageManager({"tiers": [tier]})
            handed._tiers[0].on_caller_thread = False
            extra.append(handed)
            cases["tier get one by one, alone, handed off"] = (
                lambda: [handed.get(k, promote=False) for k in keys], "raw one by one")
        wall: dict[str, list[float]] = {c: [] for c in cases}
        cpu: dict[str, list[float]] = {c: [] for c in cases}
        for r in range(rounds + 1):  # round 0 warms connections and layouts: not counted
            order = list(cases)
            for case in order[r % len(order):] + order[: r % len(order)]:  # rotated by round
                read, of = cases[case]
                with_l1.evict(keys, tiers=["l1"])  # the last round's promotions (released)
                t, c = time.perf_counter(), time.process_time()
                got = read()
                dt, dc = time.perf_counter() - t, time.process_time() - c
                if of is None:
                    assert all(g for g in got), f"{case}: a value is missing"
                else:
                    for g, o in zip(got, objs, strict=True):
                        assert g is not None and torch.equal(g.byte_view, o.byte_view), \
                            f"{case}: a chunk differs from what was stored"
                        g.ref_down()
                if r:
                    wall[case].append(dt)
                    cpu[case].append(dc)
        total = chunks * objs[0].nbytes / MiB
        print(f"\n{store}: {mib:g} MiB x {chunks} chunks, {rounds} rounds (medians)", flush=True)
        best = [min(a, b) for a, b in zip(wall["raw batch"], wall["raw one by one"])]
        print("| case | MiB/s | / raw, same round | / faster raw, same round | CPU ms per MiB |\n"
              "|---|---|---|---|---|")
        for case, (_, of) in cases.items():
            ratio, top = ("-", "-") if of is None else (
                f"{statistics.median(b / a for a, b in zip(wall[case], wall[of])):.2f}x",
                f"{statistics.median(b / a for a, b in zip(wall[case], best)):.2f}x")
            print(f"| {case} | {total / statistics.median(wall[case]):.0f} | {ratio} | {top} | "
                  f"{1e3 * statistics.median(cpu[case]) / total:.2f} |")
        st = {n: m.stats()[store] for n, m in (("alone", alone), ("L1", with_l1))}
        if store == "fsspec":
            print(f"corrupt: alone {st['alone']['corrupt']:.0f}, L1 {st['L1']['corrupt']:.0f}")
            return
        print("reads in place: " + ", ".join(
            f"{n} {s['reads_in_place']:.0f} (layout misses {s['layout_misses']:.0f}, corrupt "
            f"{s['corrupt']:.0f})" for n, s in st.items()), flush=True)
    finally:
        writer.evict(keys)
        for m in (writer, alone, before, with_l1, *extra):
            if m is not None:
                m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="1,4", help="chunk sizes in MiB, comma-separated")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--stores", default="resp,mooncake,fsspec",
                    help="comma-separated: resp, mooncake, fsspec (moto's S3 server)")
    args = ap.parse_args()
    stores = args.stores.split(",")
    private_network_for(stores, __spec__.name)
    logging.getLogger("kvplug").setLevel(logging.ERROR)
    sizes = [float(m) for m in args.mib.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="kvplug-bench-reads-"))
    try:
        for name in stores:
            with started(name, workdir) as store:
                raw = store.make_raw()
                print(store.client, flush=True)
                try:
                    for mib in sizes:
                        measure(name, store.tier(), raw, mib, args.chunks, args.rounds)
                finally:
                    raw.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
