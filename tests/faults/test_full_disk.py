"""A real full disk and a read-only directory.

A small real tmpfs (12 MiB) is mounted in a private mount namespace (``unshare --mount``; for a
non-root user ``unshare --user --map-root-user --mount``), so nothing is mounted on the machine
and the mount vanishes with the namespace. In it, real posix tiers in child processes
(tests/support/disk_faults.py):

1. capacity far above the disk: stores until the disk is full (ENOSPC): failed stores counted,
   one warning, earlier chunks load exactly while the disk is full, no temporary or partial file;
2. capacity below the disk size: the restart trims to capacity, every store then succeeds by
   evicting, the bytes stay within capacity, the newest chunks load;
3. a directory owned by root read by another user (``setpriv`` to ``nobody``; root ignores
   permissions, so this step needs root and is skipped otherwise);
4. the same tmpfs remounted read-only (EROFS, which binds root too): stores dropped and counted,
   one warning, every chunk on it loads exactly.

If the machine refuses a mount namespace the test is skipped with the reason.
"""

from __future__ import annotations

import os

import pytest

from tests.support.disk_faults import CHUNK_FILE

pytestmark = pytest.mark.timeout(600)

DISK = 12 << 20


@pytest.fixture(scope="module")
def results():
    from tests.support.disk_faults import DiskFaultsUnavailable, run_disk_faults

    try:
        return run_disk_faults(DISK)
    except DiskFaultsUnavailable as exc:
        pytest.skip(str(exc))


def test_full_disk_stores_fail_soft_loads_go_on_nothing_partial(results):
    r = results["fill"]
    assert r["disk_size"] == DISK
    assert r["stored"] >= 5 and r["failed"] >= 5  # the disk really filled up, then refused
    assert r["stored"] + r["failed"] == 30
    assert r["disk_free"] < CHUNK_FILE  # full: not even one more chunk fits
    assert r["failed_puts"] == r["failed"]  # every failed store counted
    assert r["store_warnings"] == 1 and "No space left" in r["warning"][0]  # logged once
    assert r["loads_while_full"]["wrong"] == 0 and r["loads_while_full"]["missing"] == 0
    assert r["loads_while_full"]["exact"] >= r["stored"]
    assert r["temps"] == 0 and r["bad"] == [] and r["files"] == r["stored"]


def test_capacity_below_disk_size_evicts_instead_of_failing(results):
    r = results["evict"]
    assert r["free_after_restart"] >= DISK - r["capacity"] - CHUNK_FILE  # the restart trimmed
    assert r["failed_puts"] == 0 and r["writes"] == 20 and r["evictions"] > 0
    assert r["tier_bytes"] <= r["capacity"] and r["bytes"] <= r["capacity"]
    assert r["loads_newest"] == {"exact": 3, "missing": 0, "wrong": 0}
    assert r["temps"] == 0 and r["bad"] == []


def test_directory_of_another_user_is_read_only(results):
    r = results["user"]
    if r is None:
        pytest.skip("needs root to switch to another user (setpriv)")
    assert r["uid"] == 65534 and r["writable"] == 0
    assert r["dropped"] == 5 and r["failed"] == 0
    assert len(r["warning"]) == 1 and "not writable" in r["warning"][0]
    assert r["loads"] == {"exact": r["files_before"], "missing": 0, "wrong": 0}
    assert r["files_before"] > 0 and r["files"] == r["files_before"]


def test_read_only_filesystem_drops_stores_loads_go_on(results):
    r = results["readonly_fs"]
    assert r["uid"] == 0 or os.geteuid() != 0
    assert r["writable"] == 0 and r["dropped"] == 5 and r["failed"] == 0
    assert len(r["warning"]) == 1 and "not writable" in r["warning"][0]
    assert r["loads"] == {"exact": r["files_before"], "missing": 0, "wrong": 0}
    assert r["files_before"] > 0 and r["files"] == r["files_before"] and r["bad"] == []
