"""CPU µs of one posix ``get`` (batch 1) beside a plain file read of the same file, by process time.

    .venv/bin/python -m benchmarks.profile_posix_get [--dir /dev/shm/kvplug-get]
        [--sizes 256KiB,1MiB] [--rounds 15] [--calls 300]

The tier alone in a StorageManager (as ``kvplug bench`` builds it) holds one chunk of each size,
in the page cache; each loop calls ``StorageManager.get`` of it (every layer's checksum verified,
the answer released before the next call, so the tier's heap reuses its buffer) or opens, fstats,
reads (``preadv`` into one reused buffer) and closes the same file. CPU time is the process's
(``time.process_time``: the reader's threads included, e.g. the LRU stamp a read leaves to the
reaper's thread), the loops taking turns round by round; the minimum and the median per call over
rounds are printed, and their ratio plain / get (the ``kvplug bench`` sense: 1.0 is as fast as
plain files). On a shared machine the minimum moves least.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvplug.cli.bench import TierTarget, Values, bench_key
from kvplug.config import TierConfig, parse_size


def timed_turns(loops: dict[str, Callable[[], object]], rounds: int,
                calls: int) -> dict[str, tuple[float, float]]:
    """``{name: (min, median)}`` process CPU µs per call of each loop, the loops taking turns."""
    spent: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, fn in loops.items():
            t = time.process_time()
            for _ in range(calls):
                fn()
            spent[name].append((time.process_time() - t) / calls * 1e6)
    return {k: (min(v), statistics.median(v)) for k, v in spent.items()}


def one_size(kv: TierTarget, size: int, run: bytes, rounds: int, calls: int) -> None:
    values = Values(size, seed=size)
    key = bench_key(run, size)
    obj = values.obj(0, 256)
    try:
        kv.store([key], [obj])
    finally:
        obj.ref_down()
    mgr = kv.mgr
    backend = mgr.backend(0)
    path = str(backend.reader._dir.path(backend._rel(key)))  # noqa: SLF001 - the same file
    buf = bytearray(os.stat(path).st_size)

    def plain() -> None:
        f = os.open(path, os.O_RDONLY)
        os.fstat(f)
        os.preadv(f, [buf], 0)
        os.close(f)

    def get() -> None:
        mgr.get(key, promote=False).ref_down()

    get()  # the header learned, the heap's buffer made
    try:
        rows = timed_turns({"get": get, "plain": plain}, rounds, calls)
    finally:
        kv.remove([key])
    (g_min, g_med), (p_min, p_med) = rows["get"], rows["plain"]
    print(f"| {size >> 10} KiB | {g_min:.1f} / {g_med:.1f} | {p_min:.1f} / {p_med:.1f} "
          f"| {p_min / g_min:.2f}x / {p_med / g_med:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm/kvplug-get", help="the tier's directory")
    ap.add_argument("--sizes", default="256KiB,1MiB")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=300, help="calls per loop and round")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    kv = TierTarget(TierConfig(backend="posix", options={"path": str(root / "kvplug")},
                               timeout_s=600.0))
    print(f"load average at start: {os.getloadavg()}")
    print("| value | get µs CPU (min / median) | plain read µs CPU (min / median) "
          "| plain / get (min / median) |")
    print("|---|---|---|---|")
    try:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            one_size(kv, size, uuid.uuid4().bytes[:6], args.rounds, args.calls)
    finally:
        kv.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
