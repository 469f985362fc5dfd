"""scripts/pd_proxy.py, the README's disaggregated-prefill proxy: what it sends each engine (the
whole path, two ``kvplug serve`` engines behind it, is the README's recipe; its engine-side
half is tests/engine/test_pd_engines.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pd_proxy.py"


def proxy():
    spec = importlib.util.spec_from_file_location("pd_proxy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prefill_asks_one_token_and_decode_gets_the_prefills_params():
    p = proxy()
    body = {"model": "m", "prompt": "hello", "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 64,
            "kv_transfer_params": {"kvplug_load": True}, "cache_salt": "s"}
    pre = p.prefill_body(body)
    assert (pre["max_tokens"], pre["max_completion_tokens"], pre["stream"]) == (1, 1, False)
    assert "stream_options" not in pre and pre["cache_salt"] == "s"
    assert pre["kv_transfer_params"] == {"kvplug_load": True, "do_remote_decode": True}
    handoff = {"kvplug_handoff": {"v": 1, "tokens": 2816}}
    dec = p.decode_body(body, {"kv_transfer_params": handoff, "choices": []})
    assert dec["kv_transfer_params"] == {"kvplug_load": True, **handoff}
    assert dec["max_tokens"] == 64 and dec["stream"] and dec["cache_salt"] == "s"
    assert body["max_tokens"] == 64 and body["kv_transfer_params"] == {"kvplug_load": True}
    # a prefill engine that names nothing (kv_both, or a request it did not store)
    assert "kv_transfer_params" not in p.decode_body({"prompt": "x"}, {"kv_transfer_params": None})
