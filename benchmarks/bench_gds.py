"""Load/store GB/s of the gds tier vs raw kvikio pread/pwrite vs posix tier + H2D copy.

Run on a GPU machine with ``pip install 'kvplug[gds]'``::

    python -m benchmarks.bench_gds --dir /mnt/nvme/kvplug-bench --chunks 32 --layers 32

It prints the device, the kvikio version and whether GDS or compat mode was active. On a machine
without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:7.2f} GB/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the file system to measure")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--page-bytes", type=int, default=32768)
    args = ap.parse_args()

    from kvplug.backends.gds.probe import probe

    found = probe()
    if not found.driver or not torch.cuda.is_available():
        print(f"bench_gds: skipped — no CUDA here ({found.driver_error or 'no CUDA device'}); "
              "run it on a GPU machine with 'kvplug[gds]' installed")
        return 0
    if not found.kvikio:
        print(f"bench_gds: skipped — kvikio missing ({found.kvikio_error}); "
              "pip install 'kvplug[gds]'")
        return 0
    import kvikio
    from kvplug.memory import heap_memory_obj
    from kvplug.storage_manager import StorageManager
    from kvplug.testing import make_key

    root = Path(args.dir or tempfile.mkdtemp(prefix="kvplug-bench-gds-"))
    shape = (args.layers, args.blocks, args.page_bytes)
    nbytes = args.layers * args.blocks * args.page_bytes
    total = nbytes * args.chunks
    keys = [make_key(i) for i in range(args.chunks)]
    dev = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
           for _ in range(args.chunks)]
    print(f"device: {torch.cuda.get_device_name()} | kvikio {found.kvikio_version} | "
          f"cuFile GDS available: {found.gds} | dir: {root} | {args.chunks} chunks x "
          f"{nbytes / 2**20:.1f} MiB")

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # (a) raw kvikio, same bytes, one file per chunk, device buffers
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def raw_store() -> None:
        for i, t in enumerate(dev):
            with kvikio.CuFile(raw / f"{i}.bin", "w") as f:
                f.pwrite(t).get()

    def raw_load() -> None:
        out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for i in range(args.chunks):
            with kvikio.CuFile(raw / f"{i}.bin", "r") as f:
                f.pread(out).get()

    print(f"raw kvikio   store {_gbps(total, timed(raw_store))}   load "
          f"{_gbps(total, timed(raw_load))}")

    # gds tier: store from device objects, load (get) into device memory
    with StorageManager({"tiers": [{"backend": "gds", "options": {"path": str(root / "gds")}}]}
                        ) as m:
        backend = m._tiers[0].backend
        print(f"gds tier mode: {backend.mode.value}")
        objs = []
        for t in dev:
            o = heap_memory_obj(shape, device="cuda")
            o.byte_view.copy_(t)
            objs.append(o)

        def gds_store() -> None:
            m.batched_put(keys, objs)
            m.flush(600)

        # reads land where ctx.allocate puts them: device memory here (file -> GPU)
        backend.files.allocate = lambda shp, dtype, fmt, n: heap_memory_obj(shp, dtype, fmt, n, device="cuda")

        def gds_load() -> None:
            for k in keys:
                o = backend.get(k)
                assert o is not None
                o.ref_down()

        print(f"gds tier     store {_gbps(total, timed(gds_store))}   load "
              f"{_gbps(total, timed(gds_load))}   (checksums on: one D2H per layer)")
        backend.opts = backend.opts.model_copy(update={"verify_device": False})
        print(f"raw kvikio   load  {_gbps(total, timed(raw_load))}   (again, beside the next row)")
        print(f"gds tier     load  {_gbps(total, timed(gds_load))}   (verify_device: false)")
        for o in objs:
            o.ref_down()

    # (b) posix tier + host<->device copies
    with StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(root / "px")}}]}
                        ) as m:
        def posix_store() -> None:
            hosts = []
            for t in dev:
                o = m.allocate(shape)
                o.byte_view.copy_(t)  # D2H
                hosts.append(o)
            m.batched_put(keys, hosts)
            m.flush(600)
            for o in hosts:
                o.ref_down()

        def posix_load() -> None:
            out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            for k in keys:
                o = m.get(k)
                out.copy_(o.byte_view)  # H2D
                o.ref_down()

        print(f"posix + copy store {_gbps(total, timed(posix_store))}   load "
              f"{_gbps(total, timed(posix_load))}")
    print("note: loads may be served by the page cache; drop caches between runs for disk "
          "figures (kvikio.clear_page_cache needs root)")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
