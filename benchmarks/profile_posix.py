"""The posix tier's store and load beside plain files, by wall time and by CPU time.

    .venv/bin/python -m benchmarks.profile_posix [--dir /tmp/kvplug-profile] [--rounds 7]

``kvplug bench``'s two sides, driven the same way (:class:`kvplug.cli.bench.TierTarget`: the tier
alone in a StorageManager, a store is ``batched_put`` + ``flush``, a load ``get`` or
``batched_get``; :class:`kvplug.backends.posix.bench.RawFiles`: ``pwritev``/``preadv`` of the same encoded
chunk files, no fsync on either side), for each value size and batch: every round stores a fresh
set of values on both sides, loads each of them back (each answer compared, outside the timing,
and released before the next call) and removes them; the sides alternate which goes first.
Per side and phase: MB/s of wall time and MB per CPU-second (the process's, writer and reader
threads included: what the work costs, which other processes on a shared machine move least);
the ratio is kvplug / raw in the same round, the median over rounds. Then CPU µs per value of
tight loops over 96 stored values (:func:`per_value`). The load average is printed at the start
and the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import uuid
from pathlib import Path

import torch
from kvplug.backends.posix.bench import RawFiles
from kvplug.cli.bench import TierTarget, Values, bench_key
from kvplug.config import TierConfig, parse_size


def timed(fn) -> tuple[float, float]:  # noqa: ANN001 - a callable
    """``(wall seconds, process CPU seconds)`` of ``fn()``."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def one_round(target, values: Values, run: bytes, first: int, n: int, batch: int
              ) -> dict[str, tuple[float, float]]:
    """Store ``n`` values in calls of ``batch``, load them back in calls of ``batch`` (bytes
    compared after the timing), remove them: ``{phase: (wall, cpu)}``."""
    ids = list(range(first, first + n))
    keys = [bench_key(run, i) for i in ids]
    objs = [values.obj(i, 256) for i in ids]
    groups = [(keys[s : s + batch], objs[s : s + batch]) for s in range(0, n, batch)]
    try:
        store = timed(lambda: [target.store(k, o) for k, o in groups])
    finally:
        for obj in objs:
            obj.ref_down()
    excluded = [0.0, 0.0]  # comparing the bytes loaded is left out of the timing

    def load() -> None:
        done = 0
        for k, _ in groups:  # each answer checked and released before the next call (as in
            answer = target.load(k)  # kvplug bench: memory freed by one call serves the next)
            w, c = timed(lambda a=answer, d=done: check(target, values, ids[d : d + len(a)], a))
            excluded[0] += w
            excluded[1] += c
            done += len(k)

    try:
        wall, cpu = timed(load)
        spent = (wall - excluded[0], cpu - excluded[1])
    finally:
        target.remove(keys)
    return {"store": store, "load": spent}


def check(target, values: Values, ids: list[int], answer: list) -> None:  # noqa: ANN001
    try:
        for i, got in zip(ids, answer, strict=True):
            assert got is not None, f"value {i} missed"
            assert torch.equal(target.payload(got).reshape(-1), values.view(i)), \
                f"value {i}: other bytes"
    finally:
        for got in answer:
            target.release(got)


def per_value(kv: TierTarget, raw: RawFiles, size: int, run: bytes, rounds: int) -> None:
    """CPU µs per value of tight loops over 96 stored values, the sides interleaved: loads one
    value a call (each answer released before the next: plain reads reuse one buffer) and 96 a
    call (96 answers held at once: plain reads take fresh memory), and stores of 1 and of 96 a
    call (+ their removal)."""
    values = Values(size, seed=size + 1)
    keys = [bench_key(run + b"pv", i) for i in range(96)]
    objs = [values.obj(i, 256) for i in range(96)]
    fresh = [0]

    def stored_and_removed(target, batch: int = 96) -> None:  # noqa: ANN001
        ks = [bench_key(run + b"st", fresh[0] + i) for i in range(96)]
        fresh[0] += 96
        for s in range(0, 96, batch):
            target.store(ks[s : s + batch], objs[s : s + batch])
        target.remove(ks)

    loops = {
        "load, 1 a call": (lambda: [kv.release(kv.load([k])[0]) for k in keys],
                           lambda: [raw.load([k]) and None for k in keys]),
        "load, 96 a call": (lambda: [kv.release(o) for o in kv.load(keys)],
                            lambda: raw.load(keys)),
        "store + remove, 1 a call": (lambda: stored_and_removed(kv, 1),
                                     lambda: stored_and_removed(raw, 1)),
        "store + remove, 96 a call": (lambda: stored_and_removed(kv),
                                      lambda: stored_and_removed(raw)),
    }
    kv.store(keys, objs)
    raw.store(keys, objs)
    try:
        for name, (mine, plain) in loops.items():
            spent: dict[str, list[float]] = {"kvplug": [], "raw": []}
            for r in range(rounds):
                for who, fn in [("kvplug", mine), ("raw", plain)][:: 1 if r % 2 == 0 else -1]:
                    spent[who].append(timed(fn)[1] / 96 * 1e6)
            k, p = statistics.median(spent["kvplug"]), statistics.median(spent["raw"])
            print(f"| {size >> 10} KiB | {name} | {k:.0f} | {p:.0f} | {p / k:.2f}x |", flush=True)
    finally:
        for obj in objs:
            obj.ref_down()
        kv.remove(keys)
        raw.remove(keys)


def rates(spent: list[tuple[float, float]], mb: float) -> tuple[float, float]:
    """Median MB per wall second and per CPU second over rounds."""
    return (statistics.median(mb / w for w, _ in spent),
            statistics.median(mb / c for _, c in spent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/kvplug-profile", help="directory of both sides")
    ap.add_argument("--sizes", default="256KiB,1MiB")
    ap.add_argument("--batches", default="1,96")
    ap.add_argument("--bytes", default="96MiB", help="bytes stored per round and side")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-value-only", action="store_true",
                    help="only the CPU µs per value of the tight loops (no MB/s table)")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    tier = TierConfig(backend="posix", options={"path": str(root / "kvplug")}, timeout_s=600.0)
    kv, raw = TierTarget(tier), RawFiles(str(root), False)
    run = uuid.uuid4().bytes[:6]
    print(f"load average at start: {os.getloadavg()}")
    try:
        if not args.per_value_only:
            table(args, kv, raw, run)
        print("\n| value | loop | kvplug µs CPU/value | raw µs CPU/value | raw / kvplug |")
        print("|---|---|---|---|---|")
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            per_value(kv, raw, size, run, max(args.rounds, 9))
    finally:
        kv.close()
        raw.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")


def table(args: argparse.Namespace, kv: TierTarget, raw: RawFiles, run: bytes) -> None:
    """The ``kvplug bench``-shaped table: MB/s of wall and CPU time per side, size and batch."""
    print("| value | batch | op | kvplug MB/s wall | raw MB/s wall | ratio wall | "
          "kvplug MB/CPU-s | raw MB/CPU-s | ratio CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    first = 0
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        values = Values(size, seed=size)
        n = max(96, parse_size(args.bytes) // size // 96 * 96)
        for batch in [int(b) for b in args.batches.split(",")]:
            rows: dict[str, dict[str, list[tuple[float, float]]]] = {
                ph: {"kvplug": [], "raw": []} for ph in ("store", "load")}
            for r in range(args.rounds):
                order = [("kvplug", kv), ("raw", raw)][:: 1 if r % 2 == 0 else -1]
                for who, target in order:
                    for ph, spent in one_round(target, values, run, first, n, batch).items():
                        rows[ph][who].append(spent)
                    first += n
            mb = n * size / 1e6
            for ph, sides in rows.items():
                kvw, kvc = rates(sides["kvplug"], mb)
                raww, rawc = rates(sides["raw"], mb)
                ratio = [statistics.median(r[k] / s[k] for s, r in zip(sides["kvplug"],
                                                                        sides["raw"]))
                         for k in (0, 1)]
                print(f"| {size >> 10} KiB | {batch} | {ph} | {kvw:.0f} | {raww:.0f} | "
                      f"{ratio[0]:.2f}x | {kvc:.0f} | {rawc:.0f} | {ratio[1]:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
