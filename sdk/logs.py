"""Logging helpers shared by every room: a problem that repeats is logged once, then counted.

A tier that is full, read-only or down would otherwise log on every store; the rule everywhere in
kvplug is one line per (place, kind of problem) per process, with counts in ``stats``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable


class LogOnce:
    """``log(what, msg, *args)`` logs ``msg`` the first time ``what`` is seen, and never again.

    One instance per owner (a tier, a manager): ``what`` names the kind of problem within it.
    Thread-safe; ``seen(what)`` tells whether it was logged.
    """

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self._logger = logger
        self._level = level
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def __call__(self, what: Hashable, msg: str, *args: object, level: int | None = None) -> bool:
        """Log once per ``what``; returns whether this call logged."""
        with self._lock:
            if what in self._seen:
                return False
            self._seen.add(what)
        self._logger.log(self._level if level is None else level, msg, *args)
        return True

    def seen(self, what: Hashable) -> bool:
        return what in self._seen

    def reset(self) -> None:
        """Forget what was logged (a tier that recovered logs its next failure again)."""
        with self._lock:
            self._seen.clear()
