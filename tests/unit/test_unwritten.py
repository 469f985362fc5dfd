"""connector/unwritten.py: a failed load's blocks are followed until a step writes them, and a
step that reads one among a request's computed blocks is told (block size 4 here)."""

from __future__ import annotations

import random

from kvplug.connector.scheduler.unwritten import UnwrittenBlocks


def test_a_read_before_any_write_is_reported_and_a_write_forgets():
    u = UnwrittenBlocks(4)
    u.failed([7, 3])
    # a request with 10 computed tokens in blocks [3, 5, 7] (block 7 holds tokens 8-9) computes 2
    assert u.step([([3, 5, 7], 10, 2)]) == [3, 7]
    # block 3 was not written; block 7's tokens 10-11 were, but over its unwritten 8-9
    assert u.blocks == {3, 7}
    assert u.step([([9, 3], 0, 8)]) == []  # computed from 0: writes block 3, reads nothing
    assert u.blocks == {7}
    assert u.step([([3], 4, 1)]) == []  # block 3 written: nothing reported
    assert u.step([([1, 7], 4, 4)]) == []  # block 7 written from its first slot to its last
    assert u.blocks == set()


def test_a_load_writes_its_blocks_first():
    u = UnwrittenBlocks(4)
    u.failed([2, 6])
    u.loading([2, 6, 8], 0, 8)  # a load into tokens 0-7: blocks 2 and 6
    assert u.step([([2, 6, 8], 8, 1)]) == []
    u.failed([8])  # that step's load failed at block 8: followed again
    assert u.step([([8], 4, 0)]) == [8]


def test_the_blocks_after_a_failed_one_in_a_request_are_followed_too():
    """Seed 95036104: r4's load of blocks [6, 10, 12] failed while its step computed blocks 11
    and 1 over them; r5 shared them all through vLLM's prefix cache and, r4 aborted after
    recomputing only up to block 11, read block 1. Every block after a failed one in a live
    request's table is followed; a request without a failed block adds nothing."""
    u = UnwrittenBlocks(4)
    u.failed([6, 10, 12], [[5, 6, 10, 12, 11, 1, 7], [5, 6, 10, 12, 11, 1, 8], [2, 3, 4]])
    assert u.blocks == {6, 10, 12, 11, 1, 7, 8}
    assert u.step([([5, 6, 10, 12, 11], 4, 16)]) == []  # r4's recompute of tokens 4-19
    assert u.blocks == {1, 7, 8}
    assert u.step([([5, 6, 10, 12, 11, 1, 8], 24, 1)]) == [1]  # r5 reads block 1: reported


def test_a_block_another_request_of_the_step_writes_is_not_read_unwritten():
    """Seed 95001878: r8 had a prefix hit on blocks 5 and 6 that r7 computes in the same step
    (written before any attention reads them); reporting them sent both running requests
    through vLLM's recovery, which under asynchronous scheduling served a wrong token's KV."""
    u = UnwrittenBlocks(4)
    u.failed([5, 6, 9])
    assert u.step([([5, 6, 7], 0, 11), ([5, 6, 3, 9], 8, 1)]) == []
    assert u.blocks == {9}
    assert u.step([([9], 4, 1)]) == [9]  # a block nobody wrote since: still reported


def test_a_recompute_that_stops_inside_a_block_leaves_its_last_slots_followed():
    """Seed 135003121: r10's load into block 5 (tokens 16-19) failed while its step computed
    tokens 20-26 over it, filling block 14 (20-23; vLLM registers its hash); the recompute of
    16-22 stopped inside block 14, r10 was preempted, and its prefix-cache hit on blocks
    [..., 5, 14] read token 23 computed over the failed load. Before: block 14 was forgotten once
    any token of it was written, and the hit's read was not reported."""
    u = UnwrittenBlocks(4)
    table = [1, 2, 15, 13, 5, 14, 6]
    u.failed([5], [table])
    assert u.blocks == {5, 14, 6}
    assert u.step([(table, 16, 7)]) == []  # the recompute: tokens 16-22
    assert u.blocks == {14, 6}
    assert u.step([(table, 23, 1)]) == []  # r10 goes on at token 23: it reads only 20-22
    assert u.blocks == {6}
    u.failed([5], [table])
    u.step([(table, 16, 7)])
    assert u.step([(table + [12], 24, 8)]) == [14]  # the prefix hit on 24 tokens: reported
    assert u.step([(table, 20, 4)]) == []  # vLLM recomputes from block 14: written whole
    assert u.blocks == set()


def test_against_a_reference_of_written_slots():
    """Random steps: reported == blocks whose unwritten slots a request's computed tokens
    cover, computed independently from a per-block set of slots no step wrote since the block
    failed (a write after an unwritten slot of its block writes nothing valid)."""
    rng = random.Random(5)
    u = UnwrittenBlocks(4)
    dirty: dict[int, set[int]] = {}
    reported_any = 0
    for _ in range(2000):
        if rng.random() < 0.3:
            bad = set(rng.sample(range(20), 3))
            u.failed(bad)
            dirty.update({b: set(range(4)) for b in bad})
        work = []
        for _ in range(rng.randint(1, 3)):
            table = rng.sample(range(20), 5)
            done = rng.randint(0, 16)
            work.append((table, done, rng.randint(0, 20 - done)))
        whole = {b for table, done, n in work for i, b in enumerate(table)
                 if done <= 4 * i and 4 * (i + 1) <= done + n}  # written from first to last slot
        want = sorted({b for table, done, _ in work for i, b in enumerate(table[:(done + 3) // 4])
                       if b in dirty and b not in whole and min(dirty[b]) < done - 4 * i})
        for table, done, n in work:
            for i, b in enumerate(table):
                slots = set(range(max(0, done - 4 * i), min(4, done + n - 4 * i)))
                if b in dirty and slots and min(slots) <= min(dirty[b]):
                    dirty[b] -= slots
                    if not dirty[b]:
                        del dirty[b]
        got = u.step(work)
        assert got == want
        assert u.blocks == set(dirty)
        reported_any += bool(got)
    assert reported_any > 50  # not vacuous


def test_a_step_that_reads_an_unwritten_block_stores_nothing_computed_over_it(tmp_path):
    """The step that reads an unwritten block is tainted like a failed
    load's: the requests that read it store nothing this step (their chunks were computed over
    no KV) and are stored again from the first such token; another request's save goes on."""
    import hashlib
    import uuid

    import pytest
    import torch

    pytest.importorskip("vllm")
    from kvplug.connector.protocol.config import ConnectorConfig
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.protocol.metadata import KVPlugMetadata, ReqMeta, SaveSpec
    from kvplug.connector.worker.side import WorkerSide

    from tests.support.gpu_kv_fixture import KVFixture

    block_size, chunk_size = 4, 8
    hashes = [hashlib.sha256(bytes([i, 33])).digest() for i in range(3)]
    other = [hashlib.sha256(bytes([i, 34])).digest() for i in range(1)]
    fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=16)
    cfg = ConnectorConfig(chunk_size=chunk_size, async_save=False, log_every_load=False,
                          tiers=[{"backend": "local_cpu", "options": {"capacity": "4MiB"}}])
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{block_size}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(fx.caches)
    try:
        # "a" has tokens 0-7 from vLLM's prefix cache in blocks 1, 2 (block 2 unwritten) and
        # computes 8-23; "b" computes its own chunk in blocks 9, 10
        metadata = KVPlugMetadata(chunk_size, block_size, [ReqMeta("a", [1, 2, 3, 4, 5, 6],
                                                                   save=SaveSpec(8, 24, 1, hashes[1:])),
                                                           ReqMeta("b", [9, 10], save=SaveSpec(0, 8, 0, other))],
                                  unwritten=[2])
        w.bind(metadata)
        w.start_load_kv(metadata)
        w.wait_for_save(metadata)
        assert w.storage.flush(10)
        stored = [h for h in hashes[1:] if w.storage.contains(w.key(h))]
        assert not stored, f"{len(stored)} chunks computed over an unwritten block were stored"
        assert w.storage.contains(w.key(other[0]))  # the save of a request that read none
        assert w.take_load_errors() == {2}
        rep = w.take_report()
        assert rep is not None and rep.failed_from == {"a": 4}  # stored again from block 2
    finally:
        w.close()
