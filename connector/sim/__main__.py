"""``python -m kvplug.connector.sim`` (what ``kvplug simulate`` runs): the deterministic
simulation against a backend; exit status 1 if any seed fails."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvplug simulate", description=(
        "Run kvplug's deterministic simulation (vLLM's real scheduler, kvplug's connector, "
        "the invariants I1-I11) against a backend behind L1."))
    ap.add_argument("--backend", required=True,
                    help="entry-point name or 'package.module:Class'")
    ap.add_argument("--options", default="{}",
                    help="the tier's options as JSON ('{tmp}' becomes a directory per rank)")
    ap.add_argument("--seeds", type=int, default=200, help="seeds to run")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--seed", type=int, default=None, help="replay this one seed (verbose)")
    ap.add_argument("--jobs", type=int, default=1, help="processes")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: never)")
    args = ap.parse_args(argv)
    from .api import explain, replay_command, simulate, tier_of

    try:
        tier = tier_of(args.backend, args.options)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"Error: --options: {exc}", file=sys.stderr)
        return 2
    if args.seed is not None:
        text = explain(*tier, args.seed, shrink=False)
        print(text)
        return 0 if text.split("\n", 1)[0].endswith(": ok") else 1
    res = simulate(*tier, seeds=args.seeds, start=args.start, jobs=args.jobs,
                   minutes=args.minutes)
    print(f"{args.backend}: {res.schedules} seeds, {res.events} events, "
          f"{res.seconds:.0f} s, {len(res.failures)} failed")
    for seed, what in res.failures:
        print(f"seed {seed}: {what}\n  replay: {replay_command(*tier, seed)}")
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
