"""Waiting for a condition in a test, bounded only to catch a hang.

A test that sleeps a fixed time and then asserts breaks on a busy machine (the thread it waits
for has not run yet); one that waits for the condition it means holds there, and is as fast as
the machine allows when idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: seconds: a condition not met by then is a hang (never a speed check)
HANG_S = 60.0


def wait_until(cond: Callable[[], object], what: str, limit: float = HANG_S,
               poll: float = 0.01) -> None:
    """Return once ``cond()`` is true; fail naming ``what`` if it is not within ``limit``."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({limit:g}s): {what}")
        time.sleep(poll)
