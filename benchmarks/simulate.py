"""A long search with kvplug's deterministic simulation (kvplug.connector.sim): random schedules of vLLM's
real Scheduler and kvplug's real connector, the invariants I1-I11 checked after every event.

    python -m benchmarks.simulate --seeds 100000 --minutes 30 [--start 1000000] [--jobs 2]

Prints schedules run, events, minutes and every violation with its shrunk reproduction (replay
one with ``python -c "from kvplug.connector.sim.schedule import reproduce;
print(reproduce(SEED))"``). Exit status 1 if any schedule failed.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10_000, help="schedules to run at most")
    ap.add_argument("--minutes", type=float, default=10.0, help="stop after this long")
    ap.add_argument("--start", type=int, default=1_000_000,
                    help="first seed (the CI set is 0-299)")
    ap.add_argument("--jobs", type=int, default=2, help="processes")
    ap.add_argument("--fault", action="append", default=[],
                    help="a negative control to inject (see kvplug/connector/sim/controls.py)")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    from kvplug.connector.sim.search import report, search

    deadline = time.time() + args.minutes * 60
    faults = frozenset(args.fault)
    fig = search(args.start, args.seeds, args.jobs, faults, deadline)
    print(f"schedules {fig.schedules}  events {fig.events}  minutes {fig.seconds / 60:.1f}  "
          f"violations {len(fig.failures)}  (seeds {args.start}.., {args.jobs} processes"
          f"{', faults ' + ','.join(sorted(faults)) if faults else ''})")
    print("exercised: " + ", ".join(f"{k} {v}" for k, v in sorted(fig.counts.items())))
    for seed, what in fig.failures[:20]:
        print(f"\nseed {seed}: {what}")
        print(report(seed, faults))
    return 1 if fig.failures else 0


if __name__ == "__main__":
    sys.exit(main())
