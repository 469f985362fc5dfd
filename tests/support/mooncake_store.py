"""A real Mooncake master for tests, started by the test on 127.0.0.1 (a free port).

Mooncake's clients listen on every interface whatever they are told, so the tests that use this
run inside a private network namespace with only loopback (``tests/backends/test_mooncake.py`` starts
``tests/backends/test_mooncake_netns.py`` under ``unshare -n``); :func:`in_private_netns` says whether
this process is in one, and the fixtures refuse to start a master outside it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server_process import ServerProcess, free_port

NETNS_ENV = "TEST_PRIVATE_NETNS_LOOPBACK_ONLY"


def master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def in_private_netns() -> bool:
    """Whether the only network interface here is loopback (a namespace made by the test)."""
    return os.environ.get(NETNS_ENV) == "1" and [n for _, n in socket.if_nameindex()] == ["lo"]


def rerun_module_in_private_netns(module: str) -> None:
    """For a benchmark with a Mooncake part: unless already in one, replace this process by
    ``python -m module`` (same arguments, same directory) run in a private network namespace
    with only loopback up; there :data:`NETNS_ENV` is set. Exits with a message naming the way
    out where that cannot be made."""
    if in_private_netns():
        return
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if os.geteuid() != 0 or unshare is None or ip is None:
        raise SystemExit("the mooncake part runs in a private network namespace (root, unshare "
                         "and ip); pass --stores resp elsewhere")
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    command = f"{ip} link set lo up && exec {sys.executable} -m {shlex.quote(module)} {args}"
    os.execve(unshare, [unshare, "-n", "--", "sh", "-c", command], {**os.environ, NETNS_ENV: "1"})


def run_in_private_netns(test_file: Path, basetemp: Path, timeout: float = 560,
                         env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> str:
    """Run the pytest module ``test_file`` (pytest ``args`` added) in a network namespace made
    here (``unshare -n``, only ``lo`` up); its stdout. Skips where Mooncake or namespaces are
    missing; fails with the inner run's output when it fails or skips."""
    pytest.importorskip("mooncake.store", reason="install kvplug[mooncake] (and libibverbs1)")
    if master_binary() is None:
        pytest.skip("mooncake_master is not installed")
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None or os.geteuid() != 0:
        pytest.skip("needs root, unshare and ip to make a private network namespace")
    script = (f"{ip} link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider "
              f"--basetemp={basetemp} {' '.join(args)} {test_file}")
    proc = subprocess.run([unshare, "-n", "--", "sh", "-c", script], capture_output=True,
                          text=True, timeout=timeout, cwd=str(Path(test_file).parents[2]),
                          env={**os.environ, NETNS_ENV: "1", "MC_STORE_CLIENT_SETUP_RETRIES": "1",
                               **(env or {})})
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], tail
    return proc.stdout


class MooncakeMaster(ServerProcess):
    """``mooncake_master`` on 127.0.0.1; kill, restart (empty, as a real restart is), pause."""

    what = "mooncake_master"
    log_name = "master.log"
    start_s = 20.0
    graceful = False

    def __init__(self, workdir: Path, lease_ms: int | None = None) -> None:
        """``lease_ms``: the master's ``default_kv_lease_ttl`` (Mooncake's own default, 10 s, if
        None): how long after a read or an existence check it refuses to remove an object."""
        self.lease_ms = lease_ms
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
        lease = [] if self.lease_ms is None else [f"--default_kv_lease_ttl={self.lease_ms}"]
        return [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                "--enable_metric_reporting=false", "--enable_http_metadata_server=false", *lease]

    def ready(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False
