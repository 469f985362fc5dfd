"""Negative controls: known faults the simulation must catch, one per invariant.

Each fault is switched on for one run by name (``SimConfig.faults``): it patches one kvplug rule
out for the duration of the run, so the test can show the invariant that rule protects fails
within the CI seed set (the simulation is not passing vacuously).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: fault -> the invariant that must catch it
FAULTS = {
    "store_after_failed_load": "I1",  # store KV computed over a failed load (defect 1's rule)
    "hide_load_errors": "I2",  # never tell vLLM a load failed: it computes over stale blocks
    "report_finished_twice": "I3",  # report a request in finished_sending again next step
    "skip_window_wait": "I4",  # no sliding-window liveness ordering (defect 2's rule)
    "leak_pins": "I5",  # lookups' pins are never released
}
#: faults only a directed schedule reaches (tests/test_simulation.py, SCHEDULES) -> invariant
DIRECTED_FAULTS = {
    "forget_unwritten": "I2",  # a failed load's blocks are not followed until written
    "store_over_unwritten": "I1",  # a step that reads an unwritten block still stores (#33)
}


def _patches(name: str) -> list[tuple[Any, str, Any]]:
    from kvplug.connector import load, save, store, unwritten, worker

    if name == "store_after_failed_load":
        return [(store.StoreBatch, "without", lambda self, skip: (self, []))]
    if name == "hide_load_errors":
        return [(worker.WorkerSide, "take_load_errors", lambda self: set()),
                (worker.WorkerSide, "take_failed", lambda self: set())]
    if name == "report_finished_twice":
        orig = worker.WorkerSide.take_sent

        def twice(self: Any, finished: Any = frozenset()) -> set[str]:
            out = orig(self, finished)
            again, self._sim_last_sent = getattr(self, "_sim_last_sent", set()), set(out)
            return out | again

        return [(worker.WorkerSide, "take_sent", twice)]
    if name == "skip_window_wait":
        return [(save.AsyncSaves, "wait_window", lambda self: None)]
    if name == "leak_pins":
        return [(worker.WorkerSide, "release", lambda self, req_ids: None)]
    if name == "store_over_unwritten":
        return [(load.Loads, "read_unwritten",
                 lambda self, md: self.reports.unwritten(md.unwritten, {}))]
    if name == "forget_unwritten":
        return [(unwritten.UnwrittenBlocks, "failed", lambda self, block_ids: None)]
    raise ValueError(f"unknown fault {name!r}; known: {sorted(FAULTS | DIRECTED_FAULTS)}")


@contextlib.contextmanager
def injected(faults: frozenset[str]) -> Iterator[None]:
    """Patch the named faults in for the duration of the block."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name in sorted(faults):
            for obj, attr, new in _patches(name):
                saved.append((obj, attr, obj.__dict__[attr]))
                setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)
