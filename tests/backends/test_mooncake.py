"""The mooncake tier's tests (tests/backends/test_mooncake_netns.py) run in a private network namespace
made here with ``unshare -n`` (loopback only): Mooncake's clients listen on every interface,
so nothing of theirs may be reachable from outside this test. Skipped where Mooncake's client is
not installed (``kvplug[mooncake]``) or namespaces cannot be made (not root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.mooncake_store import run_in_private_netns

pytestmark = pytest.mark.timeout(600)
TESTS = Path(__file__).resolve().parent


def test_mooncake_tier_in_private_netns(tmp_path):
    run_in_private_netns(TESTS / "test_mooncake_netns.py", tmp_path / "inner")
