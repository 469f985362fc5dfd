"""The mooncake tier's tests (tests/mooncake_netns_suite.py) run in a private network namespace
made here with ``unshare -n`` (loopback only): Mooncake's clients listen on every interface,
so nothing of theirs may be reachable from outside this test. Skipped where Mooncake's client is
not installed (``kvplug[mooncake]``) or namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mooncake_store import NETNS_ENV, master_binary

pytestmark = pytest.mark.timeout(600)
TESTS = Path(__file__).resolve().parent


def test_mooncake_tier_in_private_netns(tmp_path):
    pytest.importorskip("mooncake.store", reason="install kvplug[mooncake] (and libibverbs1)")
    if master_binary() is None:
        pytest.skip("mooncake_master is not installed")
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None or os.geteuid() != 0:
        pytest.skip("needs root, unshare and ip to make a private network namespace")
    script = (f"{ip} link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider "
              f"--basetemp={tmp_path / 'inner'} {TESTS / 'mooncake_netns_suite.py'}")
    proc = subprocess.run([unshare, "-n", "--", "sh", "-c", script], capture_output=True,
                          text=True, timeout=560, cwd=str(TESTS.parent),
                          env={**os.environ, NETNS_ENV: "1", "MC_STORE_CLIENT_SETUP_RETRIES": "1"})
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], tail
