"""One server process that a test starts, waits for, kills, restarts, pauses and stops (shared by
``redis_server.py`` and ``mooncake_store.py``). A subclass says how to start it (:meth:`argv`)
and when it is ready (:meth:`ready`); its log goes to ``workdir/<log_name>``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.support.server_helpers import free_port

__all__ = ["ServerProcess", "free_port"]


class ServerProcess:
    """A server process with its log in ``workdir``; restarts come up empty (no persistence)."""

    #: What error messages call the server.
    what = "server"
    log_name = "server.log"
    #: How long a start may take before it is an error.
    start_s = 15.0
    #: ``stop`` with SIGTERM first (else SIGKILL at once).
    graceful = True

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the server answers now (called until it does, or the process exits)."""
        raise NotImplementedError

    def log_tail(self) -> str:
        return (self.workdir / self.log_name).read_text(errors="replace")[-3000:]

    def start(self) -> None:
        """Start it and wait until :meth:`ready`; a start that loses the port to the previous
        process (still releasing it) is tried again until ``start_s`` runs out."""
        log = open(self.workdir / self.log_name, "ab")  # noqa: SIM115 - the child keeps it
        deadline = time.monotonic() + self.start_s
        while True:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
            try:
                while time.monotonic() < deadline and self.proc.poll() is None:
                    if self.ready():
                        return
                    time.sleep(0.05)
            except BaseException:  # e.g. the client library missing: never leave the server
                self.kill()
                raise
            if self.proc.poll() is None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.what} did not come up:\n{self.log_tail()}")
            time.sleep(0.2)  # it exited (the port still held): try again

    def kill(self) -> None:
        """SIGKILL: the data is gone, as in a crash of a server without persistence."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Resume it (if paused) and end it."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            if not self.graceful:
                self.kill()
                return
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
