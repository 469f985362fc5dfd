"""Host time of kvplug.gpu per layer step and per bulk call, for 1, 16 and 32 chunk jobs.

The jobs are the connector's: one ``PageJob`` per chunk of 16 blocks, each memory object allocated
from L1's host pool (``HostMemoryPool``), as ``Stores.prepare`` and ``Loads`` build them. The KV
cache is Llama-3-8B's layer count (32) in vLLM 0.32's layout (one int8 buffer, LBHNC per-layer
views, bf16, block 16), with tiny pages (64 B: one KV head of size 1) so that host overhead, not
the bytes, dominates even at 32 jobs, and the real pages (64 KiB: 8 KV heads of 128), where the
bytes dominate; ``--pages`` adds 256 B and 4 KiB. Block ids: each chunk a run of 16 adjacent
blocks (``contiguous``) or 16 random ones (``random``).

Per case, µs of host time (medians over ``--rounds``; CPU tensors, so every copy runs on the
host): ``step``: a layer-wise generator's ``next()`` (the layer's copies), the mean over the 32
layers; ``call+steps``: the call that builds the generator plus all its steps, per layer
(``layerwise_store(wait=False)``, as asynchronous saves call it); and the bulk calls
``gather_many_async`` / ``scatter_many``. ``--device cuda`` (a GPU machine: KV on the device,
objects in a pinned pool) measures the host time of the same calls with their copies left
queued (but ``scatter_many``, which waits for its copies); the device is synchronised between
calls. ``before`` runs the same calls on the gpu/ package of ``--before`` (the per-job code
path, imported from git in this run, its own ``PagedKV`` over the same buffer), the rounds
alternating the two. Goal (issue: host work independent of the number of jobs): on CPU, a layer
step with 32 jobs at most 3x a step with one job; on a GPU, at most 100 µs with 32 jobs.

    .venv/bin/python -m benchmarks.bench_host_cost [--pages 64,256,4096,65536] [--rounds 40]
    python3 -m benchmarks.bench_host_cost --device cuda      # by scripts/gpu_check.sh
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import torch
from kvplug import gpu
from kvplug.pool import HostMemoryPool

from tests.support.gpu_kv_fixture import vllm_kv_views

#: the last commit whose gpu/ moved pages job by job
BEFORE = "9f4118b"
LAYERS, BLOCK, CHUNK_BLOCKS = 32, 16, 16
JOB_COUNTS = (1, 16, 32)
#: page bytes -> (KV heads, K+V elements per head), bf16, block 16
PAGES = {64: (1, 2), 256: (1, 8), 4096: (1, 128), 65536: (8, 256)}
ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def gpu_at(before: str) -> ModuleType:
    """gpu/ as it was at git revision ``before`` (or the gpu/ files in the folder ``before``, for
    a machine without the repository's history), imported as its own package, so that the same
    run measures both."""
    where = Path(before)
    if not where.is_dir():
        names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", before, "gpu/"],
                               check=True, capture_output=True, text=True).stdout.split()
        where = Path(tempfile.mkdtemp(prefix="kvplug-gpu-"))
        for name in names:
            blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{before}:{name}"],
                                  check=True, capture_output=True).stdout
            (where / Path(name).name).write_bytes(blob)
    spec = importlib.util.spec_from_file_location(
        "kvplug_gpu_before", where / "__init__.py", submodule_search_locations=[str(where)])
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Case:
    """One KV cache, seen by each implementation, and the jobs of 1, 16 and 32 chunks."""

    def __init__(self, heads: int, width: int, pattern: str, impls: dict[str, ModuleType],
                 device: str) -> None:
        num_blocks = 1 + CHUNK_BLOCKS * max(JOB_COUNTS) + 8
        page = heads * BLOCK * width * 2
        buf = torch.randint(-128, 128, (LAYERS * num_blocks * page,), dtype=torch.int8,
                            device=device)
        views = vllm_kv_views(buf, "LBHNC", torch.bfloat16, L=LAYERS, B=num_blocks, H=heads,
                              N=BLOCK, C=width)
        self.kv = {name: m.PagedKV.from_kv_caches(views) for name, m in impls.items()}
        self.page = page
        blocks = list(range(1, num_blocks))
        if pattern == "random":
            random.Random(0).shuffle(blocks)
        n = max(JOB_COUNTS)
        self.ids = [blocks[j * CHUNK_BLOCKS:(j + 1) * CHUNK_BLOCKS] for j in range(n)]
        self.pool = HostMemoryPool(n * LAYERS * CHUNK_BLOCKS * page + (1 << 20),
                                   pin_memory=device == "cuda", prefault=False)
        self.objs = [self.pool.allocate((LAYERS, CHUNK_BLOCKS, page)) for _ in range(n)]
        for o in self.objs:
            o.tensor.fill_(1)

    def jobs(self, count: int) -> list[tuple[list[int], torch.Tensor]]:
        return [(ids, o.tensor) for ids, o in zip(self.ids[:count], self.objs, strict=False)]


def layer_steps(make: Callable[[], object]) -> tuple[float, float]:
    """(mean seconds of one ``next()``, seconds of the call and every step per layer)."""
    t0 = time.perf_counter()
    steps = make()
    t1 = time.perf_counter()
    inside = 0.0
    for _ in range(LAYERS):
        a = time.perf_counter()
        next(steps)  # type: ignore[call-overload]
        inside += time.perf_counter() - a
    total = (t1 - t0) + inside
    steps.close()  # type: ignore[attr-defined]
    return inside / LAYERS, total / LAYERS


def once(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(case: Case, impls: dict[str, ModuleType], rounds: int,
            sync: Callable[[], None]) -> dict[tuple, float]:
    """Median µs per (what, jobs, implementation), the implementations alternating round by round."""
    got: dict[tuple, list[float]] = {}

    def add(key: tuple, seconds: float) -> None:
        got.setdefault(key, []).append(seconds * 1e6)

    def synced(seconds: T) -> T:
        sync()
        return seconds

    for r in range(rounds + 1):  # round 0 warms up
        for name in (list(impls) if r % 2 else list(impls)[::-1]):
            m, kv = impls[name], case.kv[name]
            for count in JOB_COUNTS:
                jobs = case.jobs(count)
                store = synced(layer_steps(
                    lambda m=m, kv=kv, jobs=jobs: m.layerwise_store(kv, jobs, wait=False)))
                load = synced(layer_steps(lambda m=m, kv=kv, jobs=jobs: m.layerwise_load(kv, jobs)))
                gather = synced(once(lambda m=m, kv=kv, jobs=jobs: m.gather_many_async(kv, jobs)))
                scatter = synced(once(lambda m=m, kv=kv, jobs=jobs: m.scatter_many(kv, jobs)))
                if r == 0:
                    continue
                add(("store step", count, name), store[0])
                add(("store call+steps", count, name), store[1])
                add(("load step", count, name), load[0])
                add(("load call+steps", count, name), load[1])
                add(("gather_many_async", count, name), gather)
                add(("scatter_many", count, name), scatter)
    return {k: statistics.median(v) for k, v in got.items()}


WHAT = ("store step", "store call+steps", "load step", "load call+steps", "gather_many_async",
        "scatter_many")


def report(title: str, med: dict[tuple, float], impls: list[str]) -> None:
    print(f"\n{title}")
    head = "".join(f"{f'{name} {c}':>14}" for name in impls for c in JOB_COUNTS)
    ratios = "".join(f"{f'{name} 32/1':>12}" for name in impls)
    speedup = f"{'before/after 32':>17}" if len(impls) == 2 else ""
    print(f"{'µs':<19}{head}{ratios}{speedup}")
    for what in WHAT:
        cells = "".join(f"{med[(what, c, name)]:>14.1f}" for name in impls for c in JOB_COUNTS)
        rs = "".join(f"{med[(what, 32, name)] / med[(what, 1, name)]:>11.2f}x" for name in impls)
        sp = (f"{med[(what, 32, impls[0])] / med[(what, 32, impls[1])]:>16.2f}x"
              if len(impls) == 2 else "")
        print(f"{what:<19}{cells}{rs}{sp}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="64,65536",
                   help=f"page sizes in bytes, comma-separated, of {sorted(PAGES)}")
    p.add_argument("--patterns", default="contiguous,random")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per case (default 40, 9 with 64 KiB pages)")
    p.add_argument("--before", default=BEFORE,
                   help="the per-job gpu/: a git revision or a folder of its files ('': none)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    impls: dict[str, ModuleType] = {}
    if args.before:
        impls["before"] = gpu_at(args.before)
    impls["after"] = gpu
    where = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), host " if cuda else "")
    print(f"{where}CPU, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, torch "
          f"{torch.__version__}, {args.threads} thread(s); before = gpu/ at {args.before or '-'}, "
          "after = this tree; "
          f"{LAYERS} layers, LBHNC bf16, block {BLOCK}, jobs of {CHUNK_BLOCKS} blocks from a "
          "HostMemoryPool; medians")
    for page in map(int, args.pages.split(",")):
        heads, width = PAGES[page]
        rounds = args.rounds or (40 if page < 65536 else 9)
        for pattern in args.patterns.split(","):
            case = Case(heads, width, pattern, impls, args.device)
            med = measure(case, impls, rounds, sync)
            report(f"pages {case.page} B, {pattern} block ids, {rounds} rounds", med, list(impls))
            del case


if __name__ == "__main__":
    main()
