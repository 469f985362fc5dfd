"""What encryption at rest (``encrypt: true``) costs: the AES-256-GCM primitive, then whole hits.

Part 1 (``--primitives``) times, per 128 KiB (one layer of a small model's chunk; LMCache quotes
0.024 ms per 128 KiB for its AES-GCM) and per 1.5 MiB: kvplug's write (``AESGCM.encrypt_into``
into the ciphertext buffer) and read (``ChunkCipher.verify_layer``: the layer decrypted in place,
its tag checked, what every tier's ``verify_layers`` does; timed with the copy that restores the
ciphertext, which is also timed alone), beside the authenticated chunk's GMAC and
the plain chunk's xxh3_64. Median of ``--repeat`` runs.

Part 2 (``--hits``) stores the same random chunks through three StorageManagers per tier — plain
(no secret), authenticated (``auth_key_env``), encrypted (``encrypt: true``) — on posix (one
directory each, page cache) and resp (one redis-server, a prefix each), then times in the same
run, interleaved (the order rotating every trial): a whole-chunk ``get`` and a ``batched_get``
of all chunks. The figure is encrypted / plain (goal <= 1.25x), medians of wall and CPU time.

    .venv/bin/python -m benchmarks.bench_encrypt                  # both parts
    .venv/bin/python -m benchmarks.bench_encrypt --primitives
    .venv/bin/python -m benchmarks.bench_encrypt --hits --tiers posix --layers 32 --page 8192
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

MODES = ("plain", "auth", "encrypt")
_ENV = "BENCH_ENCRYPT_SECRET"


def _median_s(fn, repeat: int, nbytes: int) -> float:  # noqa: ANN001
    inner = max(1, int(4e6 // max(nbytes, 1)))
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t0) / inner)
    return statistics.median(runs)


def _candidates(size: int) -> dict:
    """The primitives over one ``size``-byte buffer (fresh keys), by name. kvplug's read is
    :class:`~kvplug.chunkfile.crypt.ChunkCipher`'s own ``verify_layer`` (decrypt in place, tag
    checked), timed with the copy that puts the ciphertext back before each run; that copy is
    timed alone too, to subtract."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from kvplug import chunkfile as cf
    from kvplug.keys import CacheKey
    from kvplug.memory import MemoryFormat, heap_memory_obj

    ring = cf.Keyring(os.urandom(32), encrypt=True)
    obj = heap_memory_obj((1, 1, size), fmt=MemoryFormat.KV_PAGES, num_tokens=16)
    obj.byte_view.copy_(torch_random(size))
    header, bufs, head = cf.encode_chunk_with_header(
        CacheKey("bench/model", "bfloat16", "LBHNC-bs16", 1, 0, os.urandom(32)), obj, ring)
    ciphertext = bytes(bufs[0])
    work = memoryview(bytearray(size))

    def restore() -> None:
        work[:] = ciphertext

    def read() -> None:
        work[:] = ciphertext
        assert head.mac.verify_layer(0, work, head.checksums[0])

    key, nonce = os.urandom(32), os.urandom(12)
    aead = AESGCM(key)
    view = memoryview(np.frombuffer(bytearray(os.urandom(size)), dtype=np.uint8))
    out = bytearray(size + 16)
    return {
        "AES-256-GCM encrypt_into (kvplug's write)": lambda: aead.encrypt_into(
            nonce, view, None, out),
        "copy of the ciphertext (subtract below)": restore,
        "copy + kvplug's decrypt in place (verify_layer)": read,
        "AES-256-GMAC tag (auth_key_env, no encrypt)": lambda: aead.encrypt(nonce, b"", view),
        "xxh3_64 (plain chunks)": lambda: xxhash.xxh3_64_digest(view),
    }


def torch_random(n: int):  # noqa: ANN201 - a uint8 tensor
    import torch

    return torch.randint(0, 256, (n,), dtype=torch.uint8)


def primitives(repeat: int) -> None:
    print(f"{'primitive':48s} {'128 KiB ms':>11s} {'GB/s':>6s} {'1.5 MiB ms':>11s} {'GB/s':>6s}")
    rows: dict[str, list[str]] = {}
    for size in (128 << 10, 3 << 19):
        for name, fn in _candidates(size).items():
            s = _median_s(fn, repeat, size)
            rows.setdefault(name, []).append(f"{s * 1e3:11.4f} {size / s / 1e9:6.2f}")
    for name, cols in rows.items():
        print(f"{name:48s} {' '.join(cols)}")
    print("LMCache's AES-GCM (its docs): 0.024 ms per 128 KiB")


def _config(mode: str, tier: dict) -> dict:
    cfg: dict = {"chunk_size": 16, "tiers": [tier]}
    if mode != "plain":
        cfg["auth_key_env"] = _ENV
    if mode == "encrypt":
        cfg["encrypt"] = True
    return cfg


def _timed(fn, keys) -> tuple[float, float]:  # noqa: ANN001
    """Wall and CPU (process) seconds per chunk of ``fn(keys)`` (all hits, released)."""
    c0, t0 = time.process_time(), time.perf_counter()
    objs = fn(keys)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert all(o is not None for o in objs), "a miss in a hit benchmark"
    for o in objs:
        o.ref_down()
    return dt / len(keys), dc / len(keys)


def hits(tiers: list[str], repeat: int, chunks: int, layers: int, page: int) -> None:
    import torch
    from kvplug.keys import CacheKey
    from kvplug.memory import MemoryFormat, heap_memory_obj
    from kvplug.storage_manager import StorageManager

    os.environ[_ENV] = os.urandom(32).hex()
    keys = [CacheKey("bench/model", "bfloat16", "LBHNC-bs16", 1, 0, os.urandom(32),
                     tenant=f"{i % 4:016x}") for i in range(chunks)]
    mib = layers * page / (1 << 20)
    print(f"\n{chunks} chunks of {layers} layers x {page} B ({mib:.2f} MiB each), 4 tenants, "
          f"median of {repeat} interleaved trials, ms per chunk")
    with tempfile.TemporaryDirectory() as work:
        for name in tiers:
            srv = None
            if name == "posix":
                tier_of = {m: {"backend": "posix", "options": {
                    "path": str(Path(work) / m), "capacity": "8GiB", "io_threads": 2}}
                    for m in MODES}
            else:
                from tests.support.redis_server import RedisServer

                srv = RedisServer(Path(work) / "redis", maxmemory="3gb")
                tier_of = {m: {"backend": "resp", "timeout_s": 60.0, "options": {
                    "url": srv.url, "prefix": f"bench-{m}:", "timeout_s": 30.0}} for m in MODES}
            managers = {m: StorageManager(_config(m, tier_of[m])) for m in MODES}
            try:
                for sm in managers.values():
                    for i, k in enumerate(keys):
                        obj = heap_memory_obj((layers, 1, page), torch.uint8,
                                              MemoryFormat.KV_PAGES, 16)
                        gen = torch.Generator().manual_seed(i)
                        obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,),
                                                          dtype=torch.uint8, generator=gen))
                        sm.batched_put([k], [obj])
                        obj.ref_down()
                    assert sm.flush(120)
                def each(sm, ks):  # noqa: ANN001, ANN202
                    return [sm.get(k, promote=False) for k in ks]

                paths = {f"{name} get": each,
                         f"{name} batched_get": lambda sm, ks: sm.batched_get(ks)}
                for _ in range(2):  # warm the page cache, the header caches, the connections
                    for sm in managers.values():
                        _timed(lambda ks, sm=sm: each(sm, ks), keys)
                results: dict[str, dict[str, list[tuple[float, float]]]] = {}
                for trial in range(repeat):
                    order = MODES[trial % 3:] + MODES[: trial % 3]
                    for path, fn in paths.items():
                        for m in order:
                            results.setdefault(path, {}).setdefault(m, []).append(
                                _timed(lambda ks, fn=fn, sm=managers[m]: fn(sm, ks), keys))
                failures = {m: sm.stats()[name].get("auth_failures", 0)
                            for m, sm in managers.items()}
            finally:
                for sm in managers.values():
                    sm.close()
                if srv is not None:
                    srv.stop()
            print(f"{'path':18s} {'wall plain':>10s} {'auth':>7s} {'encrypt':>8s} "
                  f"{'enc/plain':>9s} {'enc/auth':>8s}   {'cpu plain':>9s} {'auth':>7s} "
                  f"{'encrypt':>8s} {'enc/plain':>9s}")
            for path, by_mode in results.items():
                wall = {m: statistics.median(r[0] for r in by_mode[m]) * 1e3 for m in MODES}
                cpu = {m: statistics.median(r[1] for r in by_mode[m]) * 1e3 for m in MODES}
                print(f"{path:18s} {wall['plain']:10.3f} {wall['auth']:7.3f} "
                      f"{wall['encrypt']:8.3f} {wall['encrypt'] / wall['plain']:9.2f} "
                      f"{wall['encrypt'] / wall['auth']:8.2f}   {cpu['plain']:9.3f} "
                      f"{cpu['auth']:7.3f} {cpu['encrypt']:8.3f} "
                      f"{cpu['encrypt'] / cpu['plain']:9.2f}")
            print(f"auth_failures during the run: {failures}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--primitives", action="store_true", help="only the primitives")
    ap.add_argument("--hits", action="store_true", help="only the StorageManager hits")
    ap.add_argument("--tiers", default="posix,resp", help="comma-separated: posix, resp")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=128 << 10, help="bytes per layer of a chunk")
    args = ap.parse_args()
    both = not (args.primitives or args.hits)
    if args.primitives or both:
        primitives(args.repeat)
    if args.hits or both:
        hits(args.tiers.split(","), args.repeat, args.chunks, args.layers, args.page)


if __name__ == "__main__":
    main()
