"""Page transfer throughput of kvplug.gpu against a plain contiguous copy of the same bytes.

CPU (always): a 4k-token request of a 24-layer model (8 KV heads, head 128, K+V, bf16, block 128,
LBHNC as vLLM's CPU backend lays it out) is gathered into a memory object and scattered back, for
three block-id patterns. Each figure is GB/s (median of ``--repeats``) and its ratio against one
contiguous ``copy_`` of the same byte count measured in the same run. The naive torch calls
(per-layer ``index_select`` / ``index_copy_``) are shown for comparison.

CUDA (only where a CUDA device exists, LBNHC as FlashAttention lays it out): gather/scatter
between device pages and pinned host memory as a ratio of one pinned ``cudaMemcpy`` of the same
bytes, and the overlap of a layer-wise load with a stand-in per-layer compute kernel.

Run: ``.venv/bin/python -m benchmarks.bench_gpu_transfer``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from kvplug.gpu import PagedKV, alloc_host, gather, layerwise_load, scatter

LAYERS, HEADS, HEAD, BLOCK = 24, 8, 128, 128
DTYPE = torch.bfloat16


def build(num_blocks: int, device: str, layout: str) -> PagedKV:
    """vLLM-like KV cache: one int8 buffer, one [B, H, N, 2*head] view per layer."""
    esize = torch.empty(0, dtype=DTYPE).element_size()
    page = HEADS * BLOCK * 2 * HEAD * esize
    buf = torch.empty(LAYERS * num_blocks * page, dtype=torch.int8, device=device)
    buf.view(torch.uint8).fill_(1)
    caches = {}
    for layer in range(LAYERS):
        raw = buf[layer * num_blocks * page : (layer + 1) * num_blocks * page].view(DTYPE)
        if layout == "LBNHC":
            t = raw.view(num_blocks, BLOCK, HEADS, 2 * HEAD).permute(0, 2, 1, 3)
        else:
            t = raw.view(num_blocks, HEADS, BLOCK, 2 * HEAD)
        caches[f"layers.{layer}"] = t
    return PagedKV.from_kv_caches(caches)


def patterns(n: int, num_blocks: int, seed: int = 0) -> dict[str, list[int]]:
    """Block-id patterns for an n-block request: contiguous, runs of 4 shuffled, fully random."""
    rng = random.Random(seed)
    starts = rng.sample(range(0, num_blocks // 4), n // 4)
    frag = [4 * s + i for s in starts for i in range(4)]
    rand = rng.sample(range(num_blocks), n)
    return {"contiguous": list(range(8, 8 + n)), "runs of 4": frag, "random": rand}


def timed(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(
    fn: Callable[[], None], base: Callable[[], None], repeats: int, sync: Callable[[], None]
) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``base``, run alternately so both see the same load."""
    fn()
    base()
    sync()
    tf, tb = [], []
    for _ in range(repeats):
        for f, acc in ((fn, tf), (base, tb)):
            t0 = time.perf_counter()
            f()
            sync()
            acc.append(time.perf_counter() - t0)
    return statistics.median(tf), statistics.median(tb)


def row(name: str, nbytes: int, seconds: float, base: float) -> str:
    gbs = nbytes / seconds / 1e9
    return f"{name:<36} {gbs:7.2f} GB/s  baseline {nbytes / base / 1e9:6.2f} GB/s  {base / seconds:5.2f}x"


def bench_cpu(tokens: int, num_blocks: int, repeats: int) -> None:
    kv = build(num_blocks, "cpu", "LBHNC")
    n = tokens // BLOCK
    nbytes = kv.num_layers * n * kv.page_bytes
    out = alloc_host(kv, n).fill_(3)
    src = torch.full((nbytes,), 5, dtype=torch.uint8)
    dst = torch.full((nbytes,), 6, dtype=torch.uint8)

    def nosync() -> None:
        return None

    def copy() -> None:
        dst.copy_(src)

    print(f"CPU, LBHNC {LAYERS} layers x {HEADS} heads x head {HEAD} x block {BLOCK}, {DTYPE}; "
          f"{tokens} tokens = {n} blocks, page {kv.page_bytes} B, {nbytes / 2**20:.0f} MiB moved, "
          f"torch threads {torch.get_num_threads()}; baseline = one contiguous copy_ of the "
          "same bytes, timed alternately with each row")
    for name, ids in patterns(n, num_blocks).items():
        idx = torch.tensor(ids)
        print(row(f"gather   {name}", nbytes, *paired(
            lambda ids=ids: gather(kv, ids, out), copy, repeats, nosync)))
        print(row(f"scatter  {name}", nbytes, *paired(
            lambda ids=ids: scatter(kv, out, ids), copy, repeats, nosync)))
        if name == "random":
            def naive_g(idx: torch.Tensor = idx) -> None:
                for layer, v in enumerate(kv.views):
                    torch.index_select(v, 0, idx, out=out[layer])

            def naive_s(idx: torch.Tensor = idx) -> None:
                for layer, v in enumerate(kv.views):
                    v.index_copy_(0, idx, out[layer])

            print(row(f"  naive index_select {name}", nbytes,
                      *paired(naive_g, copy, repeats, nosync)))
            print(row(f"  naive index_copy_ {name}", nbytes, *paired(naive_s, copy, 2, nosync)))


def bench_cuda(tokens: int, num_blocks: int, repeats: int) -> None:
    kv = build(num_blocks, "cuda", "LBNHC")
    n = tokens // BLOCK
    nbytes = kv.num_layers * n * kv.page_bytes
    out = alloc_host(kv, n)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    sync = torch.cuda.synchronize
    def d2h() -> None:
        host.copy_(dev, non_blocking=True)

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)

    print(f"\nCUDA ({torch.cuda.get_device_name()}), LBNHC, {tokens} tokens, "
          f"{nbytes / 2**20:.0f} MiB, pinned host memory; baseline = one pinned cudaMemcpy")
    for name, ids in patterns(n, num_blocks).items():
        print(row(f"store (gather) {name}", nbytes, *paired(
            lambda ids=ids: gather(kv, ids, out), d2h, repeats, sync)))
        print(row(f"retrieve (scatter) {name}", nbytes, *paired(
            lambda ids=ids: scatter(kv, out, ids), h2d, repeats, sync)))

    # overlap: a stand-in per-layer kernel, alone and interleaved with a layer-wise load
    ids = patterns(n, num_blocks)["random"]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def compute_layer() -> None:
        for _ in range(4):
            a @ a

    def compute_only() -> None:
        for _ in range(kv.num_layers):
            compute_layer()

    def with_load() -> None:
        for _ in layerwise_load(kv, [(ids, out)]):
            compute_layer()

    c = timed(compute_only, repeats, sync)
    w = timed(with_load, repeats, sync)
    print(f"overlap: compute alone {c * 1e3:.2f} ms, with layer-wise load {w * 1e3:.2f} ms, "
          f"+{(w / c - 1) * 100:.1f}% (goal < 10%)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--num-blocks", type=int, default=96, help="blocks in the KV cache")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    bench_cpu(args.tokens, args.num_blocks, args.repeats)
    if torch.cuda.is_available():
        bench_cuda(args.tokens, args.num_blocks, args.repeats)
    else:
        print("\nCUDA: skipped (torch.cuda.is_available() is False: no CUDA device here)")


if __name__ == "__main__":
    main()
