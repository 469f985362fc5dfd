"""The long fuzz campaign on stored bytes: the suite's targets (tests/support/stored_bytes_fuzz.py:
chunk-file header, codec frames, the posix, fsspec and value tiers' reads, the resp reply parser,
headers built to cost a parser, posix pins files) fed mutated and hostile inputs by hypothesis
for a time budget per target, then the counts.

    python -m benchmarks.fuzz_stored_bytes --seconds 60          # per target
    python -m benchmarks.fuzz_stored_bytes --seconds 20 --targets posix,resp --seed 7

Prints, per target: examples run, misses, served (byte-identical to the valid chunk), and the
failures (an exception out of a tier, a module imported, a tensor past the bound, other bytes
served), which must be 0; exits 1 otherwise, with the first failures' messages.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support.stored_bytes_fuzz import TARGETS, Campaign

BATCH = 200  # examples per hypothesis run (a fresh seed each)


def run_target(c: Campaign, target: str, seconds: float, first_seed: int,
               failures: list[str]) -> None:
    """Hypothesis runs of :data:`BATCH` examples on ``target`` (a new seed each) until
    ``seconds`` have passed; a failing example is counted and noted, and the campaign goes on."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        @seed(first_seed + n)
        @settings(max_examples=BATCH, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(s=st.integers(0, 2**32 - 1), encoded=st.booleans(),
               ops=st.lists(st.integers(0, 6), min_size=1, max_size=4))
        def example(s, encoded, ops):
            if time.monotonic() >= end:
                return
            try:
                c.run(target, s, encoded, ops)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                c.counts.exceptions += 1
                if len(failures) < 10:
                    failures.append(f"{target} seed={s} encoded={encoded} ops={ops}: "
                                    f"{type(exc).__name__}: {exc!r:.300}")

        example()
        n += 1


def campaign(targets: list[str], seconds: float, first_seed: int) -> int:
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvplug-fuzz-") as tmp:
        c = Campaign(Path(tmp))
        try:
            for target in targets:
                run_target(c, target, seconds, first_seed, failures)
        finally:
            c.close()
    k = c.counts
    print(f"{'target':<8} {'examples':>9} {'misses':>8} {'served-valid':>13}")
    for t in targets:
        print(f"{t:<8} {k.runs[t]:>9} {k.misses[t]:>8} {k.served[t]:>13}")
    print(f"total examples={sum(k.runs.values())} exceptions={k.exceptions} "
          f"largest tensor a read made={k.biggest_tensor} bytes, "
          f"largest Python memory a hostile header's read took={k.biggest_parse} bytes")
    for f in failures:
        print("FAILURE", f)
    return 1 if k.exceptions else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="time budget per target")
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset")
    ap.add_argument("--seed", type=int, default=0, help="first hypothesis seed")
    args = ap.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # the tiers' once-per-kind lines: not counts
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        ap.error(f"unknown target(s) {sorted(unknown)}; targets are {', '.join(TARGETS)}")
    return campaign(targets, args.seconds, args.seed)


if __name__ == "__main__":
    sys.exit(main())
