"""CPU µs of one posix read and one posix write, layer by layer, beside plain file I/O.

    .venv/bin/python -m benchmarks.profile_posix_layers [--dir /dev/shm/kvplug-layers]
        [--sizes 256KiB,1MiB] [--rounds 15] [--clock thread|process]

A shared machine's wall clock (and its whole-loop CPU time) swings with other people's load;
the thread CPU time of one call repeated in a tight loop, the loops interleaved and the minimum
over rounds taken, moves far less, and the difference between two nested layers is the outer
layer's own cost (``--clock process`` counts the process's CPU instead: what the
``StorageManager.get`` row costs beside the plain read, the threads it hands work to included).
Read, batch 1 (a chunk in the page cache, each answer released before the next call, so plain
reads reuse their buffer as the tier's heap does):

* ``StorageManager.get``: the whole load as ``kvplug bench`` makes it;
* the tier's ``batched_get_nowait`` hook: pluggy with the metrics and codec wrappers;
* the backend's ``batched_get_nowait``: the key's file name, the per-key loop;
* ``Reader.read_nowait``: the queue and eviction checks, the open (``openat2``), the LRU touch,
  the counters;
* ``ChunkFileIO.read_nowait`` (through a descriptor opened once, so without the open and close
  the plain read below pays): memory from ``ctx.allocate``, one ``preadv`` of header and
  layers, the header compared, every layer verified;
* plain ``open``/``fstat``/``preadv``/``close`` of the same file into one buffer, then its
  layers' checksums compared with the header's: the least a read that verifies what it serves
  costs in Python (issue 49's floor: no memory object, no index, no counters, no plugin call);
* plain ``open``/``fstat``/``preadv``/``close`` of the same file into one buffer.

Write (the same chunk): ``StorageManager`` store of a fresh key (``batched_put`` + ``flush``, as
``kvplug bench`` times it: the hand-off to the writer's thread and back included; best with
``--clock process``, which counts the writer's thread), ``encode_chunk_with_header`` (header,
per-layer checksums), ``write_chunk`` (temporary file, ``pwritev``, rename; encoded once) against
plain ``open``/``pwritev``/``close`` of the same bytes; each file deleted outside the timing. It
reaches into the tier's parts (``_tiers``, ``reader``): a profile, not an API.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import xxhash
from kvplug import chunkfile as cf
from kvplug.backends.posix import io as posix_io
from kvplug.cli.bench import TierTarget, Values, bench_key
from kvplug.config import TierConfig, parse_size
from kvplug.keys import CacheKey

#: ``--clock``: this thread's CPU time (one call's own cost), or the process's (the threads a
#: call leaves work to included, e.g. the LRU stamp a read hands to the reaper's thread)
CLOCKS = {"thread": time.thread_time, "process": time.process_time}


def interleaved(loops: dict[str, Callable[[], object]], rounds: int, calls: int,
                after: Callable[[], None] | None = None,
                clock: Callable[[], float] = time.thread_time) -> dict[str, tuple[float, float]]:
    """``{name: (min, median)}`` CPU µs per call of each loop by ``clock``, the loops taking
    turns round by round; ``after()`` runs after each loop, outside the timing."""
    spent: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, fn in loops.items():
            t = clock()
            for _ in range(calls):
                fn()
            spent[name].append((clock() - t) / calls * 1e6)
            if after is not None:
                after()
    return {k: (min(v), statistics.median(v)) for k, v in spent.items()}


def report(size: int, what: str, rows: dict[str, tuple[float, float]]) -> None:
    names = list(rows)
    for name, inner in zip(names, [*names[1:], None]):
        own = "" if inner is None else f"{rows[name][0] - rows[inner][0]:.1f}"
        print(f"| {size >> 10} KiB | {what} | {name} | {rows[name][0]:.1f} | {rows[name][1]:.1f} "
              f"| {own} |", flush=True)


def read_layers(kv: TierTarget, size: int, run: bytes, rounds: int,
                clock: Callable[[], float] = time.thread_time) -> None:
    values = Values(size, seed=size)
    key = bench_key(run, 0)
    obj = values.obj(0, 256)
    try:
        kv.store([key], [obj])
    finally:
        obj.ref_down()
    mgr = kv.mgr
    tier = mgr._tiers[0]  # noqa: SLF001 - a profile of the tier's parts
    backend = tier.backend
    reader = backend.reader
    rel = backend._rel(key)  # noqa: SLF001
    opened = reader._cached.open(rel)  # noqa: SLF001
    if opened is None:
        print(f"| {size >> 10} KiB | read | (no openat2 RESOLVE_CACHED here: skipped) | | | |")
        return
    fd, st = opened
    path = str(reader._dir.path(rel))  # noqa: SLF001
    buf = bytearray(st.st_size)

    def plain() -> None:
        f = os.open(path, os.O_RDONLY)
        os.fstat(f)
        os.preadv(f, [buf], 0)
        os.close(f)

    header = reader.files.headers.known(rel)[0]
    layers = [(o, o + header.layer_nbytes) for o in header.data_offsets]
    flat = memoryview(buf)

    def verified() -> None:
        plain()
        digest = xxhash.xxh3_64_hexdigest
        if [digest(flat[a:b]) for a, b in layers] != header.checksums:
            raise AssertionError("the file's layers differ from its header's checksums")

    hook = tier.hooks["batched_get_nowait"]
    loops: dict[str, Callable[[], object]] = {
        "StorageManager.get": lambda: mgr.get(key, promote=False).ref_down(),
        "hook batched_get_nowait": lambda: hook(keys=[key])[0].ref_down(),
        "backend batched_get_nowait": lambda: backend.batched_get_nowait([key])[0].ref_down(),
        "Reader.read_nowait": lambda: reader.read_nowait(key, rel).ref_down(),
        "ChunkFileIO.read_nowait": lambda: reader.files.read_nowait(fd, key, rel, st)[0]
        .ref_down(),
        "plain read, then its checksums (the verified floor)": verified,
        "plain open+fstat+preadv+close": plain,
    }
    try:
        report(size, "read", interleaved(loops, rounds, 300, clock=clock))
    finally:
        os.close(fd)
        kv.remove([key])


def write_layers(kv: TierTarget, root: Path, size: int, run: bytes, rounds: int,
                 clock: Callable[[], float] = time.thread_time) -> None:
    values = Values(size, seed=size)
    key = bench_key(b"layers", 1)
    obj = values.obj(0, 256)
    stored: list[CacheKey] = []
    fresh = itertools.count()

    def store() -> None:
        stored.append(bench_key(run + b"w", next(fresh)))
        kv.store([stored[-1]], [obj])

    header, bufs, head = cf.encode_chunk_with_header(key, obj)
    shard = root / "writes"
    shard.mkdir(parents=True, exist_ok=True)
    made: list[str] = []
    n = [0]

    def name() -> str:
        n[0] += 1
        made.append(str(shard / f"f{n[0]}"))
        return made[-1]

    def plain() -> None:
        f = os.open(name(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwritev(f, [header, *bufs], 0)
        os.close(f)

    def removed() -> None:
        for p in made:
            os.unlink(p)
        made.clear()
        kv.remove(stored)
        stored.clear()

    loops: dict[str, Callable[[], object]] = {
        "StorageManager store (batched_put + flush)": store,
        "encode_chunk_with_header": lambda: cf.encode_chunk_with_header(key, obj),
        "write_chunk (encoded once)": lambda: posix_io.write_chunk(name(), obj, header, bufs,
                                                                   size=head.file_size),
        "plain open+pwritev+close": plain,
    }
    try:
        rows = interleaved(loops, rounds, 50, after=removed, clock=clock)
    finally:
        removed()
        obj.ref_down()
    for name_, (low, mid) in rows.items():
        print(f"| {size >> 10} KiB | write | {name_} | {low:.1f} | {mid:.1f} | |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm/kvplug-layers", help="directory of both sides")
    ap.add_argument("--sizes", default="256KiB,1MiB")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                    help="thread: each layer's own cost; process: what a read costs the process")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    tier = TierConfig(backend="posix", options={"path": str(root / "kvplug")}, timeout_s=600.0)
    kv = TierTarget(tier)
    run = uuid.uuid4().bytes[:6]
    print(f"load average at start: {os.getloadavg()}")
    print("| value | op | layer | min µs CPU | median µs CPU | own (min less the next) |")
    print("|---|---|---|---|---|---|")
    try:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            read_layers(kv, size, run, args.rounds, CLOCKS[args.clock])
            write_layers(kv, root, size, run, args.rounds, CLOCKS[args.clock])
    finally:
        kv.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
