"""Two vLLM engine processes share one Mooncake master through the mooncake tier, which is killed
under their requests and restarted (the scenario and its checks: tests/support/shared_store_engines.py).
Runs only inside a private network namespace (``tests/engine/test_mooncake_engine.py`` starts it under
``unshare -n``, loopback only).

Each engine's client lends the store a segment of its own memory (as in production), so an object
lives in the engine whose segment it was placed in: engine B reads engine A's chunks from A's
memory over TCP after the P2P handshake, and A stays alive until B is done. After the restart the
clients mount their segments again before stores go through (a few of B's requests).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.mooncake_store import MooncakeMaster
from tests.support.shared_store_engines import check, run_engines
from tests.support.vllm_helpers import transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(800)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

MODEL_ENV = "TEST_MOONCAKE_ENGINE_MODEL"  # not KVPLUG_*: conftest clears those for each test


def test_two_engines_share_one_master_killed_and_restarted(tmp_path):
    master = MooncakeMaster(tmp_path / "mooncake")
    options = {"master": master.address, "global_segment_size": "64MiB",
               "local_buffer_size": "32MiB", "timeout_s": 5.0, "negative_cache_s": 0,
               "breaker_backoff_s": 0.2, "breaker_max_backoff_s": 0.5}
    kv = transfer_config("kvplug", {"tiers": [{"backend": "mooncake", "timeout_s": 10.0,
                                               "options": options}]})
    try:
        wa, rb, seen = run_engines(os.environ[MODEL_ENV], kv, "mooncake", tmp_path / "sync",
                                   kill=master.kill, restart=master.restart)
    finally:
        master.stop()
    print("MOONCAKE-ENGINE " + json.dumps(check("mooncake", wa, rb, seen)))
