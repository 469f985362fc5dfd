"""SIGKILL-mid-write soak for the file tiers: the campaign of tests/faults/test_crash_durability.py, longer.

A child process stores chunks to the posix tier (``fsync: true``) or the fsspec tier over
``file://`` and reports what its tier's ``flush`` acknowledged; it is killed at random moments,
``--kills`` times per tier, and after each kill a restarted tier must hold every acknowledged
chunk, whole and verified, with no stale temporary file left (see ``tests/support/crash_campaign.py``).

Run: ``.venv/bin/python -m benchmarks.crash_soak --kills 200 [--kinds posix,fsspec] [--seed 0]``.
Exits 1 if any kill lost an acknowledged chunk or left a bad file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.support.crash_campaign import run_campaign

PROBLEMS = ("bad_files", "lost_acknowledged", "index_mismatch")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=100, help="SIGKILLs per tier")
    p.add_argument("--kinds", default="posix,fsspec", help="comma-separated: posix, fsspec")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the stores live (default: a temp dir)")
    args = p.parse_args()
    failed = False
    with tempfile.TemporaryDirectory(prefix="kvplug-crash-soak-", dir=args.dir) as tmp:
        for kind in args.kinds.split(","):
            fig = run_campaign(kind, Path(tmp) / kind, kills=args.kills, seed=args.seed)
            print(json.dumps(fig, default=str))
            bad = {k: fig[k] for k in PROBLEMS if fig[k]}
            if bad or fig["stale_temps_left"]:
                failed = True
                print(f"{kind}: FAILED {bad} stale temps {fig['stale_temps_left']}")
            else:
                print(f"{kind}: {fig['kills']} kills, {fig['acknowledged']} acknowledged stores, "
                      f"{fig['files_checked']} file checks, nothing lost ({fig['seconds']} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
