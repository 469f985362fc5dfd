"""Disaggregated prefill's hand-off (kvplug.connector.scheduler.handoff), driving vLLM's own
Scheduler on both sides (no engine): a producer names in ``kv_transfer_params`` what it stores
of each request; a consumer given those parameters asks vLLM to ask again (never blocking a step)
until a lookup finds every named chunk or its wait is over, then loads what is there."""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import FakeLookup, make_request, make_scheduler, model_runner_output, prompt

KEY = "kvplug_handoff"
BLOCK, CHUNK = 128, 256


def produce(model_dir, tokens, role="kv_producer", extra=None, params=None):
    """A prefill (max_tokens=1) on a producer to its end: (its kv_transfer_params, the hashes
    it sent to be stored, in order). The per-request report is off unless ``extra`` says."""
    s = make_scheduler(model_dir, role=role, extra={"report_to_client": False, **(extra or {})})
    s.connector.scheduler_side.lookup = FakeLookup()
    s.add_request(make_request("p", tokens, max_tokens=1, kv_transfer_params=params))
    saved, out = [], None
    while s.requests:
        scheduler_output = s.schedule()
        saved += [h for m in scheduler_output.kv_connector_metadata.requests if m.save for h in m.save.hashes]
        for outs in s.update_from_output(scheduler_output, model_runner_output(scheduler_output)).values():
            out = next((o.kv_transfer_params for o in outs.outputs if o.finished), out)
    return out, saved


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def consumer(model_dir, extra=None):
    s = make_scheduler(model_dir, role="kv_consumer", extra=extra)
    side, fake, clock = s.connector.scheduler_side, FakeLookup(), Clock()
    side.lookup, side.clock = fake, clock
    return s, side, fake, clock


def step(s, paused=None):
    """One engine step; what it scheduled: {request: (tokens vLLM computes, load spec)}.
    ``paused``: a list told whether the step's metadata asks an idle step to pause."""
    scheduler_output = s.schedule()
    metadata = scheduler_output.kv_connector_metadata
    loads = {m.req_id: m.load for m in metadata.requests}
    if paused is not None:
        paused.append(metadata.handoffs)
    s.update_from_output(scheduler_output, model_runner_output(scheduler_output))
    return {r: (n, loads.get(r)) for r, n in scheduler_output.num_scheduled_tokens.items()}


@pytest.mark.parametrize("report", [False, True])
def test_producer_names_what_it_stores_whatever_report_to_client(model_dir, report):
    tokens = prompt(1100, 1)
    params, saved = produce(model_dir, tokens, extra={"report_to_client": report},
                            params={"do_remote_decode": True})
    offer = params[KEY]
    # every block but the one with the last token: what a consumer of this prompt looks up
    assert offer["tokens"] == (1100 - 1) // BLOCK * BLOCK == 1024
    assert bytes.fromhex(offer["hash"]) == saved[-1]  # the chunk ending there: it was stored
    assert len(saved) == 4 and offer["v"] == 1 and offer["ttl_s"] == 10.0
    assert len(offer["keys"]) == 16 and offer["tiers"] == ["local_cpu", "posix"]
    assert ("kvplug" in params) is report  # the per-request report stays behind its switch
    # a partial last chunk: named by its own hash, which chains over the full ones
    params, saved = produce(model_dir, prompt(1200, 2))
    assert params[KEY]["tokens"] == 1152 and bytes.fromhex(params[KEY]["hash"]) == saved[-1]
    assert set(params) == {KEY}


def test_only_a_producer_offers_and_not_for_a_request_it_does_not_store(model_dir):
    assert produce(model_dir, prompt(1100, 1), role="kv_both")[0] is None
    params, saved = produce(model_dir, prompt(1100, 1), params={"kvplug_save": False})
    assert params is None and saved == []
    assert produce(model_dir, prompt(100, 1))[0] is None  # no block but the last: nothing


def test_consumer_waits_without_blocking_a_step_then_loads_all(model_dir):
    tokens = prompt(1100, 3)
    params, saved = produce(model_dir, tokens)
    s, side, fake, clock = consumer(model_dir)
    s.add_request(make_request("d", tokens, kv_transfer_params=params))
    polls, paused = [], []
    for _ in range(40):  # 40 engine steps, 1 ms apart: none schedules it, few look it up
        assert step(s, paused) == {}
        polls.append(len(fake.calls))
        clock.now += 0.001
    assert all(paused)  # idle steps while it waits: the workers pause them a little
    assert 4 <= polls[-1] <= 8, polls  # spaced 2, 4, 8... ms: most steps send no lookup
    assert polls[0] == 1 and all(fake.fresh)  # at once, and no tier answers from a stale miss
    assert side.trackers["d"].asking is False and fake.released.count("d") == polls[-1]
    fake.stored.update(saved[:2])  # half of it landed: still waiting
    clock.now += 0.1
    assert step(s) == {}
    fake.stored.update(saved[2:])
    clock.now += 0.1
    (n, load), = step(s, paused).values()
    assert (load.start, load.end, len(load.hashes)) == (0, 1024, 4) and n == 1100 - 1024
    assert paused[-1] is False  # nothing waits now (and the step computes)
    report = side.trackers["d"].report["handoff"]
    assert report["outcome"] == "ready" and report["tokens"] == 1024
    assert side.stats.totals()["handoff_ready"] == 1 == side.stats.totals()["handoff_waits"]
    assert side.stats.totals()["lookups"] == 1  # the polls are not counted as lookups


def test_deadline_passes_then_loads_what_is_there_and_computes_the_rest(model_dir):
    tokens = prompt(1100, 4)
    params, saved = produce(model_dir, tokens)
    s, side, fake, clock = consumer(model_dir, extra={"handoff_wait_s": 0.5})  # < the offered 10
    fake.stored.update(saved[:2])  # the producer died after two chunks
    s.add_request(make_request("d", tokens, kv_transfer_params=params))
    assert step(s) == {}
    clock.now += 0.4
    assert step(s) == {}
    clock.now += 0.2  # past the consumer's own bound
    (n, load), = step(s).values()
    assert (load.start, load.end) == (0, 512) and n == 1100 - 512
    assert side.trackers["d"].report["handoff"]["outcome"] == "expired"
    assert side.stats.totals()["handoff_expired"] == 1


def test_a_request_vllm_already_holds_does_not_wait(model_dir):
    tokens = prompt(1100, 5)
    params, _ = produce(model_dir, tokens)
    s, side, fake, clock = consumer(model_dir)
    r = make_request("d", tokens, kv_transfer_params=params)
    side.track(r)
    assert side.get_num_new_matched_tokens(r, 1024) == (0, False)  # vLLM's own cache has it


def tampered(params, **change):
    return {**params, KEY: {**params[KEY], **change}}


@pytest.mark.parametrize("why", ["other_prompt", "other_keys", "bad_hash", "bad_tokens",
                                 "bad_ttl", "other_version", "not_a_dict"])
def test_a_hand_off_that_does_not_match_is_ignored(model_dir, why):
    """A hand-off for another prompt or other keys, or one that does not parse (it comes from a
    client), never makes a request wait: it is scheduled in the first step (a miss here)."""
    tokens = prompt(1100, 6)
    params, _ = produce(model_dir, tokens)
    given = {"other_prompt": params, "other_keys": tampered(params, keys="0" * 16),
             "bad_hash": tampered(params, hash="zz" * 32), "bad_tokens": tampered(params,
                                                                                  tokens="1024"),
             "bad_ttl": tampered(params, ttl_s=float("nan")),
             "other_version": tampered(params, v=2), "not_a_dict": {KEY: [1024]}}[why]
    s, side, fake, clock = consumer(model_dir)
    asked = prompt(1100, 7) if why == "other_prompt" else tokens
    s.add_request(make_request("d", asked, kv_transfer_params=given))
    assert list(step(s)) == ["d"]
    assert side.stats.totals()["handoff_ignored"] == 1
    assert side.trackers["d"].report["handoff"]["outcome"] == "ignored"
    # the control: the untampered hand-off for this prompt waits
    s, side, fake, clock = consumer(model_dir)
    s.add_request(make_request("e", tokens, kv_transfer_params=params))
    assert step(s) == {}


def test_a_consumer_that_may_not_load_never_waits(model_dir):
    tokens = prompt(1100, 8)
    params, _ = produce(model_dir, tokens)
    s, side, fake, clock = consumer(model_dir)
    s.add_request(make_request("d", tokens, kv_transfer_params={**params, "kvplug_load": False}))
    assert list(step(s)) == ["d"] and fake.calls == []
    s, side, fake, clock = consumer(model_dir, extra={"handoff_wait_s": 0})
    s.add_request(make_request("e", tokens, kv_transfer_params=params))
    assert list(step(s)) == ["e"] and fake.fresh and not any(fake.fresh)


def test_an_aborted_wait_leaves_no_pins_or_state(model_dir):
    from vllm.v1.request import RequestStatus

    tokens = prompt(1100, 9)
    params, _ = produce(model_dir, tokens)
    s, side, fake, clock = consumer(model_dir)
    s.add_request(make_request("d", tokens, kv_transfer_params=params))
    assert step(s) == {}
    s.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert "d" not in side.trackers and not s.requests
    assert fake.released.count("d") == len(fake.calls)  # every lookup's pins released


def test_a_consumers_lookup_of_named_chunks_skips_its_tiers_remembered_misses():
    """The worker side: a lookup marked ``fresh`` (a hand-off's chunks) is answered by the
    store, not by a miss the tier remembers; two workers (engines) on one shared tier (fsspec,
    in memory), the consumer's negative cache lasting a minute."""
    import hashlib
    import uuid

    import fsspec
    import torch
    from kvplug.connector.protocol.config import ConnectorConfig
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.protocol.lookup import Lookup
    from kvplug.connector.protocol.metadata import KVPlugMetadata, ReqMeta, SaveSpec
    from kvplug.connector.worker.side import WorkerSide

    from tests.support.gpu_kv_fixture import KVFixture

    block_size, chunk_size = 4, 8
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    url = f"memory://handoff-{uuid.uuid4().hex[:8]}"

    def worker(negative_cache_s):
        cfg = ConnectorConfig(chunk_size=chunk_size, log_every_load=False, async_save=False,
                              tiers=[{"backend": "fsspec", "options": {
                                  "url": url, "negative_cache_s": negative_cache_s}}])
        w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{block_size}", 1, 0, f"h-{uuid.uuid4().hex[:8]}"))
        w.register_kv_caches(KVFixture("LBHNC", torch.bfloat16, L=2, B=8).caches)
        return w

    producer, consumer = worker(0.0), worker(60.0)
    try:
        assert consumer._on_lookup(Lookup(1, "d", hashes))[0] == 0  # before: a miss, remembered
        producer.wait_for_save(KVPlugMetadata(chunk_size, block_size, [ReqMeta("p", [1, 2, 3, 4, 5, 6],
                                                                               save=SaveSpec(0, 24, 0, hashes))]))
        assert producer.storage.flush(10)
        assert consumer._on_lookup(Lookup(2, "d", hashes))[0] == 0  # the control: remembered
        assert consumer._on_lookup(Lookup(3, "d", hashes, fresh=True))[0] == 24
        consumer.release(["d"])
    finally:
        producer.close()
        consumer.close()
        fsspec.filesystem("memory").rm(url, recursive=True)


def test_an_idle_step_pauses_while_requests_wait_for_a_producer():
    """The worker side of ``KVPlugMetadata.handoffs``: an idle step that has nothing to report
    waits a little on the runtime (the control: without it, no wait)."""
    import threading
    import uuid

    import torch
    from kvplug.connector.protocol.config import ConnectorConfig
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.worker.side import HANDOFF_PAUSE_S, WorkerSide
    from kvplug.runtime import Runtime

    from tests.support.gpu_kv_fixture import KVFixture

    class Recording(Runtime):
        waits: list[float] = []

        def event(self):
            waits = self.waits

            class Event(threading.Event):
                def wait(self, timeout=None):
                    waits.append(timeout)
                    return super().wait(0)

            return Event()

    runtime = Recording()
    cfg = ConnectorConfig(chunk_size=8, log_every_load=False, async_save=False,
                          tiers=[{"backend": "local_cpu", "options": {"capacity": "8MiB"}}])
    w = WorkerSide(cfg, Identity("m", "LBHNC-bs4", 1, 0, f"p-{uuid.uuid4().hex[:8]}"),
                   runtime=runtime)
    w.register_kv_caches(KVFixture("LBHNC", torch.bfloat16, L=2, B=8).caches)
    try:
        runtime.waits.clear()
        assert w.get_finished(set(), idle=True) == (set(), set()) and runtime.waits == []
        assert w.get_finished(set(), idle=True, pause=True) == (set(), set())
        assert runtime.waits == [HANDOFF_PAUSE_S]
    finally:
        w.close()
