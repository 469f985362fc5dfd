"""StorageManager overheads with only local_cpu, prefix lookup, and hashing vs vLLM.

Run: .venv/bin/python -m benchmarks.bench_storage_manager
Prints: µs of put+get per chunk beyond moving bytes (L1 is zero-copy, so this is all overhead),
with a plain dict put+get as the baseline measured in the same run; the time of a 512-key prefix
lookup; and tokens/s of kvplug's TokenDatabase against vLLM's own block hasher (ratio).
"""

from __future__ import annotations

import random
import time

from kvplug.keys import CacheKey
from kvplug.storage_manager import StorageManager
from kvplug.tokens import TokenDatabase


def best_of(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    n = 2000
    shape = (24, 2, 1024)  # L1 never copies, so overhead does not depend on the chunk size
    mgr = StorageManager({"tiers": [{"backend": "local_cpu", "options": {"capacity": "256MiB"}}]})
    hashes = TokenDatabase(16).chunk_hashes(list(range(16 * n)))
    keys = [CacheKey("bench/model", "bfloat16", "LBHNC-bs128", 1, 0, h) for h in hashes]
    obj = mgr.allocate(shape)
    assert obj is not None

    def put_get_manager() -> None:
        for k in keys:
            mgr.batched_put([k], [obj])
            got = mgr.get(k)
            got.ref_down()
        mgr.evict(keys)

    store: dict = {}

    def put_get_dict() -> None:
        for k in keys:
            store[k] = obj.ref_up()
            store[k].ref_up()
            store[k].ref_down()
        for k in keys:
            store.pop(k).ref_down()

    t_mgr = best_of(put_get_manager) / n * 1e6
    t_dict = best_of(put_get_dict) / n * 1e6
    mgr.batched_put([keys[0]], [obj])
    hit = mgr.get(keys[0])
    zero_copy = hit.tensor.data_ptr() == obj.tensor.data_ptr()
    hit.ref_down()
    print(f"put+get per chunk via StorageManager(local_cpu): {t_mgr:.2f} us "
          f"(dict baseline {t_dict:.2f} us; overhead {t_mgr - t_dict:.2f} us; goal < 20 us)")
    print(f"L1 hit is zero-copy: {zero_copy}")

    prompt = TokenDatabase(256).chunk_hashes(list(range(256 * 512)))
    pkeys = [CacheKey("bench/model", "bfloat16", "LBHNC-bs128", 1, 0, h) for h in prompt]
    for k in pkeys:
        mgr.batched_put([k], [obj])
    t_lookup = best_of(lambda: mgr.lookup_prefix(pkeys), repeat=20) * 1e3
    t_pin = best_of(lambda: mgr.unpin(pkeys, mgr.lookup_prefix(pkeys, pin=True).tiers), 20) * 1e3
    print(f"prefix lookup of 512 keys (128k tokens): {t_lookup:.3f} ms "
          f"(with pin+unpin {t_pin:.3f} ms; goal < 1 ms)")
    obj.ref_down()
    mgr.close()

    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(128 * 1024)]
    token_db = TokenDatabase(256)
    t_ours = best_of(lambda: token_db.chunk_hashes(tokens), repeat=5)
    try:
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils as kcu

        kcu.init_none_hash(sha256_cbor)

        def vllm_hash() -> None:
            parent = None
            for s in range(0, len(tokens), 256):
                parent = kcu.hash_block_tokens(sha256_cbor, parent, tokens[s:s + 256])

        t_vllm = best_of(vllm_hash, repeat=5)
        ratio = f"{t_vllm / t_ours:.2f}x vLLM's hasher ({len(tokens) / t_vllm / 1e6:.2f} M tok/s)"
    except ImportError:
        ratio = "vLLM not installed: no baseline"
    print(f"hashing 128k tokens, chunk 256: {len(tokens) / t_ours / 1e6:.2f} M tok/s = {ratio}")


if __name__ == "__main__":
    main()
