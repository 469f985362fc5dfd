"""The scheduler side of background loads, driving vLLM's own Scheduler (no engine): a hit that
needs a tier that may block is loaded asynchronously (the request waits, its load is sent on its
own), an L1 hit in the step; a background load that fails is recomputed, not looked up and loaded
again forever."""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import FakeLookup, make_request, make_scheduler, model_runner_output, prompt


class SlowLookup(FakeLookup):
    """Every stored chunk is in a tier that may block."""

    def take_slow(self, req_id: str) -> frozenset[int]:
        return frozenset(range(64))


def build(model_dir, lookup):
    s = make_scheduler(model_dir)
    s.connector.scheduler_side.lookup = lookup
    return s, s.connector.scheduler_side


def output(scheduler_output, recving=(), bad=(), failed=None):
    from kvplug.connector.protocol.metadata import KVPlugWorkerMeta
    from vllm.v1.outputs import KVConnectorOutput

    out = model_runner_output(scheduler_output)
    out.kv_connector_output = KVConnectorOutput(
        finished_recving=set(recving), invalid_block_ids=set(bad),
        kv_connector_worker_meta=KVPlugWorkerMeta(num_failed_blocks=failed or {}))
    return out


def stored_request(model_dir, fake):
    """A scheduler over ``fake`` and a 1100-token request whose 4 full chunks are stored."""
    s, side = build(model_dir, fake)
    r = make_request("a", prompt(1100, 1))
    side.track(r)
    fake.stored.update(side.full_hashes(side.trackers["a"], 4))
    return s, side, r


def test_l1_hit_loads_in_the_step(model_dir):
    s, side, r = stored_request(model_dir, FakeLookup())
    assert side.get_num_new_matched_tokens(r, 0) == (1024, False)
    assert side.runs_ahead is None


@pytest.mark.parametrize("engine", [{"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 4},
                                    {"async_scheduling": True}])
def test_an_engine_that_runs_steps_ahead_loads_every_hit_in_the_background(model_dir, engine):
    """vLLM's engine core runs a batch queue of ``max_concurrent_batches`` steps: under pipeline
    parallelism (the plain Scheduler, a queue as deep as the pipeline) and asynchronous
    scheduling, step N+1 runs before step N's load errors reach the scheduler, so an in-step load
    that fails would be read and stored as wrong KV. Every load is a background one there, RAM
    hits included. (Under PP this failed before: the rule looked at asynchronous scheduling only,
    and the L1 hit was ``(1024, False)``, an in-step load.)"""
    s = make_scheduler(model_dir, **engine)
    side, fake = s.connector.scheduler_side, FakeLookup()
    side.lookup = fake
    r = make_request("a", prompt(1100, 1))
    side.track(r)
    fake.stored.update(side.full_hashes(side.trackers["a"], 4))
    assert s.vllm_config.max_concurrent_batches > 1
    assert side.runs_ahead and ("batch queue" in side.runs_ahead)
    assert side.get_num_new_matched_tokens(r, 0) == (1024, True)


@pytest.mark.parametrize("fails", [False, True])
def test_slow_hit_loads_in_the_background(model_dir, fails):
    fake = SlowLookup()
    s, side, r = stored_request(model_dir, fake)
    assert side.get_num_new_matched_tokens(r, 0) == (1024, True)
    s.add_request(r)
    scheduler_output = s.schedule()
    assert scheduler_output.num_scheduled_tokens == {}  # it waits for its load ...
    (rm,) = scheduler_output.kv_connector_metadata.requests  # ... which is sent on its own
    assert (rm.req_id, rm.load.background, rm.load.end, rm.save) == ("a", True, 1024, None)
    s.update_from_output(scheduler_output, output(scheduler_output))
    scheduler_output = s.schedule()  # still loading: nothing is scheduled or sent again
    assert scheduler_output.num_scheduled_tokens == {} and not scheduler_output.kv_connector_metadata.requests
    bad = rm.block_ids[:8] if fails else ()
    s.update_from_output(scheduler_output, output(scheduler_output, {"a"}, bad, {"a": len(bad)} if fails else None))
    scheduler_output = s.schedule()
    # loaded: the rest is computed; failed: everything is, with no second load
    assert scheduler_output.num_scheduled_tokens == {"a": 1100 - 1024 if not fails else 1100}
    assert all(m.load is None for m in scheduler_output.kv_connector_metadata.requests)


class LocalLookup(FakeLookup):
    """Every stored chunk is on a local medium (a posix tier: ``local_medium``)."""

    def take_local(self, req_id: str) -> frozenset[int]:
        return frozenset(range(64))


class MixedLookup(LocalLookup):
    """Every stored chunk is on a local medium, the third also (on another rank) only remote."""

    def take_slow(self, req_id: str) -> frozenset[int]:
        return frozenset({2})


def with_budget(side, hits: float) -> int:
    """Set ``in_step_load_bytes`` to ``hits`` 1024-token hits of this model; the bytes of one."""
    one = 1024 * side.layout.block_bytes // side.block_size
    assert one > 0  # the engine's KV size is known (else nothing could ever fit)
    side.cfg = side.cfg.model_copy(update={"in_step_load_bytes": int(hits * one)})
    return one


def test_local_hits_load_in_the_step_while_its_budget_lasts(model_dir):
    """Disk hits load inside the step as RAM hits do, up to ``in_step_load_bytes`` a step: the
    first hit fits, the second (same step) waits for a background load, and the next step's
    budget is whole again."""
    fake = LocalLookup()
    s, side, a = stored_request(model_dir, fake)
    with_budget(side, 1.5)
    s.add_request(a)
    s.add_request(make_request("b", prompt(1100, 1)))
    scheduler_output = s.schedule()
    assert scheduler_output.num_scheduled_tokens == {"a": 1100 - 1024}  # a loaded in the step; b waits for its load
    loads = {m.req_id: m.load for m in scheduler_output.kv_connector_metadata.requests if m.load is not None}
    assert {r: (load.end, load.background) for r, load in loads.items()} == {
        "a": (1024, False), "b": (1024, True)}
    s.update_from_output(scheduler_output, output(scheduler_output))
    s.add_request(make_request("c", prompt(1100, 1)))
    scheduler_output = s.schedule()
    loads = {m.req_id: m.load for m in scheduler_output.kv_connector_metadata.requests if m.load is not None}
    assert {r: load.background for r, load in loads.items()} == {"c": False}  # a new step's budget
    assert scheduler_output.num_scheduled_tokens.get("c") == 1100 - 1024
    assert side.stats.totals().get("inline_local_loads") == 2


@pytest.mark.parametrize("case", ["budget 0", "one byte short", "a chunk only remote"])
def test_local_hits_past_the_budget_or_with_a_remote_chunk_load_in_the_background(model_dir, case):
    fake = MixedLookup() if case == "a chunk only remote" else LocalLookup()
    s, side, r = stored_request(model_dir, fake)
    one = with_budget(side, 4)
    if case != "a chunk only remote":
        side.cfg = side.cfg.model_copy(update={"in_step_load_bytes": 0 if case == "budget 0"
                                               else one - 1})
    assert side.get_num_new_matched_tokens(r, 0) == (1024, True)
    assert not side.stats.totals().get("inline_local_loads")
