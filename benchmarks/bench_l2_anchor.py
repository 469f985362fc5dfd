"""kvplug's posix tier beside LMCache 0.5.6's fs L2 adapter, each through its own bench command,
back to back on the same directory's file system: store, lookup and load of 256 KiB values in
batches of 96 keys, every loaded byte verified by both.

    .venv/bin/python -m pip install --no-deps --target /tmp/lmc-pkgs lmcache==0.5.6 \\
        sortedcontainers aiofile aiofiles caio
    .venv/bin/python -m benchmarks.bench_l2_anchor --lmcache-path /tmp/lmc-pkgs [--root /dev/shm/l2a]

Each pass runs both, the order alternating (the one that runs first pays for the previous pass's
deletes and dirty pages on a disk), with a ``sync`` and a pause between runs; both store the same
bytes (LMCache: 20 rounds of 96 keys; kvplug: ``--max-bytes`` the same 480 MiB). LMCache is run
from ``--lmcache-path`` (installed there without its dependencies, as ``bench_anchor.py`` does)
so the project's environment stays as the README builds it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

KEYS, VALUE_KIB, ROUNDS = 96, 256, 20


def _json_in(text: str) -> dict:
    return json.loads(text[text.index("{"): text.rindex("}") + 1])


def lmcache(root: Path, lmcache_path: str) -> dict[str, float]:
    """``lmcache bench l2`` with its fs adapter: store/load MB/s, lookup keys/s."""
    adapter = json.dumps({"type": "fs", "base_path": str(root / "lmcache")})
    argv = ["lmcache", "bench", "l2", "--l2-adapter", adapter, "--num-keys", str(KEYS),
            "--data-size-kb", str(VALUE_KIB), "--rounds", str(ROUNDS), "--warmup-rounds", "2",
            "--no-skip-verify", "--lookup-max-hit-rate", "1.0", "--format", "json"]
    code = f"import sys; sys.argv = {argv!r}; from lmcache.cli.main import main; main()"
    env = dict(os.environ, PYTHONPATH=lmcache_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout
    ops: dict[str, dict] = {}

    def walk(d: object) -> None:
        if isinstance(d, dict):
            if "operation" in d:
                ops[d["operation"]] = d
            for v in d.values():
                walk(v)

    walk(_json_in(out))
    return {"store": ops["Store"]["throughput_avg_mbps"],
            "lookup": ops["Lookup"]["ops_per_sec_avg"],
            "load": ops["Load"]["throughput_avg_mbps"]}


def kvplug(root: Path) -> tuple[dict[str, float], dict[str, float]]:
    """``kvplug bench`` on posix: (kvplug, raw files) store/load MB/s, lookup keys/s."""
    argv = [sys.executable, "-m", "kvplug.cli", "bench", "--backend", "posix", "--options",
            json.dumps({"path": str(root / "kvplug")}), "--sizes", f"{VALUE_KIB}KiB",
            "--batches", str(KEYS), "--threads", "1", "--seconds", "3",
            "--max-bytes", f"{KEYS * VALUE_KIB * ROUNDS // 1024}MiB", "--json"]
    cell = _json_in(subprocess.run(argv, capture_output=True, text=True, timeout=600,
                                   check=True).stdout)["cells"][0]

    def figures(side: dict) -> dict[str, float]:
        return {op: side[op]["keys_s" if op == "lookup" else "mb_s"] for op in side}

    return figures(cell["kvplug"]), figures(cell["raw"])


def settle() -> None:
    os.sync()
    time.sleep(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lmcache-path", required=True, help="where lmcache 0.5.6 is installed")
    ap.add_argument("--root", default="/tmp/kvplug-l2-anchor", help="directory of both stores")
    ap.add_argument("--passes", type=int, default=4)
    args = ap.parse_args()
    root = Path(args.root)
    print("| pass | op | LMCache 0.5.6 fs | kvplug posix | kvplug / LMCache | raw files |")
    print("|---|---|---|---|---|---|")
    for p in range(1, args.passes + 1):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        if p % 2:
            lm = lmcache(root, args.lmcache_path)
            settle()
            kv, raw = kvplug(root)
        else:
            kv, raw = kvplug(root)
            settle()
            lm = lmcache(root, args.lmcache_path)
        settle()
        first = "LMCache" if p % 2 else "kvplug"
        for op, unit in (("store", "MB/s"), ("lookup", "keys/s"), ("load", "MB/s")):
            print(f"| {p} ({first} first) | {op} ({unit}) | {lm[op]:.0f} | {kv[op]:.0f} | "
                  f"{kv[op] / lm[op]:.2f}x | {raw[op]:.0f} |", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
