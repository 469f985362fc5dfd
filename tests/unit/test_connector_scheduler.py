"""Scheduler-side decisions, driving vLLM's own Scheduler with kvplug's connector (no engine)."""

from __future__ import annotations

from tests.support.vllm_helpers import FakeLookup, make_request, make_scheduler, model_runner_output, prompt


def build(model_dir, **kw):
    s = make_scheduler(model_dir, **kw)
    fake = FakeLookup()
    side = s.connector.scheduler_side
    side.lookup = fake
    return s, side, fake


def store_all(side, fake, req_id):
    """Mark every full chunk of a tracked request as stored."""
    t = side.trackers[req_id]
    fake.stored.update(side.full_hashes(t, t.request.num_tokens // 256))


def step(s):
    scheduler_output = s.schedule()
    metadata = scheduler_output.kv_connector_metadata
    s.update_from_output(scheduler_output, model_runner_output(scheduler_output))
    return scheduler_output, metadata


def test_miss_then_store_plan(model_dir):
    s, side, fake = build(model_dir)
    s.add_request(make_request("a", prompt(1100, 1)))
    scheduler_output, metadata = step(s)
    (rm,) = metadata.requests
    assert rm.load is None
    assert (rm.save.start, rm.save.end, len(rm.save.hashes)) == (0, 1024, 4)  # partial dropped
    assert rm.block_ids == scheduler_output.scheduled_new_reqs[0].block_ids[0]
    _, metadata = step(s)  # decode: nothing more to store by default
    assert not metadata.requests


def test_hit_is_chunk_aligned_capped_and_side_effect_free(model_dir):
    s, side, fake = build(model_dir)
    tokens = prompt(1024, 2)  # exactly 4 chunks: at most 3 may load (one token must be computed)
    r = make_request("b", tokens)
    side.track(r)
    store_all(side, fake, "b")
    first = side.get_num_new_matched_tokens(r, 0)
    again = side.get_num_new_matched_tokens(r, 0)
    assert first == again == (768, False)
    assert side.get_num_new_matched_tokens(r, 512) == (256, False)  # beyond vLLM's own hit
    assert side.get_num_new_matched_tokens(r, 896) == (0, False)


def test_load_spec_and_skip_of_stored_chunks(model_dir):
    s, side, fake = build(model_dir)
    tokens = prompt(1300, 3)
    r = make_request("c", tokens)
    side.track(r)
    fake.stored.update(side.full_hashes(side.trackers["c"], 3))  # 3 of 5 chunks stored
    s.add_request(r)
    scheduler_output, metadata = step(s)
    (rm,) = metadata.requests
    assert (rm.load.start, rm.load.end, rm.load.first_chunk, len(rm.load.hashes)) == (0, 768, 0, 3)
    assert scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 768
    assert (rm.save.start, rm.save.end) == (768, 1280)  # what lookup found is not stored again


def test_chunk_hashes_are_vllms_block_hashes(model_dir):
    """The hashes the scheduler looks up and stores under are what vLLM's own block hasher gives
    (chunk = block = 256 tokens), for the prompt and for a chunk completed while decoding."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    s, side, fake = build(model_dir, block_size=256, extra={"save_decode": True})
    r = make_request("v", prompt(1100, 10), max_tokens=300,
                     block_hasher=get_request_block_hasher(256, sha256_cbor))
    vllm_hashes = [bytes(h) for h in r.block_hashes]
    assert len(vllm_hashes) == 4
    fake.stored.update(vllm_hashes[:3])
    s.add_request(r)
    _, metadata = step(s)
    (rm,) = metadata.requests
    assert rm.load.hashes == vllm_hashes[:3]  # lookup found exactly what vLLM's hashes name
    assert rm.save.hashes == vllm_hashes[3:]
    saved = []
    while s.requests:
        _, metadata = step(s)
        saved += [h for m in metadata.requests for h in m.save.hashes]
    assert saved and saved[0] == bytes(r.block_hashes[4])  # [1024, 1280) completed in decode


def test_short_prompt_asks_nothing(model_dir):
    s, side, fake = build(model_dir, extra={"save_partial_chunk": False})  # chunk granular
    s.add_request(make_request("d", prompt(200, 4)))
    _, metadata = step(s)
    assert fake.calls == [("d", 0)] or fake.calls == []
    assert not metadata.requests


def test_partial_chunk_and_decode_saving_by_config(model_dir):
    s, side, fake = build(model_dir, extra={"save_partial_chunk": True, "save_decode": True})
    s.add_request(make_request("e", prompt(1200, 5), max_tokens=200))
    _, metadata = step(s)
    (rm,) = metadata.requests
    # 4 full chunks + the block-aligned partial chunk [1024, 1152)
    assert (rm.save.start, rm.save.end, len(rm.save.hashes)) == (0, 1152, 5)
    saved = []
    for _ in range(200):
        _, metadata = step(s)
        for m in metadata.requests:
            saved.append((m.save.start, m.save.end))
        if not s.requests:
            break
    assert (1024, 1280) in saved  # the chunk completed while decoding


def test_opt_out_and_roles(model_dir):
    s, side, fake = build(model_dir)
    r = make_request("f", prompt(1100, 6), kv_transfer_params={"kvplug_save": False,
                                                               "kvplug_load": False})
    s.add_request(r)
    _, metadata = step(s)
    assert not metadata.requests and fake.calls == []
    s, side, fake = build(model_dir, role="kv_consumer")
    s.add_request(make_request("g", prompt(1100, 7)))
    _, metadata = step(s)
    assert not metadata.requests  # a consumer never stores
    s, side, fake = build(model_dir, role="kv_producer")
    s.add_request(make_request("h", prompt(1100, 8)))
    _, metadata = step(s)
    assert fake.calls == []  # a producer never loads
    assert metadata.requests[0].save.end == 1024


def test_multimodal_inputs_change_the_keys(model_dir):
    from types import SimpleNamespace

    from kvplug.connector.protocol.identity import chunk_extra_keys

    tokens = prompt(600, 9)
    img = lambda h: SimpleNamespace(identifier=h, mm_position=SimpleNamespace(offset=300, length=100))  # noqa: E731,E501
    r1 = SimpleNamespace(mm_features=[img("imgA")], lora_request=None, cache_salt=None)
    r2 = SimpleNamespace(mm_features=[img("imgB")], lora_request=None, cache_salt=None)
    assert chunk_extra_keys(r1, 0, 256) is None  # the image is not in chunk 0
    assert chunk_extra_keys(r1, 256, 512) != chunk_extra_keys(r2, 256, 512)
    s, side, fake = build(model_dir)
    a, b = make_request("i", tokens), make_request("j", tokens)
    a.mm_features, b.mm_features = r1.mm_features, r2.mm_features
    ha = side.full_hashes(side.track(a), 2)
    hb = side.full_hashes(side.track(b), 2)
    assert ha[0] == hb[0] and ha[1] != hb[1]


def test_stats_aggregate_and_reduce():
    from kvplug.connector import KVPlugConnector
    from kvplug.connector.protocol.stats import KVPlugStats

    a, b = KVPlugStats(), KVPlugStats()
    a.add("load_bytes", 2e9)
    a.add("load_seconds", 1.0)
    a.add("tier_hit_tokens.posix", 256)
    b.add("load_bytes", 2e9)
    b.add("load_seconds", 1.0)
    b.add("lookup_query_tokens", 1000)
    b.add("lookup_hit_tokens", 250)
    merged = KVPlugConnector.build_kv_connector_stats(a.aggregate(b).to_dict())
    red = merged.reduce()
    assert red["load_GBps"] == 2.0 and red["hit_rate"] == 0.25
    assert red["hit_tokens_posix"] == 256
    assert KVPlugStats().is_empty() and not merged.is_empty()


def test_a_prompt_vllm_holds_is_never_held_back_by_an_unanswered_lookup(model_dir):
    """vLLM's own prefix cache covers the prompt; the tiers' lookup (which only spares a second
    copy) has not answered: the request is scheduled now (0, not "ask again") and its lookup
    is released. Control: the same unanswered lookup for a prompt vLLM does not hold asks again."""
    s, side, fake = build(model_dir)
    fake.lookup = lambda req_id, hashes, tails: None  # the workers have not answered yet
    r = make_request("held", prompt(1100, 7))
    side.track(r)
    assert side.get_num_new_matched_tokens(r, 1088) == (0, False)
    assert fake.released == ["held"]
    other = make_request("cold", prompt(1100, 8))
    side.track(other)
    assert side.get_num_new_matched_tokens(other, 0) == (None, False)
    assert fake.released == ["held"]


def test_eagle_drafter_hit_ends_a_block_early_and_decode_stores_a_block_behind(model_dir):
    """An EAGLE/MTP drafter's KV at a position depends on the next token: the last block of a
    hit is recomputed (its chunk is fetched, only the blocks before it written), and decode KV
    is stored one block behind what is computed (the drafter may rewrite the last accepted
    position). The engine test (test_connector_engine_spec.py) runs it end to end."""
    from kvplug.connector.worker.load import plan_load

    s, side, fake = build(model_dir, extra={"save_decode": True})
    side.drop_last_block = True  # compat.drops_last_block(vllm_config) with an EAGLE drafter
    r = make_request("c", prompt(1300, 3), max_tokens=500)
    side.track(r)
    fake.stored.update(side.full_hashes(side.trackers["c"], 3))  # 3 of 5 chunks stored
    s.add_request(r)
    scheduler_output, metadata = step(s)
    (rm,) = metadata.requests
    assert (rm.load.start, rm.load.end, rm.load.upto, len(rm.load.hashes)) == (0, 768, 640, 3)
    assert scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 640  # the last block recomputed
    assert (rm.save.start, rm.save.end) == (768, 1280)  # what lookup found is not stored again
    plan = plan_load(metadata, rm, lambda h: h, lambda k: "local_cpu")
    assert [(c.start, c.end, c.block_ids) for c in plan.chunks] == [
        (0, 256, rm.block_ids[0:2]), (256, 512, rm.block_ids[2:4]), (512, 768, rm.block_ids[4:5])]
    assert plan.fail_at is None
    saved_at = {}
    for _ in range(500):
        computed = r.num_computed_tokens
        _, metadata = step(s)
        for m in metadata.requests:
            saved_at[(m.save.start, m.save.end)] = computed
        if not s.requests:
            break
    # chunk [1280, 1536) is complete in the step that computes token 1535 (without a drafter
    # it is stored in that step); here a block later
    assert saved_at[(1280, 1536)] == 1536 + 128, saved_at


def test_a_preempted_requests_old_block_table_names_no_blocks(model_dir):
    """Priority scheduling preempts ``a`` (low priority) for ``b``, which then grows into a's
    freed blocks (b: [1, 2, 3, 4, 5, 11, 10, 9], a's old table [6, 7, 8, 9, 10]). A load error on
    b's last block 9 must mark only it: through a's stale table it marked block 10 as well, a
    block b wrote itself (before: ``unwritten.blocks == {9, 10}``, so b's next steps reading
    block 10 got a spurious load error and were recomputed)."""
    s, side, _ = build(model_dir, block_size=16, num_blocks=12, max_num_batched_tokens=512,
                       scheduling_policy="priority")
    s.add_request(make_request("a", prompt(80, 1), max_tokens=40, priority=5))
    s.add_request(make_request("b", prompt(80, 2), max_tokens=40, priority=0))
    old_a: list[int] = []
    preempted = False
    for _ in range(60):
        t = side.trackers.get("a")
        old_a = (list(t.block_ids) if t is not None else []) or old_a
        scheduler_output, _ = step(s)
        preempted = preempted or "a" in scheduler_output.preempted_req_ids
        table = s.kv_cache_manager.get_block_ids("b")[0]
        if preempted and len(set(table) & set(old_a)) >= 2:
            break
    assert preempted and side.trackers["a"].block_ids == []
    reused = [b for b in table if b in old_a]
    assert old_a.index(reused[-1]) < old_a.index(reused[-2])  # a's order differs from b's
    side.update_connector_output(None, invalid_blocks={table[-1]})
    assert side.unwritten.blocks == {table[-1]}


def test_the_lookup_protocol_declares_every_member_the_scheduler_side_uses():
    """SchedulerSide asks its lookup only for what ``LookupFn`` declares (no probing by name);
    a stand-in with the two required members gets the declared defaults, a full lookup its own."""
    import inspect
    import re

    from kvplug.connector.scheduler.side import LookupFn, SchedulerSide, lookup_member

    src = inspect.getsource(SchedulerSide)
    used = set(re.findall(r'lookup_member\(self\.lookup, "(\w+)"\)', src))
    used |= set(re.findall(r"self\.lookup\.(\w+)\(", src))
    declared = {n for n in vars(LookupFn) if not n.startswith("_")}
    assert used == declared == {"lookup", "release", "timeouts", "set_epoch", "take_slow",
                                "take_local"}
    assert "getattr(self.lookup" not in src

    two = FakeLookup()
    assert lookup_member(two, "timeouts") == 0
    assert (lookup_member(two, "take_slow")("r"), lookup_member(two, "take_local")("r")) == ((), ())
    assert lookup_member(two, "set_epoch")("e1") is None

    class Full(FakeLookup):
        timeouts = 3

        def take_slow(self, req_id):
            return frozenset({2})

    assert lookup_member(Full(), "timeouts") == 3
    assert lookup_member(Full(), "take_slow")("r") == frozenset({2})
