"""posix tier throughput against a raw os.pwrite/os.preadv baseline on the same file system.

    .venv/bin/python -m benchmarks.bench_posix --dir /dev/shm/kvplug-bench   # tmpfs
    .venv/bin/python -m benchmarks.bench_posix --dir /tmp/kvplug-bench       # disk (ext4)

For each chunk size (1, 4, 16 MiB: 64 KiB pages, layer-major), ``--total`` bytes of chunks are
written as fresh files and read back, best of ``--rounds``:

* raw write: one ``os.open``/``os.pwrite``/``os.close`` per file, same bytes, one thread;
* tier write: ``batched_submit_put`` of every chunk then ``flush`` (checksums, header,
  temporary file + rename, on the tier's writer threads; ``io_threads`` 1 and 4);
* raw read (page cache warm): ``os.open``/``os.preadv`` into a pool buffer/``os.close``;
* tier read: ``get`` per key into pool memory (header parse, checksum of every layer, LRU touch);
* cold reads: both sides with O_DIRECT (raw: aligned ``preadv``; tier: ``o_direct=True``).

Then the lookup cost of ``contains`` for 512 keys on a directory holding 10,000 chunks (hits from
the index, misses that fall back to ``stat``, and hits with ``pin=True``), and the startup scan.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from kvplug import chunkfile as cf
from kvplug.backends.posix import PosixBackend
from kvplug.backends.posix.io import O_DIRECT
from kvplug.hookspecs import TierContext
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat
from kvplug.pool import HostMemoryPool

PAGE = 64 << 10
SIZES = {1: (16, 1), 4: (32, 2), 16: (32, 8)}  # MiB -> (layers, blocks) of 64 KiB pages
GiB = float(1 << 30)


def key(i: int, tag: str = "bench") -> CacheKey:
    return CacheKey(f"bench/{tag}", "bfloat16", "LBHNC-bs16", 1, 0, i.to_bytes(8, "big") * 4)


def make_backend(root: Path, pool: HostMemoryPool, **opts) -> PosixBackend:
    options = PosixBackend.Options(path=str(root), capacity=64 << 30, **opts)
    return PosixBackend(TierContext("posix", options, pool.allocate))


def clear(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)


def raw_write(root: Path, bufs: list[memoryview]) -> float:
    t0 = time.perf_counter()
    for i, buf in enumerate(bufs):
        fd = os.open(root / f"raw{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, buf, 0)
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(root: Path, n: int, dest: memoryview, direct: bool = False) -> float:
    flags = os.O_RDONLY | (O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    for i in range(n):
        fd = os.open(root / f"raw{i}", flags)
        os.preadv(fd, [dest], 0)
        os.close(fd)
    return time.perf_counter() - t0


def tier_write(be: PosixBackend, objs, tag: str) -> float:
    keys = [key(i, tag) for i in range(len(objs))]
    t0 = time.perf_counter()
    be.batched_submit_put(keys=keys, objs=objs)
    assert be.flush(timeout=600)
    dt = time.perf_counter() - t0
    assert be.stats()["failed_puts"] == 0
    return dt


def tier_read(be: PosixBackend, n: int, tag: str) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        obj = be.get(key=key(i, tag))
        assert obj is not None
        obj.ref_down()
    return time.perf_counter() - t0


def bench_size(base: Path, mib: int, total: int, rounds: int, pool: HostMemoryPool) -> dict:
    layers, blocks = SIZES[mib]
    size = layers * blocks * PAGE
    n = max(4, total // size)
    objs = []
    for _ in range(n):
        obj = pool.allocate((layers, blocks, PAGE), torch.uint8, MemoryFormat.KV_PAGES, 256)
        obj.byte_view.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        objs.append(obj)
    bufs = [memoryview(o.byte_view.numpy()) for o in objs]
    dest_obj = pool.allocate((size,), torch.uint8, MemoryFormat.BINARY, 0)
    dest = memoryview(dest_obj.byte_view.numpy())
    res: dict[str, list[float]] = {}

    def rec(name: str, seconds: float) -> None:
        res.setdefault(name, []).append(n * size / seconds / GiB)

    raw_dir, tier_dir = base / "raw", base / "tier"
    for r in range(rounds):
        for threads in (1, 4):
            clear(raw_dir)
            clear(tier_dir)
            rec("raw write", raw_write(raw_dir, bufs))
            be = make_backend(tier_dir, pool, io_threads=threads)
            rec(f"tier write ({threads} thr)", tier_write(be, objs, f"r{r}"))
            if threads == 4:
                raw_read(raw_dir, n, dest)  # warm both
                tier_read(be, n, f"r{r}")
                rec("raw read (warm)", raw_read(raw_dir, n, dest))
                rec("tier read (warm)", tier_read(be, n, f"r{r}"))
                be.close()
                be = make_backend(tier_dir, pool, o_direct=True)
                if O_DIRECT and be.o_direct:
                    rec("raw read O_DIRECT", raw_read(raw_dir, n, dest, direct=True))
                    rec("tier read O_DIRECT", tier_read(be, n, f"r{r}"))
            be.close()
    for o in objs:
        o.ref_down()
    dest_obj.ref_down()
    clear(raw_dir)
    clear(tier_dir)
    return {k: max(v) for k, v in res.items()}


def bench_lookup(base: Path, pool: HostMemoryPool, files: int = 10_000, probes: int = 512) -> None:
    root = base / "lookup"
    clear(root)
    obj = pool.allocate((1, 1, 4096), torch.uint8, MemoryFormat.KV_PAGES, 16)
    header, bufs = cf.encode_chunk(key(0, "lookup"), obj)
    blob = header + b"".join(bytes(b) for b in bufs)  # contents are not read by contains
    for i in range(files):
        path = cf.chunk_path(root, key(i, "lookup"))
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(blob)
    obj.ref_down()
    t0 = time.perf_counter()
    be = make_backend(root, pool)
    assert be.wait_indexed(600), "startup scan hung"  # the scan runs in the background
    scan_s = time.perf_counter() - t0
    assert be.stats()["entries"] == files
    hits = [key(i * 19 % files, "lookup") for i in range(probes)]
    misses = [key(files + i, "lookup") for i in range(probes)]

    def timed(keys, pin: bool) -> float:
        times = []
        for _ in range(20):
            t = time.perf_counter()
            out = be.contains(keys=keys, pin=pin)
            times.append(time.perf_counter() - t)
            if pin:
                be.unpin(keys=keys)
        assert all(out) == (keys is hits)
        return statistics.median(times)

    print(f"\nlookup, {files} chunk files in {root} ({probes} keys per contains, median of 20)")
    print(f"  startup scan (index rebuild)   {scan_s * 1e3:8.1f} ms")
    print(f"  contains, all hits             {timed(hits, False) * 1e3:8.3f} ms")
    print(f"  contains, all misses (stat)    {timed(misses, False) * 1e3:8.3f} ms")
    print(f"  contains pin=True, all hits    {timed(hits, True) * 1e3:8.3f} ms")
    # A neighbour process wrote files this index has not seen: found by the stat fallback.
    fresh = [key(files + 10_000 + i, "lookup") for i in range(probes)]
    for k in fresh:
        cf.chunk_path(root, k).parent.mkdir(exist_ok=True)
        cf.chunk_path(root, k).write_bytes(blob)
    t = time.perf_counter()
    assert all(be.contains(keys=fresh, pin=False))
    print(f"  contains, hits not yet indexed {(time.perf_counter() - t) * 1e3:8.3f} ms")
    be.close()
    clear(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/kvplug-bench")
    ap.add_argument("--total", type=int, default=256, help="MiB of chunks per size and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--skip-lookup", action="store_true")
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    fs = os.popen(f"stat -f -c %T {base}").read().strip()
    print(f"directory {base} (file system: {fs}); {os.cpu_count()} CPUs; best of {args.rounds}")
    pool = HostMemoryPool((args.total + 64) * 2 << 20)
    for mib in (int(s) for s in args.sizes.split(",")):
        res = bench_size(base, mib, args.total << 20, args.rounds, pool)
        print(f"\n{mib} MiB chunks ({args.total} MiB per pass), GiB/s:")
        for name, value in res.items():
            base_name = {"tier write (1 thr)": "raw write", "tier write (4 thr)": "raw write",
                         "tier read (warm)": "raw read (warm)",
                         "tier read O_DIRECT": "raw read O_DIRECT"}.get(name)
            ratio = f"  {value / res[base_name]:.2f}x raw" if base_name else ""
            print(f"  {name:22s} {value:7.2f}{ratio}")
    if not args.skip_lookup:
        bench_lookup(base, pool)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
