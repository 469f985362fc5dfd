"""Two vLLM engine processes sharing one Mooncake master, which is killed mid-workload and
restarted (tests/engine/test_mooncake_engine_netns.py), run in a private network namespace made here with
``unshare -n`` (loopback only): Mooncake's clients listen on every interface. Skipped where
Mooncake's client is not installed (``kvplug[mooncake]``) or namespaces cannot be made."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_mooncake_engine_netns import MODEL_ENV
from tests.support.mooncake_store import run_in_private_netns

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
TESTS = Path(__file__).resolve().parent


def test_two_engines_share_one_mooncake_master(tmp_path, tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")
    out = run_in_private_netns(TESTS / "test_mooncake_engine_netns.py", tmp_path / "inner",
                               timeout=860, env={MODEL_ENV: str(model)}, args=("-s",))
    print(next((line for line in out.splitlines() if line.startswith("MOONCAKE-ENGINE ")), out))
