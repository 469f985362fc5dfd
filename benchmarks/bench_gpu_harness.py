"""GPU figures for kvplug.gpu, on a KV cache built as vLLM 0.32 allocates it.

Transfers: store (gather, device -> pinned host) and load (scatter, pinned host -> device) of a
4k-token request of a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads, head 128, bf16, block
16: 64 KiB pages; FlashAttention's LBNHC order by default), bulk and layer-wise, for contiguous,
runs-of-4 and random block ids. Each row gives GB/s and the ratio against one pinned
``tensor.copy_(non_blocking=True)`` (a cudaMemcpyAsync) of the same bytes, timed alternately in
the same run. Goal: >= 0.9x and >= 40 GB/s each way. ``both``: a store of one request and a load of
another at once (the store and load streams), against a device-to-host and a host-to-device
memcpy of the same bytes on two streams; GB/s counts both directions.

Overlap: a forward pass of Llama-3-8B-shaped layers at 4k tokens (the matmuls of QKV, O, gate/up
and down projections; attention's own kernel left out, so the compute is if anything smaller than
the real one) alone, and with a layer-wise load of one request and a layer-wise store of another
around every layer (random block ids). Goal: <= 10% added time.

Run on a GPU: ``python3 -m benchmarks.bench_gpu_harness``. Without CUDA only ``--small`` (a
reduced shape, under a minute; its figures mean little) runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from kvplug.gpu import (  # noqa: E402
    PagedKV,
    PageJob,
    alloc_host,
    gather,
    gather_many,
    gather_many_async,
    layerwise_load,
    layerwise_store,
    scatter,
    scatter_many,
)

from benchmarks.bench_gpu_transfer import paired, row, timed
from tests.support.gpu_kv_fixture import vllm_kv_views
from tests.support.kv_harness import BLOCK_SIZE, HARNESS_LAYOUTS, scenarios


class Shape(NamedTuple):
    layers: int
    kv_heads: int
    head: int
    tokens: int
    hidden: int
    q_heads: int
    ffn: int


LLAMA3_8B = Shape(layers=32, kv_heads=8, head=128, tokens=4096, hidden=4096, q_heads=32, ffn=14336)
SMALL = Shape(layers=4, kv_heads=2, head=64, tokens=512, hidden=512, q_heads=8, ffn=1792)
DTYPE = torch.bfloat16


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    model = platform.processor() or "x86"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"CPU {model}, {os.cpu_count()} cores (torch {torch.__version__}), no pinned memory"


def build(s: Shape, layout: str, dev: torch.device) -> PagedKV:
    """A KV cache with room for four requests, as vLLM allocates it (one int8 buffer)."""
    blocks = 4 * s.tokens // BLOCK_SIZE
    heads = 1 if layout == "MLA" else s.kv_heads
    numel = s.layers * blocks * heads * BLOCK_SIZE * 2 * s.head * DTYPE.itemsize
    buf = torch.randint(-128, 128, (numel,), dtype=torch.int8, device=dev)
    views = vllm_kv_views(buf, layout, DTYPE, L=s.layers, B=blocks, H=heads, N=BLOCK_SIZE, C=2 * s.head)
    return PagedKV.from_kv_caches(views)


def drain(steps: Iterator[int]) -> None:
    for _ in steps:
        pass


def bench_transfers(kv: PagedKV, s: Shape, repeats: int, sync: Callable[[], None]) -> None:
    n = s.tokens // BLOCK_SIZE
    nbytes = kv.num_layers * n * kv.page_bytes
    cuda = kv.device.type == "cuda"
    out = alloc_host(kv, n)
    dev_flat = torch.ones(nbytes, dtype=torch.uint8, device=kv.device)
    host_flat = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)

    def d2h() -> None:
        host_flat.copy_(dev_flat, non_blocking=True)

    def h2d() -> None:
        dev_flat.copy_(host_flat, non_blocking=True)

    if cuda:
        both, both_base = bidirectional(kv, out, dev_flat, host_flat)
    print(f"transfers: {s.tokens} tokens = {n} blocks x {kv.num_layers} layers, page "
          f"{kv.page_bytes // 1024} KiB, {nbytes / 2**20:.0f} MiB each way; ratio = kvplug speed / "
          "one pinned copy_(non_blocking=True) of the same bytes (goal >= 0.9x, >= 40 GB/s)")
    for name, sc in scenarios(kv.num_blocks, n).items():
        ids = sc.store_ids
        rows = [
            (f"store  bulk       {name}", lambda ids=ids: gather(kv, ids, out), d2h),
            (f"store  layer-wise {name}", lambda ids=ids: drain(layerwise_store(kv, [(ids, out)])), d2h),
            (f"load   bulk       {name}", lambda ids=ids: scatter(kv, out, ids), h2d),
            (f"load   layer-wise {name}", lambda ids=ids: drain(layerwise_load(kv, [(ids, out)])), h2d),
        ]
        for label, fn, base in rows:
            print(row(label, nbytes, *paired(fn, base, repeats, sync)))
        if cuda:
            print(row(f"both   bulk       {name}", 2 * nbytes,
                      *paired(lambda sc=sc: both(sc), both_base, repeats, sync)))


def bidirectional(kv: PagedKV, out: torch.Tensor, dev_flat: torch.Tensor,
                  host_flat: torch.Tensor) -> tuple[Callable[..., None], Callable[[], None]]:
    """Store one request while loading another (kvplug's store and load streams), and the
    baseline: one device-to-host and one host-to-device memcpy of the same bytes on two streams."""
    src = alloc_host(kv, out.shape[1]).copy_(out)
    host2 = torch.empty_like(host_flat, pin_memory=True)
    dev2 = torch.empty_like(dev_flat)
    s1, s2 = torch.cuda.Stream(kv.device), torch.cuda.Stream(kv.device)

    def both(sc) -> None:
        ev = gather_many_async(kv, [(sc.store_ids, out)])
        scatter(kv, src, sc.dst_ids)
        ev.synchronize()

    def both_base() -> None:
        with torch.cuda.stream(s1):
            host_flat.copy_(dev_flat, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    return both, both_base


def forward_model(s: Shape, dev: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """One Llama-3-8B-shaped layer's matmuls at ``s.tokens`` tokens (QKV, O, gate/up, down;
    attention's own kernel left out), and the forward pass of every layer: the compute a
    layer-wise transfer overlaps with."""
    q, kvd = s.q_heads * s.head, s.kv_heads * s.head

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=dev, dtype=DTYPE) / rows**0.5

    x = torch.randn(s.tokens, s.hidden, device=dev, dtype=DTYPE)
    w_qkv, w_o = weight(s.hidden, q + 2 * kvd), weight(q, s.hidden)
    w_gu, w_down = weight(s.hidden, 2 * s.ffn), weight(s.ffn, s.hidden)

    def layer() -> None:
        h = (x @ w_qkv)[:, :q] @ w_o + x
        gu = h @ w_gu
        (torch.nn.functional.silu(gu[:, : s.ffn]) * gu[:, s.ffn :]) @ w_down

    def alone() -> None:
        for _ in range(s.layers):
            layer()

    return layer, alone


def bench_overlap(kv: PagedKV, s: Shape, repeats: int, sync: Callable[[], None]) -> None:
    dev, n = kv.device, s.tokens // BLOCK_SIZE
    sc = scenarios(kv.num_blocks, n, seed=1)["random"]
    src, out = alloc_host(kv, n), alloc_host(kv, n)
    gather(kv, sc.src_ids, src)
    q, kvd = s.q_heads * s.head, s.kv_heads * s.head
    layer, alone = forward_model(s, dev)

    def with_kv() -> None:
        load = layerwise_load(kv, [(sc.dst_ids, src)])
        store = layerwise_store(kv, [(sc.store_ids, out)])
        for _ in range(s.layers):
            next(load)  # layer i of the hit is in place for what follows on this stream
            layer()
            next(store)  # layer i of the new prefill goes out while layer i+1 computes
        load.close()

    def kv_only() -> None:
        drain(layerwise_load(kv, [(sc.dst_ids, src)]))
        drain(layerwise_store(kv, [(sc.store_ids, out)]))

    tw, tc = paired(with_kv, alone, repeats, sync)
    tk = timed(kv_only, repeats, sync)
    flops = 2 * s.tokens * s.layers * (s.hidden * (q + 2 * kvd) + q * s.hidden + 3 * s.hidden * s.ffn)
    print(f"overlap: {s.layers} layers x {s.tokens} tokens (hidden {s.hidden}, ffn {s.ffn}, "
          f"{flops / tc / 1e12:.1f} TFLOP/s alone), layer-wise load + store of {n} random blocks "
          f"per layer ({tk * 1e3:.2f} ms without compute)")
    print(f"overlap: compute alone {tc * 1e3:.2f} ms, with layer-wise load+store {tw * 1e3:.2f} ms, "
          f"added {(tw / tc - 1) * 100:+.1f}% (goal <= 10%)")


def chunk_objects(kv: PagedKV, n: int, chunk: int) -> list[torch.Tensor]:
    """Memory objects as L1's pool hands them to the connector: one contiguous
    ``[layers, chunk, page]`` object per chunk, all in one pinned host buffer."""
    pool = torch.empty((n // chunk, kv.num_layers, chunk, kv.page_bytes), dtype=torch.uint8,
                       pin_memory=kv.device.type == "cuda")
    return list(pool)


def bench_chunk_jobs(kv: PagedKV, s: Shape, repeats: int, sync: Callable[[], None],
                     chunk: int) -> None:
    """The connector's job shape: a request's transfer as one job per chunk of ``chunk`` blocks
    (32 jobs of 16 blocks for 4k tokens), each job its own memory object, bulk and layer-wise,
    against one pinned copy of the same bytes; then the layer-wise overlap with a load alone and
    with a load and a store (``wait=False``) in the same step, as the connector runs them."""
    n = s.tokens // BLOCK_SIZE
    nbytes = kv.num_layers * n * kv.page_bytes
    cuda = kv.device.type == "cuda"
    dev_flat = torch.ones(nbytes, dtype=torch.uint8, device=kv.device)
    host_flat = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    objs = chunk_objects(kv, n, chunk)

    def d2h() -> None:
        host_flat.copy_(dev_flat, non_blocking=True)

    def h2d() -> None:
        dev_flat.copy_(host_flat, non_blocking=True)

    def jobs(ids: list[int]) -> list[PageJob]:
        return [PageJob(ids[i * chunk:(i + 1) * chunk], o) for i, o in enumerate(objs)]

    print(f"chunk jobs: {n // chunk} jobs of {chunk} blocks ({nbytes / 2**20:.0f} MiB each way), "
          "each its own object (the connector's shape); ratio against one pinned copy_")
    for name, sc in scenarios(kv.num_blocks, n).items():
        store_jobs, load_jobs = jobs(sc.store_ids), jobs(sc.dst_ids)
        rows = [
            (f"store  bulk       {name}", lambda store_jobs=store_jobs: gather_many(kv, store_jobs), d2h),
            (f"store  layer-wise {name}", lambda store_jobs=store_jobs: drain(layerwise_store(kv, store_jobs)), d2h),
            (f"load   bulk       {name}", lambda load_jobs=load_jobs: scatter_many(kv, load_jobs), h2d),
            (f"load   layer-wise {name}", lambda load_jobs=load_jobs: drain(layerwise_load(kv, load_jobs)), h2d),
        ]
        for label, fn, base in rows:
            print(row(label, nbytes, *paired(fn, base, repeats, sync)))
    if not cuda:
        return
    sc = scenarios(kv.num_blocks, n, seed=1)["random"]
    load_jobs, store_jobs = jobs(sc.dst_ids), jobs(sc.store_ids)
    layer, alone = forward_model(s, kv.device)

    def load_only() -> None:
        load = layerwise_load(kv, load_jobs)
        for _ in range(s.layers):
            next(load)
            layer()
        load.close()

    def load_and_store() -> None:
        load = layerwise_load(kv, load_jobs)
        store = layerwise_store(kv, store_jobs, wait=False)
        for _ in range(s.layers):
            next(load)
            layer()
            next(store)
        load.close()
        drain(store)

    def host_in(fn: Callable[[], None]) -> float:
        """Host seconds inside the transfer calls of one step (compute launched, not awaited)."""
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        return t1 - t0

    tl, tc = paired(load_only, alone, repeats, sync)
    tb, tc2 = paired(load_and_store, alone, repeats, sync)
    print(f"chunk jobs overlap: compute alone {tc * 1e3:.2f} ms; with a layer-wise load of "
          f"{len(load_jobs)} chunk jobs {tl * 1e3:.2f} ms ({(tl / tc - 1) * 100:+.1f}%); with load "
          f"+ store (wait=False) {tb * 1e3:.2f} ms ({(tb / tc2 - 1) * 100:+.1f}%, goal <= 10%)")
    steps = [host_in(load_and_store) for _ in range(repeats)]
    launch = [host_in(alone) for _ in range(repeats)]
    step, bare = statistics.median(steps), statistics.median(launch)
    print(f"chunk jobs host time: a step's calls with load + store {step * 1e3:.2f} ms vs "
          f"compute launches alone {bare * 1e3:.2f} ms ({(step - bare) / s.layers * 1e6:.0f} µs "
          "per layer step, goal <= 100)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="reduced shape (CPU smoke run)")
    p.add_argument("--layout", default="LBNHC", choices=HARNESS_LAYOUTS)
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row (median)")
    p.add_argument("--chunk", type=int, default=16,
                   help="blocks per job in the chunk-jobs rows (the connector's: a chunk)")
    p.add_argument("--only", choices=("all", "one-job", "chunk-jobs"), default="all")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per request (default 4096; 8192 = 32 chunk jobs of 16 blocks)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        sys.exit("no CUDA device: the Llama-3-8B shape is for a GPU; run with --small on CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    s = SMALL if args.small else LLAMA3_8B
    if args.tokens:
        s = s._replace(tokens=args.tokens)
    repeats = args.repeats or (3 if args.small else 9)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"device: {device_name(dev)}")
    print(f"KV: {args.layout}, {s.layers} layers x {s.kv_heads} KV heads x head {s.head}, {DTYPE}, "
          f"block {BLOCK_SIZE}{' (--small)' if args.small else ' (Llama-3-8B)'}; median of {repeats}")
    kv = build(s, args.layout, dev)
    if args.only in ("all", "one-job"):
        bench_transfers(kv, s, repeats, sync)
        bench_overlap(kv, s, repeats, sync)
    if args.only in ("all", "chunk-jobs"):
        bench_chunk_jobs(kv, s, repeats, sync, args.chunk)


if __name__ == "__main__":
    main()
