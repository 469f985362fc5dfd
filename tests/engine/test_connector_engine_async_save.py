"""Asynchronous saves on a real vLLM engine (CPU): what the save thread stores is exact, and an
engine that shuts down right after a request has every save of it on disk.

Like with like (see tests/engine/test_connector_engine.py): the cold reference is the same engine with
chunked prefill cut at kvplug's chunk boundaries, so only kvplug's hit differs."""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import kvplug_config, prompt, run_scenario, same_output, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

CHUNK = 256
P = prompt(1600, 11)  # 6 chunks (1536 tokens) loadable
CHUNKED = {"max_num_batched_tokens": CHUNK}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


def test_async_saves_are_exact_and_on_disk_at_shutdown(model, tmp_path):
    kv = transfer_config("kvplug", kvplug_config(tmp_path, async_save=True))
    cold, warm, other = run_scenario(
        model, kv, [("gen", P, None), ("gen", P, None), ("gen", [P[0] + 1, *P[1:]], None)],
        CHUNKED)
    assert warm["kvplug"]["loaded_tokens"] == 1536  # from L1, stored by the save thread
    assert same_output(warm, cold)
    assert not same_output(other, cold)  # control: the output depends on the prompt's KV
    # a fresh engine (the first one shut down right after its last request): from posix
    (again,) = run_scenario(model, kv, [("gen", P, None)], CHUNKED)
    assert again["kvplug"]["loaded_tokens"] == 1536 and again["kvplug"]["tiers"] == {"posix": 1536}
    assert same_output(again, cold)
