"""A real Mooncake master for tests, started by the test on 127.0.0.1 (a free port).

Mooncake's clients listen on every interface whatever they are told, so the tests that use this
run inside a private network namespace with only loopback (``tests/test_mooncake.py`` starts
``tests/mooncake_netns_suite.py`` under ``unshare -n``); :func:`in_private_netns` says whether
this process is in one, and the fixtures refuse to start a master outside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

NETNS_ENV = "TEST_PRIVATE_NETNS_LOOPBACK_ONLY"


def master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def in_private_netns() -> bool:
    """Whether the only network interface here is loopback (a namespace made by the test)."""
    return os.environ.get(NETNS_ENV) == "1" and [n for _, n in socket.if_nameindex()] == ["lo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1; kill, restart (empty, as a real restart is), pause."""

    def __init__(self, workdir: Path) -> None:
        if not in_private_netns():
            pytest.skip("a Mooncake master runs only inside a private network namespace")
        if master_binary() is None:
            pytest.skip("mooncake_master is not installed (pip install 'kvplug[mooncake]')")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
             "--enable_metric_reporting=false", "--enable_http_metadata_server=false"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mooncake_master did not start:\n"
                                       + (self.workdir / "master.log").read_text()[-3000:]) from None
                time.sleep(0.05)

    def kill(self) -> None:
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
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.kill()
