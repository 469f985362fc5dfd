"""``kvplug bench`` on every reference tier, each with its server started here; JSON per tier.

    .venv/bin/python -m benchmarks.bench_tiers_cli OUT_DIR [--seconds 0.5] [--tiers posix,resp,...] \
        [--rounds 3]
    .venv/bin/python -m benchmarks.bench_tiers_cli --table RUN1_DIR RUN2_DIR   # markdown, "run 1 / run 2"

* posix: a directory under ``--root`` (default /tmp/kvplug-bench-tiers);
* local_cpu: a 3 GiB pool;
* resp: a ``redis-server`` on 127.0.0.1 (tests/support/redis_server.py: no persistence, 3 GB maxmemory);
* fsspec: moto's S3 server on 127.0.0.1 in this process (tests/support/s3_server.py), 256 KiB and 1 MiB
  values, batches of 1 and 16, 64 MiB per cell (moto moves ~20-60 MB/s here);
* mooncake: a ``mooncake_master`` on 127.0.0.1, batches of 1 and 32 (segments of 3 GiB per
  client); with it the script re-runs itself in a private network namespace (root, unshare).

The value tiers and posix run with ``max_pending_writes: 512`` (the value tiers' default was 64,
which dropped 32 keys of a batch of 96; it is 1024 now, plus ``max_pending_bytes``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.remote_stores import private_network_for, started

TIERS = ("posix", "local_cpu", "resp", "fsspec", "mooncake")


ROUNDS = 1  # ``--rounds`` of every ``kvplug bench`` run (set by main)


def bench(out: Path, name: str, seconds: float, args: list[str]) -> None:
    """One ``kvplug bench --json`` run; its JSON and stderr go to ``out``."""
    t = time.time()
    proc = subprocess.run([sys.executable, "-m", "kvplug.cli", "bench", *args, "--seconds",
                           str(seconds), "--rounds", str(ROUNDS), "--json"],
                          capture_output=True, text=True)
    (out / f"{name}.json").write_text(proc.stdout)
    (out / f"{name}.err").write_text(proc.stderr)
    print(f"{name}: exit {proc.returncode}, {time.time() - t:.0f} s", flush=True)


def run(out: Path, seconds: float, tiers: list[str], root: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    queue = {"max_pending_writes": 512}
    if "posix" in tiers:
        bench(out, "posix", seconds, ["--backend", "posix", "--options",
                                      json.dumps({"path": str(root / "posix"), **queue})])
    if "local_cpu" in tiers:
        bench(out, "local_cpu", seconds, ["--backend", "local_cpu", "--options",
                                          json.dumps({"capacity": "3GiB"})])
    for name, extra in (("resp", []),
                        ("fsspec", ["--sizes", "256KiB,1MiB", "--batches", "1,16",
                                    "--max-bytes", "64MiB"]),
                        ("mooncake", ["--batches", "1,32"])):
        if name not in tiers:
            continue
        with started(name, root, segment="3GiB", buffer="2GiB", timeout_s=30) as store:
            options = {**store.options, **queue}
            if name == "fsspec":
                options["timeout_s"] = 60
            bench(out, name, seconds, [*extra, "--backend", name, "--options",
                                       json.dumps(options)])


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(first: Path, second: Path) -> None:
    """Each tier's cells as markdown, every figure as 'run 1 / run 2'."""
    for name in TIERS:
        if not (first / f"{name}.json").exists() or not (second / f"{name}.json").exists():
            continue
        a, b = (json.loads((d / f"{name}.json").read_text()) for d in (first, second))
        cells = [{(c["size"], c["batch"], c["threads"]): c for c in r["cells"]} for r in (a, b)]
        print(f"\n**{name}** — raw medium: {a['raw']}\n")
        print("| value | batch | threads | op | MB/s | calls/s | keys/s | p50 ms | p99 ms | "
              "MiB verified | raw MB/s (lookup: keys/s) | tier/raw | missed/dropped/errors |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for key in cells[0]:
            if key not in cells[1]:
                continue
            for ph in ("store", "lookup", "load"):
                ks = [c[key]["kvplug"][ph] for c in cells]
                ws = [(c[key].get("raw") or {}).get(ph) for c in cells]
                rate = "keys_s" if ph == "lookup" else "mb_s"

                def two(field: str, fmt: str = "{:.0f}", ks: list = ks) -> str:
                    return " / ".join(_f(k[field], fmt) for k in ks)

                raw = " / ".join(_f(w[rate]) if w else "-" for w in ws)
                each = [(c[key].get("ratio") or {}).get(ph) for c in cells]  # --rounds: median
                ratio = " / ".join(f"{e:.2f}x" if e else f"{k[rate] / w[rate]:.2f}x"
                                   if w and k[rate] and w[rate] else "-"
                                   for k, w, e in zip(ks, ws, each))
                verified = (" / ".join(f"{k['bytes_verified'] / 2**20:.0f}" for k in ks)
                            if ph == "load" else "")
                mde = " / ".join(f"{k['misses']}/{k['dropped']}/{k['error_count']}" for k in ks)
                print(f"| {key[0] >> 10} KiB | {key[1]} | {key[2]} | {ph} | {two('mb_s')} | "
                      f"{two('ops_s')} | {two('keys_s')} | {two('p50_ms', '{:.2f}')} | "
                      f"{two('p99_ms', '{:.2f}')} | {verified} | {raw} | {ratio} | {mde} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="+")
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--root", type=Path, default=Path("/tmp/kvplug-bench-tiers"))
    ap.add_argument("--rounds", type=int, default=1, help="kvplug bench --rounds (tier and raw "
                    "alternating; the ratio is the median of the rounds' own)")
    ap.add_argument("--table", action="store_true", help="print the tables of two runs")
    args = ap.parse_args()
    global ROUNDS
    ROUNDS = args.rounds
    if args.table:
        table(*args.out[:2])
        return
    tiers = args.tiers.split(",")
    private_network_for(tiers, __spec__.name)
    run(args.out[0], args.seconds, tiers, args.root)


if __name__ == "__main__":
    main()
