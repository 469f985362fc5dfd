"""Two vLLM engine processes share one redis-server through the resp tier, which is killed under
their requests and restarted (the scenario and its checks: tests/support/shared_store_engines.py).

Engine A stores some prompts' chunks in the server this test started on 127.0.0.1 (the server's
own count is checked: each chunk once); engine B, a separate process, gets exact hits of them
(bit-identical to its own no-cache references and to A's outputs), no hit for a prompt nobody
stored; then the server is killed while B serves, B serves while it is down (misses, dropped
stores, the breaker trips), and after the restart (empty: no persistence) B hits again and A's
chunks, lost, are misses.
"""

from __future__ import annotations

import json

import pytest

from tests.support.redis_server import RedisServer
from tests.support.shared_store_engines import check, run_engines
from tests.support.vllm_helpers import transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout


def test_two_engines_share_one_redis(tmp_path, tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")
    srv = RedisServer(tmp_path / "redis", maxmemory="512mb")
    options = {"url": srv.url, "timeout_s": 5.0, "negative_cache_s": 0,
               "breaker_backoff_s": 0.2, "breaker_max_backoff_s": 0.5}
    kv = transfer_config("kvplug", {"tiers": [{"backend": "resp", "timeout_s": 10.0,
                                               "options": options}]})
    try:
        wa, rb, seen = run_engines(str(model), kv, "resp", tmp_path / "sync", kill=srv.kill,
                                   restart=srv.restart, stored=lambda: srv.client().dbsize())
    finally:
        srv.stop()
    print("RESP-ENGINE " + json.dumps(check("resp", wa, rb, seen)))
