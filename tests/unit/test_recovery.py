"""``kvplug.connector.worker.recovery``: one outcome per load job, one rule from it to what vLLM
recomputes, what the scheduler stores again, what the step's store leaves out, and the log."""

from __future__ import annotations

from kvplug.connector.worker.recovery import (
    INVALID,
    LoadOutcome,
    Recovery,
    UnwrittenRead,
    recompute_blocks,
    recover,
)

BS = 4
TABLE = (11, 12, 13, 14, 15, 16)


def outcome(failed_at: int | None, start: int = 4, in_step: bool = True) -> LoadOutcome:
    """A load of tokens ``[start, 24)`` into ``TABLE`` (vLLM holds the blocks before ``start``)."""
    return LoadOutcome("r", failed_at, INVALID if failed_at is not None else "", start, 24, TABLE,
                       BS, in_step)


def test_a_load_that_succeeded_leads_to_nothing():
    o = outcome(None)
    assert o.success and recompute_blocks(o) == ()
    assert recover(o, multi=False) == recover(o, multi=True) == Recovery()


def test_a_failed_load_is_recomputed_from_its_first_failed_token_and_skipped_in_its_step():
    o = outcome(16)
    assert not o.success
    got = recover(o, multi=False)
    assert got.recompute == (15, 16) and got.failed_request is None
    assert got.store_from == {"r": 16} and got.num_failed_blocks == {"r": 2}
    assert got.skip_request == "r" and got.skip_blocks == {15, 16}
    assert got.counters == {"load_failures": 1, "failed_blocks": 2}
    assert got.warning == ("kvplug: request r: chunk at token 16 is invalid; 2 blocks "
                           "(tokens 16-24) will be recomputed")


def test_a_failure_before_vllms_own_hit_is_recomputed_from_the_hit():
    got = recover(outcome(0, start=8), multi=False)
    assert got.recompute == (13, 14, 15, 16) and got.store_from == {"r": 8}


def test_with_several_groups_the_request_is_recomputed_and_a_background_load_taints_nothing():
    got = recover(outcome(8, in_step=False), multi=True)
    assert got.recompute == () and got.failed_request == "r"
    assert got.skip_request is None and got.skip_blocks == frozenset()
    assert got.num_failed_blocks == {"r": 4}


def test_an_unwritten_read_fails_like_a_load_into_its_blocks():
    got = recover(UnwrittenRead((9, 3), {"a": 12}), multi=False)
    assert got.recompute == (9, 3) and got.store_from == {"a": 12}
    assert got.skip_blocks == {9, 3} and got.skip_request is None
    assert got.counters == {"unwritten_reads": 2} and "[9, 3]" in got.warning
