"""Keep vLLM's start-up logs out of the demo's screen: both output file descriptors go to a log file.

vLLM logs from three processes (this one, the engine core, the worker); the engine processes are
spawned and inherit file descriptors 1 and 2, so redirecting the descriptors (not just
``sys.stdout``) catches all of them, and tracebacks too. The demo draws on a duplicate of the
terminal's descriptor, returned by :func:`redirected_output`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def redirected_output(log_path: Path | None) -> Iterator[TextIO]:
    """Send fds 1 and 2 to ``log_path`` (truncated first) while inside; yield a stream to the terminal.

    ``None`` leaves everything as it is (``-v``) and yields ``sys.stdout``.
    """
    if log_path is None:
        yield sys.stdout
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    screen = os.fdopen(os.dup(1), "w", buffering=1)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield screen
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)
        screen.close()
