"""A real Mooncake master for tests, started by the test on 127.0.0.1 (a free port).

Mooncake's clients listen on every interface whatever they are told, so the tests that use this
run inside a private network namespace with only loopback (``tests/test_mooncake.py`` starts
``tests/mooncake_netns_suite.py`` under ``unshare -n``); :func:`in_private_netns` says whether
this process is in one, and the fixtures refuse to start a master outside it.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
from server_process import ServerProcess, free_port

NETNS_ENV = "TEST_PRIVATE_NETNS_LOOPBACK_ONLY"


def master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def in_private_netns() -> bool:
    """Whether the only network interface here is loopback (a namespace made by the test)."""
    return os.environ.get(NETNS_ENV) == "1" and [n for _, n in socket.if_nameindex()] == ["lo"]


class MooncakeMaster(ServerProcess):
    """``mooncake_master`` on 127.0.0.1; kill, restart (empty, as a real restart is), pause."""

    what = "mooncake_master"
    log_name = "master.log"
    start_s = 20.0
    graceful = False

    def __init__(self, workdir: Path) -> None:
        if not in_private_netns():
            pytest.skip("a Mooncake master runs only inside a private network namespace")
        if master_binary() is None:
            pytest.skip("mooncake_master is not installed (pip install 'kvplug[mooncake]')")
        super().__init__(workdir)
        self.port = free_port()
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                "--enable_metric_reporting=false", "--enable_http_metadata_server=false"]

    def ready(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False
