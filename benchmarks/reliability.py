"""The reliability campaign's longer runs: the CI tests' scenarios with counts you pick.
Figures go to docs/reliability.md. Everything runs on this machine; no network traffic.

    .venv/bin/python -m benchmarks.reliability crash --kind posix --kills 200
    .venv/bin/python -m benchmarks.reliability crash --kind fsspec --kills 200
    .venv/bin/python -m benchmarks.reliability disk --size-mib 12 --stores 30
    .venv/bin/python -m benchmarks.reliability fuzz --cases 20000
    .venv/bin/python -m benchmarks.reliability corruption --prompts 8 --rounds 12

* ``crash``: SIGKILL a child storing to posix (``fsync: true``) or fsspec ``file://`` at random
  moments (tests/support/crash_campaign.py); after each kill every file verifies, every acknowledged
  store is on disk and loads through a restarted tier, the index matches the directory.
* ``disk``: a real tmpfs in a private mount namespace filled by a posix tier, then capacity below
  the disk size, then read-only for another user and as a read-only mount (tests/support/disk_faults.py).
* ``fuzz``: mutated chunk files through the header reader (tests/faults/test_fuzz_inputs.py's mutations).
* ``corruption``: a vLLM engine serving from posix while chunk files are damaged
  (tests/support/corruption_campaign.py); it starts an engine: run it when no other engine runs.

Each prints one JSON object of figures (``wrong_outputs`` and the lists of problems must be 0/empty).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def crash(args: argparse.Namespace) -> dict:
    from tests.support.crash_campaign import run_campaign

    with tempfile.TemporaryDirectory(prefix="kvplug-crash-", dir=args.dir) as d:
        fig = run_campaign(args.kind, Path(d) / "store", kills=args.kills, seed=args.seed)
    return fig


def disk(args: argparse.Namespace) -> dict:
    from tests.support.disk_faults import run_disk_faults

    return run_disk_faults(args.size_mib << 20, stores=args.stores)


def fuzz(args: argparse.Namespace) -> dict:
    import random

    from kvplug import chunkfile as cf
    from kvplug.errors import ChunkFormatError

    from tests.faults.test_fuzz_inputs import _valid, mutate

    rng = random.Random(args.seed)
    fig = {"cases": 0, "rejected": 0, "accepted": 0, "escaped": [], "over_reads": 0,
           "accepted_wrong": 0}
    start = time.monotonic()
    for i in range(args.cases):
        _, good, _ = _valid(rng)
        data = mutate(good, rng)
        asked: list[tuple[int, int]] = []

        def read(offset: int, length: int, data=data, asked=asked) -> bytes:
            asked.append((offset, length))
            return data[offset:offset + length]

        fig["cases"] += 1
        try:
            header, raw = cf.read_header(read, len(data))
        except ChunkFormatError:
            fig["rejected"] += 1
        except Exception as exc:  # noqa: BLE001 - what the campaign looks for
            fig["escaped"].append(f"case {i}: {type(exc).__name__}: {exc!r:.200}")
        else:
            fig["accepted"] += 1
            fig["accepted_wrong"] += int(header.file_size != len(data))
        fig["over_reads"] += sum(o + n > max(len(data), cf.HEADER_PROBE) for o, n in asked)
    fig["seconds"] = round(time.monotonic() - start, 1)
    return fig


def corruption(args: argparse.Namespace) -> dict:
    from kvplug.connector.demo.model import make_model

    from tests.support.corruption_campaign import run_corruption, summary
    from tests.support.vllm_helpers import prompt

    with tempfile.TemporaryDirectory(prefix="kvplug-corrupt-", dir=args.dir) as d:
        model = make_model("tiny", root=Path(d) / "models")
        prompts = [prompt(1100, 500 + i) for i in range(args.prompts)]
        start = time.monotonic()
        out = run_corruption(model, Path(d) / "store", prompts, args.rounds, args.seed,
                             timeout=3600)
        fig = summary(out)
    fig["seconds"] = round(time.monotonic() - start, 1)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("crash")
    p.add_argument("--kind", choices=["posix", "fsspec"], default="posix")
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--dir", default=None, help="where the store lives (default: $TMPDIR)")
    p = sub.add_parser("disk")
    p.add_argument("--size-mib", type=int, default=12)
    p.add_argument("--stores", type=int, default=30)
    p = sub.add_parser("fuzz")
    p.add_argument("--cases", type=int, default=20000)
    p.add_argument("--seed", type=int, default=16)
    p = sub.add_parser("corruption")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--dir", default=None)
    args = ap.parse_args()
    fig = {"crash": crash, "disk": disk, "fuzz": fuzz, "corruption": corruption}[args.what](args)
    print(json.dumps({"run": args.what, **fig}, default=str))


if __name__ == "__main__":
    main()
