"""What authenticating chunks costs: the MAC primitives on chunk-sized buffers, then a whole hit.

Part 1 (``--primitives``) times each candidate MAC over a 128 KiB and a 1.5 MiB buffer (one
layer of a small and of a large model's chunk; in cache) and a 64 MiB one (memory-bound) against
xxh3_64, the unkeyed checksum kvplug
writes without a secret: keyed BLAKE2b (hashlib), HMAC-SHA256 (hashlib/OpenSSL), keyed BLAKE3
(``blake3``, one thread) and AES-GCM's GMAC (``cryptography``: an empty plaintext, the buffer as
associated data, a fresh per-chunk key as kvplug would need to use it). Median of ``--repeat``
runs, per call and GB/s.

Part 2 (``--hits``) stores the same random chunks in two posix directories, one without
``auth_key_env`` and one with it, and times in the same run, alternating: ``get`` and
``batched_get`` from posix (page cache), ``get`` through an L1 in front (posix read, verified,
promoted into local_cpu) and the L1 hit after. The ratio authenticated / plain is the figure the
issue bounds (<= 1.10x).

    .venv/bin/python -m benchmarks.bench_auth            # both parts
    .venv/bin/python -m benchmarks.bench_auth --primitives
    .venv/bin/python -m benchmarks.bench_auth --hits --layers 8 --page 1572864 --chunks 8
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import tempfile
import time

import xxhash

KEY = os.urandom(32)


def _median_s(fn, data, repeat: int) -> float:  # noqa: ANN001
    inner = max(1, int(2e6 // max(len(data), 1)))
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn(data)
        runs.append((time.perf_counter() - t0) / inner)
    return statistics.median(runs)


def primitives(repeat: int) -> None:
    import blake3
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = bytes(12)

    def gmac(data):  # noqa: ANN001 - a per-chunk key, as a GMAC with a fixed nonce needs
        return AESGCM(KEY).encrypt(nonce, b"", data)

    cands = {
        "xxh3_64 (unkeyed, today)": lambda d: xxhash.xxh3_64_digest(d),
        "blake2b keyed (hashlib)": lambda d: hashlib.blake2b(d, key=KEY, digest_size=16).digest(),
        "hmac-sha256 (hashlib)": lambda d: hmac.digest(KEY, d, "sha256"),
        "blake3 keyed (1 thread)": lambda d: blake3.blake3(d, key=KEY).digest(),
        "blake3 keyed (auto threads)": lambda d: blake3.blake3(
            d, key=KEY, max_threads=blake3.blake3.AUTO).digest(),
        "aes-gcm gmac (cryptography)": gmac,
    }
    sizes = (128 << 10, 3 << 19, 64 << 20)  # a layer of a small / large model, out of cache
    print(f"{'primitive':30s} " + " ".join(f"{_label(n) + ' ms':>12s} {'GB/s':>6s}"
                                          for n in sizes))
    buffers = {n: os.urandom(n) for n in sizes}
    for name, fn in cands.items():
        row = []
        for size in sizes:
            s = _median_s(fn, buffers[size], repeat)
            row.append(f"{s * 1e3:12.4f} {size / s / 1e9:6.2f}")
        print(f"{name:30s} " + " ".join(row))


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 2 << 20 else f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 \
        else f"{n >> 10} KiB"


def _manager(root: str, auth: bool, l1: bool):  # noqa: ANN202 - StorageManager
    from kvplug.storage_manager import StorageManager

    tiers = [{"backend": "posix", "name": "disk",
              "options": {"path": root, "capacity": "8GiB", "io_threads": 2}}]
    if l1:
        tiers.insert(0, {"backend": "local_cpu", "name": "l1", "options": {"capacity": "2GiB"}})
    cfg: dict = {"chunk_size": 16, "tiers": tiers}
    if auth:
        cfg["auth_key_env"] = _ENV
    return StorageManager(cfg)


_ENV = "BENCH_AUTH_SECRET"


def _timed(fn, keys) -> tuple[float, float]:  # noqa: ANN001
    """Wall and CPU (process, all threads) seconds per chunk of ``fn(keys)`` (which returns the
    objects it got, all hits). CPU time is the steadier figure on a shared machine."""
    c0, t0 = time.process_time(), time.perf_counter()
    objs = fn(keys)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert all(o is not None for o in objs), "a miss in a hit benchmark"
    for o in objs:
        o.ref_down()
    return dt / len(keys), dc / len(keys)


def hits(repeat: int, chunks: int, layers: int, page: int) -> None:
    """Plain and authenticated StorageManagers over the same random chunks, timed alternately
    in one run: whole-chunk ``get`` and ``batched_get`` from posix (page cache), the first
    ``get`` through an L1 in front (read from posix, verified, promoted) and the L1 hit after."""
    import torch
    from kvplug.keys import CacheKey
    from kvplug.memory import MemoryFormat, heap_memory_obj

    os.environ[_ENV] = os.urandom(32).hex()
    keys = [CacheKey("bench/model", "bfloat16", "LBHNC-bs16", 1, 0, os.urandom(32))
            for _ in range(chunks)]
    results: dict[str, dict[str, list[tuple[float, float]]]] = {"plain": {}, "auth": {}}
    with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as auth_dir:
        dirs = {"plain": plain_dir, "auth": auth_dir}
        disk = {n: _manager(d, n == "auth", l1=False) for n, d in dirs.items()}
        for sm in disk.values():
            for i, k in enumerate(keys):
                obj = heap_memory_obj((layers, 1, page), torch.uint8, MemoryFormat.KV_PAGES, 16)
                obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8,
                                                  generator=torch.Generator().manual_seed(i)))
                sm.batched_put([k], [obj])
                obj.ref_down()
            assert sm.flush(120)
        front = {n: _manager(d, n == "auth", l1=True) for n, d in dirs.items()}
        paths = {
            "posix get": lambda n, ks: [disk[n].get(k, promote=False) for k in ks],
            "posix batched_get": lambda n, ks: disk[n].batched_get(ks),
            "get via L1 (posix read + promotion)": lambda n, ks: [front[n].get(k) for k in ks],
            "L1 hit after promotion": lambda n, ks: [front[n].get(k) for k in ks],
        }
        for _ in range(2):  # warm the page cache and the header caches
            for n in dirs:
                _timed(lambda ks, n=n: paths["posix get"](n, ks), keys)
        for trial in range(repeat):
            order = ("plain", "auth") if trial % 2 == 0 else ("auth", "plain")
            for path, fn in paths.items():
                for n in order:
                    if path.startswith("get via L1"):
                        front[n].evict(keys, tiers=["l1"])
                    results[n].setdefault(path, []).append(
                        _timed(lambda ks, fn=fn, n=n: fn(n, ks), keys))
        failures = {n: sm.stats()["disk"].get("auth_failures", 0) for n, sm in disk.items()}
        for sm in [*disk.values(), *front.values()]:
            sm.close()
    mib = layers * page / (1 << 20)
    print(f"\n{chunks} chunks of {layers} layers x {page} B ({mib:.2f} MiB each), median of "
          f"{repeat} alternating trials (ms per chunk)")
    print(f"{'path':38s} {'median wall plain/auth ms':>26s} {'ratio':>6s}  {'min wall':>17s} "
          f"{'ratio':>6s}  {'median cpu':>17s} {'ratio':>6s}")
    for path in results["plain"]:
        cols = []
        for pick, i in ((statistics.median, 0), (min, 0), (statistics.median, 1)):
            p = pick(r[i] for r in results["plain"][path]) * 1e3
            a = pick(r[i] for r in results["auth"][path]) * 1e3
            cols.append(f"{p:8.3f} {a:8.3f} {a / p:6.2f}")
        print(f"{path:38s} {cols[0]:>33s}  {cols[1]:>24s}  {cols[2]:>24s}")
    print(f"auth_failures during the run: {failures}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--primitives", action="store_true", help="only the primitives")
    ap.add_argument("--hits", action="store_true", help="only the StorageManager hits")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=128 << 10, help="bytes per layer of a chunk")
    args = ap.parse_args()
    both = not (args.primitives or args.hits)
    if args.primitives or both:
        primitives(args.repeat)
    if args.hits or both:
        hits(args.repeat, args.chunks, args.layers, args.page)


if __name__ == "__main__":
    main()
