"""What authenticating chunks costs: the MAC primitives on chunk-sized buffers, then a whole hit.

Part 1 (``--primitives``) times each candidate MAC over a 128 KiB and a 1.5 MiB buffer (one
layer of a small and of a large model's chunk) against xxh3_64, the unkeyed checksum kvplug
writes without a secret: keyed BLAKE2b (hashlib), HMAC-SHA256 (hashlib/OpenSSL), keyed BLAKE3
(``blake3``, one thread) and AES-GCM's GMAC (``cryptography``: an empty plaintext, the buffer as
associated data, a fresh per-chunk key as kvplug would need to use it). Median of ``--repeat``
runs, per call and GB/s.

Part 2 (``--hits``) stores the same random chunks in two StorageManagers, one without
``auth_key_env`` and one with it, and times in the same run: ``get`` from posix (page cache),
``batched_get`` from posix, and ``get`` after promotion into L1 (local_cpu). The ratio
authenticated / plain is the figure the issue bounds (<= 1.10x).

    .venv/bin/python benchmarks/bench_auth.py            # both parts
    .venv/bin/python benchmarks/bench_auth.py --primitives
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
    print(f"{'primitive':32s} {'128 KiB ms':>11s} {'GB/s':>7s} {'1.5 MiB ms':>11s} {'GB/s':>7s}")
    for name, fn in cands.items():
        row = []
        for size in (128 << 10, 3 << 19):
            data = os.urandom(size)
            s = _median_s(fn, data, repeat)
            row += [s * 1e3, size / s / 1e9]
        print(f"{name:32s} {row[0]:11.4f} {row[1]:7.2f} {row[2]:11.4f} {row[3]:7.2f}")


def _manager(root: str, auth: bool, layers: int, page: int):  # noqa: ANN202
    from kvplug.storage_manager import StorageManager

    cfg = {
        "chunk_size": 16,
        "tiers": [
            {"backend": "local_cpu", "name": "l1", "options": {"capacity": "512MiB"}},
            {"backend": "posix", "name": "disk",
             "options": {"path": root, "capacity": "4GiB"}},
        ],
    }
    if auth:
        cfg["auth_key_env"] = "KVPLUG_BENCH_AUTH_KEY"
    return StorageManager(cfg)


def hits(repeat: int, chunks: int, layers: int, page: int) -> None:
    import torch
    from kvplug.keys import CacheKey
    from kvplug.memory import MemoryFormat, heap_memory_obj

    os.environ["KVPLUG_BENCH_AUTH_KEY"] = os.urandom(32).hex()
    keys = [CacheKey("bench", "m", os.urandom(32)) for _ in range(chunks)]
    data = [torch.randint(0, 255, (layers, 1, page), dtype=torch.uint8) for _ in keys]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as auth_dir:
        sms = {"plain": _manager(plain_dir, False, layers, page),
               "auth": _manager(auth_dir, True, layers, page)}
        for sm in sms.values():
            objs = []
            for d in data:
                o = heap_memory_obj(tuple(d.shape), d.dtype, MemoryFormat.KV_PAGES, 16)
                o.tensor.copy_(d)
                objs.append(o)
            sm.backend("disk").batched_submit_put(keys=keys, objs=objs)
            for o in objs:
                o.ref_down()
            sm.flush(60)
        disk = {n: sm.backend("disk") for n, sm in sms.items()}
        for trial in range(repeat):
            for name in ("plain", "auth") if trial % 2 == 0 else ("auth", "plain"):
                b = disk[name]
                t0 = time.perf_counter()
                for k in keys:
                    b.get(key=k).ref_down()
                t1 = time.perf_counter()
                objs = sms[name].batched_get(keys, tiers=["disk"]) if _has_tiers_arg() else None
                if objs is None:
                    objs = [b.get(key=k) for k in keys]
                for o in objs:
                    o.ref_down()
                t2 = time.perf_counter()
                r = results.setdefault(name, {"posix get": [], "posix batched": []})
                r["posix get"].append((t1 - t0) / len(keys))
                r["posix batched"].append((t2 - t1) / len(keys))
        for name, sm in sms.items():  # promotion into L1, then L1 hits
            for k in keys:
                obj = sm.get(k)
                if obj is not None:
                    obj.ref_down()
        for trial in range(repeat):
            for name in ("plain", "auth") if trial % 2 == 0 else ("auth", "plain"):
                t0 = time.perf_counter()
                for k in keys:
                    sm_obj = sms[name].get(k)
                    sm_obj.ref_down()
                results[name].setdefault("manager get (L1 after promotion)", []).append(
                    (time.perf_counter() - t0) / len(keys))
        stats = {n: sm.stats()["disk"].get("auth_failures", 0) for n, sm in sms.items()}
        for sm in sms.values():
            sm.close()
    mib = layers * page / (1 << 20)
    print(f"\n{chunks} chunks of {layers} layers x {page} B ({mib:.2f} MiB), median of {repeat}")
    print(f"{'path':36s} {'plain ms':>9s} {'auth ms':>9s} {'ratio':>6s}")
    for path in results["plain"]:
        p = statistics.median(results["plain"][path]) * 1e3
        a = statistics.median(results["auth"][path]) * 1e3
        print(f"{path:36s} {p:9.3f} {a:9.3f} {a / p:6.2f}")
    print(f"auth_failures during the run: {stats}")


def _has_tiers_arg() -> bool:
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--primitives", action="store_true", help="only the primitives")
    ap.add_argument("--hits", action="store_true", help="only the StorageManager hits")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--chunks", type=int, default=32)
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
