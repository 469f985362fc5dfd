"""A long search with kvplug's deterministic simulation (kvplug.connector.sim): random schedules of vLLM's
real Scheduler and kvplug's real connector, the invariants I1-I11 checked after every event.

    python -m benchmarks.simulate --seeds 100000 --minutes 30 [--start 1000000] [--jobs 2]
                                  [--replay-check 200]

Prints schedules run, events, minutes and every violation with its shrunk reproduction (replay
one with ``python -c "from kvplug.connector.sim.schedule import reproduce;
print(reproduce(SEED))"``). ``--replay-check N`` then runs N of the search's seeds again, each
alone in a fresh process with another ``PYTHONHASHSEED`` (kvplug.connector.sim.replay), and
names every seed whose outcome (trace, violation, counts) is not the one the search recorded.
Exit status 1 if any schedule failed or any replay differs.
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
    ap.add_argument("--replay-check", type=int, default=0, metavar="N",
                    help="then replay N of the seeds, each alone in a fresh process")
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
    differ: list[tuple[int, str, str]] = []
    if args.replay_check:
        from kvplug.connector.sim.replay import replay_check

        t0 = time.monotonic()
        seeds, differ = replay_check(fig.digests, args.replay_check, args.jobs, faults)
        hash_seeds = "1001" + (f"..{1000 + args.jobs}" if args.jobs > 1 else "")
        print(f"replay check: {len(seeds)} seeds, each alone in a fresh process "
              f"(PYTHONHASHSEED {hash_seeds}), {len(differ)} differ from the search, "
              f"{(time.monotonic() - t0) / 60:.1f} minutes")
        for seed, recorded, again in differ[:20]:
            print(f"  seed {seed}: searched {recorded}, alone {again}")
    return 1 if fig.failures or differ else 0


if __name__ == "__main__":
    sys.exit(main())
