"""Two vLLM engine processes share one KV cache through S3 (moto's server on 127.0.0.1).

The first engine stores a prompt's chunks through local_cpu + fsspec; a second, fresh engine
process (empty L1) loads them from the bucket and must generate bit-identical tokens and logprobs
to the first engine's cold run (same engine configuration: chunked prefill at chunk boundaries,
as in test_connector_engine.py).
"""

from __future__ import annotations

import pytest

from tests.support.s3_server import moto_server, s3  # noqa: F401 - fixtures
from tests.support.vllm_helpers import prompt, run_scenario, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
# vLLM's multi-process layout (tests/conftest.py: _engine_layout): in-process, forked from the
# test session's forkserver, the engine's S3 calls to moto stopped answering on a long-running
# machine (the cold engine's stores never landed, or the warm engine's lookups timed out), while
# the multi-process layout's freshly spawned engine core passes there (2026-11-27; not yet
# classified)
ENGINES_IN_PROCESS = False

CHUNK = 256
P = prompt(1100, 11)  # 4 chunks loadable
CHUNKED = {"max_num_batched_tokens": CHUNK}


def s3_tiers(s3env, local_cpu: bool = True) -> dict:
    tiers = [{"backend": "local_cpu", "options": {"capacity": "256MiB"}}] if local_cpu else []
    tiers.append({"backend": "fsspec", "timeout_s": 10.0,
                  "options": {"url": s3env.url("shared"), "storage_options": s3env.storage_options,
                              "timeout_s": 8.0}})
    # the first lookup builds the S3 client (botocore's models) in the worker's lookup thread,
    # which an in-process engine's busy loop shares the GIL with: on a loaded machine that took
    # past the 2 s default, and a lookup past its timeout is a miss by design
    return {"tiers": tiers, "lookup_timeout_s": 30.0}


def test_second_engine_process_loads_from_s3(s3, tmp_path):  # noqa: F811 - pytest fixture
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path.parent / "models")  # built once per session
    kv = transfer_config("kvplug", s3_tiers(s3))
    (cold,) = run_scenario(model, kv, [("gen", P, None)], CHUNKED)
    assert cold["kvplug"]["stored_tokens"] == 1024
    objects = [p for p in s3.filesystem().find(s3.url("shared")) if p.endswith(".safetensors")]
    assert len(objects) == 4, f"expected 4 chunk objects in the bucket, found {objects}"

    # the second engine: the warm run, then (same process) the control: the same prompt with its
    # first token changed finds nothing, neither in the bucket nor in the L1 the warm run filled
    warm, other = run_scenario(model, kv, [("gen", P, None), ("gen", [P[0] + 1, *P[1:]], None)],
                               CHUNKED)
    assert warm["kvplug"]["loaded_tokens"] == 1024, warm["kvplug"]
    assert warm["kvplug"]["tiers"] == {"fsspec": 1024}
    assert warm["tokens"] == cold["tokens"] and warm["logprobs"] == cold["logprobs"]
    assert other["kvplug"]["loaded_tokens"] == 0
    assert other["kvplug"]["lookup_hit_tokens"] == 0
    assert other["tokens"] != cold["tokens"] or other["logprobs"] != cold["logprobs"]
