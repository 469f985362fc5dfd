"""Running many seeds, on several processes: what the CI test and benchmarks/simulate.py share."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import Counter
from dataclasses import dataclass, field

from .schedule import reproduce, run_seed


@dataclass
class Figures:
    schedules: int = 0
    events: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)  # (seed, violation)
    seconds: float = 0.0
    counts: Counter = field(default_factory=Counter)  # what the schedules exercised
    #: each seed's outcome (Outcome.digest), for a replay check (.replay)
    digests: dict[int, str] = field(default_factory=dict)


def _range(args: tuple[int, int, frozenset[str], float, tuple[str, str]]) -> Figures:
    start, stop, faults, deadline, tier = args
    import logging

    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # thousands of seeds: load failures are expected
    f = Figures()
    t0 = time.monotonic()
    for seed in range(start, stop):
        if deadline and time.time() > deadline:
            break
        out = run_seed(seed, faults, tier=tier)
        f.schedules += 1
        f.events += out.events
        merge(f.counts, out.counts)
        f.digests[seed] = out.digest
        if out.violation is not None:
            f.failures.append((seed, str(out.violation)))
    f.seconds = time.monotonic() - t0
    return f


def search(start: int, count: int, jobs: int = 2, faults: frozenset[str] = frozenset(),
           deadline: float = 0.0, batch: int = 50, tier: tuple[str, str] = ()) -> Figures:
    """Run seeds ``[start, start + count)`` on ``jobs`` processes (forked: each builds its vLLM
    config once); stop early at ``deadline`` (``time.time()``); ``tier``: the backend under
    test (``SimConfig.tier``)."""
    parts = [(s, min(s + batch, start + count), faults, deadline, tier)
             for s in range(start, start + count, batch)]
    total = Figures()
    t0 = time.monotonic()
    if jobs <= 1:
        results = map(_range, parts)
        for r in results:
            _add(total, r)
    else:
        with mp.get_context("fork").Pool(jobs) as pool:
            for r in pool.imap_unordered(_range, parts):
                _add(total, r)
    total.seconds = time.monotonic() - t0
    total.failures.sort()
    return total


def _add(total: Figures, r: Figures) -> None:
    total.schedules += r.schedules
    total.events += r.events
    total.failures += r.failures
    merge(total.counts, r.counts)
    total.digests.update(r.digests)


def merge(total: Counter, counts: dict[str, int]) -> None:
    """Add ``counts`` to ``total``: sums, except the figures named ``max ...`` (the largest)."""
    for k, v in counts.items():
        total[k] = max(total[k], v) if k.startswith("max ") else total[k] + v


def report(seed: int, faults: frozenset[str] = frozenset()) -> str:
    """A failing seed's shrunk reproduction (its event list and the violation)."""
    return reproduce(seed, faults)
