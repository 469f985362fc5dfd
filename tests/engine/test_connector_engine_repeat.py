"""A repeated prompt on a real engine with vLLM's own prefix cache on: the repeat is served by
vLLM's local hit and kvplug stores nothing the second time (worker stats); the per-request report
stays out of the client's ``kv_transfer_params`` with the default config."""

from __future__ import annotations

import json

import pytest

from tests.support.vllm_helpers import REPO, kvplug_config, prompt, run_script, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)

STORE_KEYS = ("stores", "store_tokens", "store_bytes")


def store_totals(worker) -> dict[str, int]:
    """Runs in each worker (``collective_rpc``): kvplug's store counters since start."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    totals = get_kv_transfer_group()._worker.stats.totals()
    return {k: int(totals.get(k, 0)) for k in STORE_KEYS}


def _run(model, kv, tokens):
    spec = json.dumps({"model": str(model), "kv": kv, "tokens": tokens})
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO)!r}); "
            "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'; "
            "from tests.support import vllm_helpers as h; "
            "from tests.engine.test_connector_engine_repeat import store_totals; "
            f"s = json.loads({spec!r}); "
            "llm = h.make_llm(s['model'], s['kv'], enable_prefix_caching=True); out = []\n"
            "for _ in range(2):\n"
            "    r = h.generate_full(llm, [s['tokens']])[0]\n"
            "    out.append({'cached': r['cached'], 'kvplug': r['kvplug'],\n"
            "                'stats': llm.collective_rpc(store_totals)[0]})\n"
            "print(h.RESULT + json.dumps(out), flush=True)")
    return run_script(code, timeout=900)


def test_repeat_with_local_prefix_hit_stores_nothing(tmp_path):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path.parent / "models")  # built once per session
    kv = transfer_config("kvplug", kvplug_config(tmp_path / "store"))
    del kv["kv_connector_extra_config"]["report_to_client"]  # the default config
    first, second = _run(model, kv, prompt(1000, 31))
    # the control: the first request stores its 3 full chunks and the block-aligned partial one
    # up to where vLLM's own prefix cache stops reusing the prompt ((1000 - 1) // 128 * 128)
    assert first["stats"]["stores"] == 1 and first["stats"]["store_tokens"] == 896
    assert first["stats"]["store_bytes"] > 0
    assert second["cached"] == 896  # vLLM's own prefix cache serves the repeat
    assert second["stats"] == first["stats"]  # ... and kvplug copies nothing out again
    assert first["kvplug"] is None and second["kvplug"] is None  # no report by default
