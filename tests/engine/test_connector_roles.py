"""kv_role on real engines: a producer stores into a shared posix directory, a consumer loads
from it and never stores."""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import kvplug_config, prompt, run_scenario, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout


def test_producer_then_consumer(tmp_path):
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path.parent / "models")  # built once per session
    shared = tmp_path / "shared"
    p = prompt(1400, 7)  # 5 full chunks + a partial one (block aligned: 1408 > 1400 -> 1280+0)
    engine = {"max_num_batched_tokens": 256}
    (prod,) = run_scenario(model, transfer_config("kvplug", kvplug_config(shared, local_cpu=False),
                                                  role="kv_producer"), [("gen", p, None)], engine)
    files = sorted(str(f.relative_to(shared)) for f in shared.rglob("*") if f.is_file())
    assert prod["kvplug"]["stored_tokens"] >= 1280 and prod["kvplug"]["loaded_tokens"] == 0
    # contents, not mtimes: the posix tier bumps a file's mtime on reads (its LRU stamp)
    cons_dir_before = {f: (shared / f).read_bytes() for f in files}
    consumer = transfer_config("kvplug", kvplug_config(shared, local_cpu=False),
                               role="kv_consumer")
    q = prompt(900, 8)
    got, other = run_scenario(model, consumer, [("gen", p, None), ("gen", q, None)], engine)
    assert got["kvplug"]["loaded_tokens"] == 1280
    assert got["kvplug"]["tiers"] == {"posix": 1280}
    assert got["tokens"] == prod["tokens"] and got["logprobs"] == prod["logprobs"]
    assert other["kvplug"]["stored_tokens"] == 0
    after = sorted(str(f.relative_to(shared)) for f in shared.rglob("*") if f.is_file())
    assert after == files  # the consumer wrote nothing
    assert {f: (shared / f).read_bytes() for f in files} == cons_dir_before
