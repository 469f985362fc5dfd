"""Block-granular hits and multi-turn chat with the default configuration, driving vLLM's own
Scheduler (no engine): kvplug's hit equals what vLLM's own prefix cache reuses, on an identical
prompt and on each turn of a chat (turn N+1 = turn N's prompt + answer + a new message)."""

from __future__ import annotations

import pytest

from tests.support.vllm_helpers import FakeLookup, make_request, make_scheduler, model_runner_output, prompt

BS = 16  # vLLM block size here; kvplug's chunk is 256


def request(req_id, tokens, **kw):
    """A request with vLLM's block hasher (its own prefix cache needs the block hashes)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    return make_request(req_id, tokens, block_hasher=get_request_block_hasher(BS, sha256_cbor),
                        **kw)


def build(model_dir, native=False, **kw):
    """kvplug's scheduler (vLLM's prefix cache off), or with ``native`` vLLM's prefix cache on
    and a kvplug that never stores: its requests' local hits are the reference."""
    s = make_scheduler(model_dir, block_size=BS, num_blocks=400, prefix_caching=native, **kw)
    fake = FakeLookup()
    s.connector.scheduler_side.lookup = fake
    return s, fake, native


def run(sched, req):
    """Run ``req`` to the end as the workers would: store every save, report a finished
    request's last save as sent. Returns (tokens computed before its first step, the saves as
    (start, end, finished), the request)."""
    from vllm.v1.outputs import KVConnectorOutput

    s, fake, native = sched
    s.add_request(req)
    hit, saves = None, []
    while s.requests:
        scheduler_output = s.schedule()
        for nr in scheduler_output.scheduled_new_reqs:
            hit = nr.num_computed_tokens
        sent = set()
        for m in scheduler_output.kv_connector_metadata.requests:
            if m.save is not None and not native:
                saves.append((m.save.start, m.save.end, m.finished))
                fake.stored.update(m.save.hashes)
            if m.finished:
                sent.add(m.req_id)
        out = model_runner_output(scheduler_output)
        out.kv_connector_output = KVConnectorOutput(finished_sending=sent or None)
        s.update_from_output(scheduler_output, out)
    return hit, saves, req


@pytest.mark.parametrize("n", [1100, 1024, 1040, 1041, 1153, 200, 16 * 70])
def test_identical_prompt_hits_what_vllms_prefix_cache_reuses(model_dir, n):
    """Before: 1024 (chunk granular) for 1100, 1153; 768 for 1024; 0 for 200 and 1120 -> 1024."""
    tokens = prompt(n, n)
    hits = []
    for native in (False, True):
        sched = build(model_dir, native=native)
        run(sched, request("first", tokens))
        hits.append(run(sched, request("again", tokens))[0])
    assert hits == [(n - 1) // BS * BS] * 2


def test_chunk_aligned_prompt_stores_the_reusable_partial_then_the_full_chunk(model_dir):
    sched = build(model_dir)
    _, saves, _ = run(sched, request("a", prompt(1024, 3), max_tokens=3))
    # prefill: 3 full chunks + [768, 1008) (vLLM reuses at most 1008 of 1024); then chunk 3 whole
    assert saves == [(0, 1008, False), (768, 1024, False)]


def chat(model_dir, native, turns, answer, message, change_at=None):
    """A chat of ``turns`` turns; returns each turn's (hit, prompt length, saves)."""
    sched = build(model_dir, native=native)
    history = prompt(700, 1)
    out = []
    for i in range(turns):
        tokens = list(history)
        if change_at is not None and i == turns - 1:
            tokens[change_at] += 1  # an edited earlier message: the hit stops there
        hit, saves, req = run(sched, request(f"turn{i}", tokens, max_tokens=answer))
        out.append((hit, len(tokens), saves))
        history = tokens + list(req.output_token_ids) + prompt(message, 100 + i)
    return out


def test_each_turn_reuses_the_previous_prompt_and_answer(model_dir):
    kv = chat(model_dir, False, 3, answer=60, message=240)
    native = chat(model_dir, True, 3, answer=60, message=240)
    # turn N's prompt + answer: its KV is computed up to the last answer token (exclusive)
    want = [0] + [(n + 60 - 1) // BS * BS for _, n, _ in kv[:-1]]
    assert [h for h, _, _ in kv] == [h for h, _, _ in native] == want == [0, 752, 1056]
    # turn 1 (700 tokens): the prompt's reusable end, then prompt+answer's last full block; turn 2
    # (1000) loads [0, 752), stores from chunk 2 on, chunk 3 while decoding, then [1024, 1056)
    assert kv[0][2] == [(0, 688, False), (512, 752, True)]
    assert kv[1][2] == [(512, 992, False), (768, 1024, False), (1024, 1056, True)]


@pytest.mark.parametrize("at, want", [(600, 512), (300, 256)])
def test_a_changed_token_cuts_the_hit_there(model_dir, at, want):
    """Control: turn 2 with a token of turn 1 changed: no partial chunk matches across it, so the
    hit ends at its chunk (vLLM's own cache keeps the blocks before it: at most a chunk more)."""
    kv = chat(model_dir, False, 2, answer=60, message=240, change_at=at)
    native = chat(model_dir, True, 2, answer=60, message=240, change_at=at)
    assert kv[1][0] == want
    assert native[1][0] == at // BS * BS


def test_finished_request_keeps_its_blocks_until_its_last_save_is_sent(model_dir):
    from vllm.v1.outputs import KVConnectorOutput

    s, fake, _ = build(model_dir)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.add_request(request("r", prompt(700, 5), max_tokens=60))
    finals = []
    for _ in range(200):
        scheduler_output = s.schedule()
        finals += [m for m in scheduler_output.kv_connector_metadata.requests if m.finished]
        s.update_from_output(scheduler_output, model_runner_output(scheduler_output))  # the workers report nothing sent
        if finals:
            break
    (m,) = finals
    assert (m.save.start, m.save.end) == (512, 752) and len(m.block_ids) == 48
    for _ in range(3):  # not sent: vLLM must not free (or reuse) the blocks being read
        scheduler_output = s.schedule()
        assert not scheduler_output.kv_connector_metadata.requests
        s.update_from_output(scheduler_output, model_runner_output(scheduler_output))
    assert "r" in s.requests and s.kv_cache_manager.block_pool.get_num_free_blocks() < free0
    scheduler_output = s.schedule()
    out = model_runner_output(scheduler_output)
    out.kv_connector_output = KVConnectorOutput(finished_sending={"r"})
    s.update_from_output(scheduler_output, out)
    assert not s.requests and s.kv_cache_manager.block_pool.get_num_free_blocks() == free0


def test_opted_out_and_chunk_granular_configs_never_hold_blocks(model_dir):
    sched = build(model_dir, extra={"save_partial_chunk": False, "save_decode": False})
    _, saves, _ = run(sched, request("a", prompt(1100, 6), max_tokens=60))
    assert saves == [(0, 1024, False)]
    sched = build(model_dir)
    _, saves, _ = run(sched, request("b", prompt(1100, 7), max_tokens=60,
                                     kv_transfer_params={"kvplug_save": False}))
    assert saves == []
