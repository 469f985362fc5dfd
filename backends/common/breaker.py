"""A small thread-safe circuit breaker for remote tiers (fsspec, resp: one rule for both).

*Closed*: calls go through. After ``threshold`` consecutive failures it *opens*: calls are refused
(the tier answers as if it were empty) until ``backoff_s`` has passed; then exactly one call is let
through as a *probe* (half-open). A successful probe closes the breaker; a failed one re-opens it
with the back-off doubled (up to ``max_backoff_s``). The first trip is logged as a warning, later
ones at debug level, and the recovery at info level; every trip is counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvplug.backends.breaker")


class CircuitBreaker:
    """Counts consecutive failures of a remote store and refuses calls while it looks down."""

    def __init__(
        self,
        name: str,
        *,
        threshold: int = 2,
        backoff_s: float = 5.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.threshold = max(1, threshold)
        self.base_backoff = backoff_s
        self.max_backoff = max(backoff_s, max_backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open = False
        self._retry_at = 0.0
        self._backoff = backoff_s
        self._probe = False
        self.trips = 0
        self.refused = 0
        self._warned = False

    @property
    def is_open(self) -> bool:
        """True while the store is considered down (including while a probe is running)."""
        return self._open

    def allow(self) -> bool:
        """Whether a call may go to the store now (when open: one probe after the back-off)."""
        with self._lock:
            if not self._open:
                return True
            if not self._probe and self._clock() >= self._retry_at:
                self._probe = True
                return True
            self.refused += 1
            return False

    def forgo(self) -> None:
        """Give back a trial call that :meth:`allow` granted but the caller did not make (a store
        dropped for another reason), so the next caller makes it; without this the breaker would
        wait forever for a report that never comes."""
        with self._lock:
            self._probe = False

    def success(self) -> None:
        """Record a call that reached the store (a missing object counts as success)."""
        with self._lock:
            self._failures = 0
            if not self._open:
                return
            self._open = False
            self._probe = False
            self._backoff = self.base_backoff
        logger.info("tier %r: remote store reachable again; serving from it", self.name)

    def failure(self, reason: str) -> None:
        """Record a failed call (error or timeout); may open or re-open the breaker."""
        with self._lock:
            self._failures += 1
            if self._open:
                if not self._probe:
                    return  # a call that started before the trip; already counted
                self._probe = False
                self._backoff = min(self._backoff * 2, self.max_backoff)
            elif self._failures < self.threshold:
                return
            else:
                self._open = True
                self._backoff = self.base_backoff
            self.trips += 1
            self._retry_at = self._clock() + self._backoff
            first, self._warned = not self._warned, True
            backoff = self._backoff
        log = logger.warning if first else logger.debug
        log(
            "tier %r: remote store failing (%s); treated as missing (loads miss, stores are "
            "dropped), retrying in %.1fs%s", self.name, reason, backoff,
            " — further trips are counted in stats, not logged" if first else "",
        )

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "breaker_open": 1.0 if self._open else 0.0,
                "breaker_trips": float(self.trips),
                "breaker_refused": float(self.refused),
            }
