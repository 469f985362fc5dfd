"""The deterministic simulation (kvplug.connector.sim) in the suite: a fixed set of CI seeds must hold every
protocol invariant (I1-I11, connector/sim/README.md), each invariant's negative control must be caught
within that set, a failing seed shrinks to a short reproduction, and a seed replays exactly.

vLLM's real Scheduler and KV cache manager, kvplug's real scheduler side, worker side, lookup,
StorageManager, local_cpu and posix tiers, every kvplug task run by the simulation (one seed = one
interleaving). A failure prints the seed's shrunk event list; replay it with
``kvplug.connector.sim.schedule.reproduce(seed)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from kvplug.connector.sim.controls import DIRECTED_FAULTS, FAULTS, WHERE  # noqa: E402
from kvplug.connector.sim.engine import SimConfig  # noqa: E402
from kvplug.connector.sim.schedule import config_for, events_for, reproduce, run, run_seed, shrink  # noqa: E402
from kvplug.connector.sim.search import search  # noqa: E402

#: seeds 0..299: the suite's fixed set (about 25 s on 2 cores); the long searches for new
#: interleavings run in benchmarks/simulate.py (its seeds start at 1,000,000)
CI_SEEDS = 300
CONTROL_SEEDS = 300  # a negative control must be caught within the CI set
#: the CI seed that caught a slow-to-catch control first when last measured, tried first (the
#: rest follow in order: a change that moves the catch still finds it, only slower); saves ~2
#: minutes of the suite's CPU time; the other controls are caught within seed 6
CAUGHT_FIRST_BY = {"announce_on_one_rank": 139, "clear_leaves_entry": 9,
                   "fall_through_to_remote": 66, "ignore_quota": 9, "keep_late_results": 22,
                   "release_blocks_of_saves": 29, "skip_decode": 12, "skip_window_wait": 14,
                   "sync_loads_under_async_scheduling": 107, "tell_the_dropped_block": 13}
#: seeds that found something beyond the six protocol defects, replayed every run: vLLM 0.32's
#: scheduler stalls when requests that loaded asynchronously hold the cache and the head of the
#: waiting queue cannot grow (nothing running to preempt); the simulation aborts them and kvplug
#: must still end clean (I1-I5). 7003276 (a long search): a weights reset, then wrong KV read
#: without a load error; the simulation's lookup ignored the weights epoch, which made a failed
#: load that an abort then left in vLLM's prefix cache (see SCHEDULES). 107 (vLLM's
#: asynchronous scheduling): a synchronous load failed in step N, step N+1 (scheduled before
#: vLLM saw N's output) read the unloaded blocks and its token was served; every load is a
#: background one under asynchronous scheduling now (controls: sync_loads_under_async_scheduling)
REGRESSION_SEEDS: list[int] = [107, 128, 294, 331, 7003276]
#: I8 (a clear tells the truth), two false alarms of the simulation's own bookkeeping
#: that a long search found: 72002938, the neighbour process's store was counted as stored when
#: queued, so a clear in between recorded the chunk cleared and its later landing as served
#: (now: when the neighbour hands it to its tier); 70000824, an operator pin whose call timed out
#: landed while a tenant clear ran, and the chunk it pinned counted as left unprotected (now:
#: protected before or after the clear); 80019572, ranks sharing one posix directory: rank 0's
#: tenant clear deleted rank 1's file while a lookup of rank 1 held it open, and rank 1 served
#: its in-flight load from that descriptor (now: a chunk pinned when its clear began or ended is
#: not recorded as cleared). All failed before; kvplug's answers were true
REGRESSION_SEEDS += [70000824, 72002938, 80019572]
#: the real lookup path's first long search: vLLM stalled (a request its cache cannot hold) while
#: the request's lookups were answered by service tasks still queued, so the stall was never
#: recognised and the run never quiescent (I3); the stall check now ignores the lookup services'
#: tasks (they only answer). Failed before (I3: never quiescent), 46 + 44 seeds of that search
REGRESSION_SEEDS += [90003385]
#: I6 (a tenant over its quota on posix): a late operator pin of a file evicted for a
#: write (its delete still queued) indexed it again, so its bytes counted twice: the tenant held
#: 36864 B over its 24576 B quota. A doomed file is absent to a pin now, as to a lookup
#: (Directory.adopt). Failed before (I6)
REGRESSION_SEEDS += [91015041]
#: wrong KV read (I2) where vLLM shares a failed load's blocks between two requests
#: (kv_load_failure_policy "recompute"): 95036104, r4's load failed while its step computed two
#: more blocks over the failed ones; r5 held them all through the prefix cache, and r4, aborted
#: after recomputing part of them, left r5 reading the rest (now: every block after a failed one
#: in a live request's table is followed until written); 95001878 (asynchronous scheduling), a
#: prefix hit on blocks another request computes whole in the same step was reported unwritten,
#: and vLLM's recovery of the two running requests, with a step already run ahead, served KV of
#: a replaced token (now: such a block is written before it is read, not reported). Both failed
#: before, on vLLM 0.32 and 0.33
REGRESSION_SEEDS += [95001878, 95036104]
#: I11 (KV events), asynchronous scheduling, TP 2, the value tier down on rank 1: rank 0's news
#: that it stored two chunks in the value tier was taken with step N's output, and the weights
#: were reset before vLLM handed that output to the scheduler; the book, started over, counted
#: it, then counted rank 0's news about its new-epoch keys (same chunk hashes) as the second
#: rank, and announced blocks rank 1 never held (a router's miss). News names its weights epoch
#: now and the book counts its own epoch's only (tests/unit/test_kv_events.py). Failed before,
#: on vLLM 0.32 and 0.33
REGRESSION_SEEDS += [132014314]
#: I2, TP 2, layer-wise loads, an EAGLE/MTP drafter (drop_last_block), the real lookup service:
#: r10 had blocks [1, 2] from vLLM's prefix cache and loaded tokens 8-19 (its hit's last block
#: dropped); the chunk at token 16 was corrupt, so block 5 (16-19) was reported and the same
#: step computed 20-26 over it, filling block 14 (20-23), whose hash vLLM registered. The
#: recompute (16-22) stopped inside block 14, r10 was preempted, and its prefix-cache hit on
#: [..., 5, 14] read token 23, still computed over the failed load: UnwrittenBlocks forgot a
#: block once any of it was written. It follows a block's written slots now and forgets it
#: written to its last slot (tests/unit/test_unwritten.py). Failed before, on vLLM 0.32 and 0.33
REGRESSION_SEEDS += [135003121]
#: a posix directory shared by every rank (and by the neighbour process in 148002610): a
#: rank's view with room never looked at the directory before a write, so the files the others
#: wrote since its last scan stayed and each of its writes added one (16 files where 4 + 4 were
#: allowed). A shared directory (rescan_interval_s 0) now looks before every write; I6 counts
#: its files on disk. Failed before (vLLM 0.32)
REGRESSION_SEEDS += [148000138, 148002610]
#: a neighbour process on rank 0's posix directory (small tiers, tenant quotas), with
#: I6 strict there (SimConfig.strict_shared_i6): a queued write found the file the neighbour had
#: just stored and indexed it without making room, so the tenant held 36864 B over its 24576 B
#: quota; the write now makes room for it as for its own file
STRICT_SHARED_SEEDS: list[int] = [60000235, 60000921]
#: what the CI seeds must exercise (engines: zeroing under the V2 runner's order,
#: asynchronous scheduling, TP 1 and 4, a drafter's last-block drop, the real lookup client and
#: services with late answers and timeouts; disk hits inside the step and past its
#: budget), each at least once
ENGINE_KINDS = ("config TP 1", "config TP 4", "config zeroing v2", "config zeroing v1",
                "blocks zeroed by the model runner", "config async scheduling",
                "async steps ahead of their tokens", "config drafter drops a hit's last block",
                "loads short of their hit's last block (drafter)", "disk hits loaded inline",
                "config inline disk-hit budget 0 chunk(s)",
                "config inline disk-hit budget 1 chunk(s)", "config real lookup path",
                "lookups answered after the first ask", "lookup timeouts (real client)",
                "lookups expired at a service")
#: PP batch queues of 2 and 4 (the plain Scheduler), three tiers whose remote
#: is slow, hung or gone, production geometry, priority scheduling (preemption), the fail
#: policy (a request failed), drafts rejected, KV events, the connector's worker half, tokens
#: compared, a disk hanging mid-step with the step's read deadline spent, poisoned blocks
ENGINE_KINDS += ("config batch queue 2 (pipeline parallel)",
                 "config batch queue 4 (pipeline parallel)", "batch-queue steps ahead of an output",
                 "config three tiers, remote slow", "config three tiers, remote hung",
                 "config three tiers, remote gone", "config block size 16, chunk size 256",
                 "config priority scheduling", "preempted", "config load failure policy fail",
                 "requests finished error (tokens not compared)", "draft tokens rejected",
                 "config KV events on", "KV events: blocks stored", "KV events: blocks removed",
                 "config workers through KVPlugConnector", "requests whose tokens matched the "
                 "oracle's", "event step (gate mid-step)", "max engine wait in a step (ms)",
                 "blocks poisoned")

_A, _X = tuple(range(100, 116)), tuple(range(200, 247))  # a 2-chunk prompt; one filling the cache
#: directed schedules, one per defect a search found, each with the fault that undoes its fix
SCHEDULES = {
    # vLLM keeps a failed synchronous load's blocks in its prefix cache for the request to
    # recompute; aborted first, they are hit by the next request with that prefix
    # (kvplug.connector.scheduler.unwritten)
    "failed load, aborted, then a prefix-cache hit": (
        SimConfig(hybrid=False, window=6, num_blocks=13, max_batched=32, prefix_caching=True,
                  async_save=True, layerwise=False, order="0.33"),
        [("arrive", _A, (7,), 1), ("step",), ("step",), ("settle", True),
         ("drain",),  # A's two chunks reach the tiers
         ("arrive", _X, (8,), 1), *[("step",)] * 5,  # X pushes A out of vLLM's prefix cache
         ("drain",), ("step",),  # X's saves end and its blocks are freed
         ("arrive", _A, (9,), 5), ("step", ("lose", 0, 0)),  # A's hit: its load fails
         ("abort", 0), ("step",),  # aborted before vLLM recomputed the blocks
         ("arrive", _A, (10,), 3), ("step",), ("step",)],  # A again: vLLM's cache has them
        "forget_unwritten"),
}
_P = (67, 443, 569, 467, 587, 354, 266, 527, 398, 404, 633, 44, 817, 431, 677, 27, 983, 107, 3,
      273, 968, 991, 814, 496)  # a 3-chunk prefix
#: a synchronous load fails in the step that also saves the request's next chunk (computed over
#: the unloaded blocks): the save is left out (an early CI seed 47, shrunk)
SCHEDULES["a failed synchronous load, the request's save in that step"] = (
    SimConfig(hybrid=False, window=9, num_blocks=20, max_batched=32, prefix_caching=False,
              async_save=True, layerwise=False, order="0.33"),
    [("arrive", _P, (395, 523, 556, 835, 261, 102, 667, 895), 5), ("step",), ("drain",),
     ("arrive", _P, (835, 640, 562, 490, 804, 824, 449, 377), 5), ("lose", 1, 0)],
    "store_after_failed_load")
#: I10: two ranks, two partial chunks in one chunk (block 4, chunk 16), rank 0's L1
#: emptied and rank 1's longer partial evicted: the hit is rank 1's shorter one, which rank 0
#: never pinned; rank 0 loads it inside the step only from RAM (here: a load error, vLLM
#: recomputes), never by asking its disk on the engine thread
_Q, _S = tuple(range(100, 116)), tuple(range(300, 311))
SCHEDULES["a rank is sent a partial chunk it never pinned"] = (
    SimConfig(hybrid=False, num_blocks=24, max_batched=32, prefix_caching=False,
              async_save=True, layerwise=False, order="0.33", chunk_size=16),
    [("arrive", _Q, _S, 2), ("step",), ("step",), ("step",), ("drain",),  # [16, 24) stored
     ("arrive", _Q, _S[:5], 2), ("step",), ("step",), ("step",), ("drain",),  # [16, 20) too
     ("evict", 0, "local_cpu", None), ("evict", 1, "all", 1),  # rank 1 loses [16, 24)
     ("arrive", _Q, (*_S, 7), 2), ("step",)],
    "unpinned_tail_read")
#: a PP batch queue of 2 (the plain Scheduler): a 27-token prompt hits 16 tokens in L1 and one
#: chunk is lost after the lookup; step N+1 computes the prompt's rest before step N's output
#: reaches vLLM. Loads are background ones under any batch queue (runs_ahead): the fetch comes
#: after the loss, and nothing reads unloaded blocks; with in-step loads, N+1 reads them
SCHEDULES["a load lost under a PP batch queue"] = (
    SimConfig(hybrid=False, num_blocks=24, max_batched=8, prefix_caching=False,
              async_save=True, layerwise=False, order="0.32", batch_queue=2),
    [("arrive", _Q, (7,), 1), ("step",), ("step",), ("step",), ("step",), ("drain",),
     ("arrive", _Q, _S, 2), ("step", ("lose", 0, 0)), ("step",), ("step",)],
    "sync_loads_under_a_batch_queue")
#: load errors each directed schedule must see (the failed load; with an unwritten hit, the hit
#: reported as one too; none where the load runs after the loss)
_MIN_LOAD_ERRORS = {"store_after_failed_load": 1, "unpinned_tail_read": 1,
                    "sync_loads_under_a_batch_queue": 0}

#: the same, with an 11-token suffix after the prefix-cache hit: the step
#: that reads the unwritten blocks also computes chunk [16, 24) over them, which must not be
#: stored (kvplug.connector.worker.load.Loads.read_unwritten); asynchronous and synchronous saves, and
#: vLLM 0.32's call order
_UNWRITTEN_CFG, _UNWRITTEN_EVENTS, _ = SCHEDULES["failed load, aborted, then a prefix-cache hit"]
for _name, _kw in (("async saves", {}), ("sync saves", {"async_save": False}),
                   ("vLLM 0.32's order", {"order": "0.32"})):
    SCHEDULES[f"a step computes over an unwritten prefix-cache hit ({_name})"] = (
        replace(_UNWRITTEN_CFG, **_kw),
        [*_UNWRITTEN_EVENTS[:-3], ("arrive", _A, tuple(range(300, 311)), 3), ("step",),
         ("drain",), ("step",)],
        "store_over_unwritten")


def _explain(failures: list[tuple[int, str]]) -> str:
    seed = failures[0][0]
    return (f"{len(failures)} seed(s) failed: {failures[:10]}\n"
            f"shrunk reproduction of seed {seed}:\n{reproduce(seed)}")


def test_ci_seeds_hold_every_invariant():
    fig = search(0, CI_SEEDS, jobs=2)
    assert fig.schedules == CI_SEEDS
    assert fig.events > 20 * CI_SEEDS  # schedules are not vacuous
    assert not fig.failures, _explain(fig.failures)
    assert not [k for k in ENGINE_KINDS if not fig.counts[k]], dict(fig.counts)


@pytest.mark.parametrize("seed", REGRESSION_SEEDS)
def test_regression_seed(seed):
    out = run_seed(seed)
    assert out.violation is None, _explain([(seed, str(out.violation))])


@pytest.mark.parametrize("seed", STRICT_SHARED_SEEDS)
def test_posix_write_of_a_file_another_process_stored_makes_room(seed):
    out = run(replace(config_for(seed), strict_shared_i6=True), events_for(seed))
    assert out.violation is None, _explain([(seed, str(out.violation))])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_directed_schedule(name):
    """The schedule holds every invariant; with its fix patched out it fails (the negative
    control: the schedule does reach the defect)."""
    cfg, events, fault = SCHEDULES[name]
    out = run(cfg, events)
    assert out.violation is None, f"{name}: {out.violation} at event {out.at}"
    assert out.counts["load errors"] >= _MIN_LOAD_ERRORS.get(fault, 2)
    bad = run(replace(cfg, faults=frozenset([fault])), events)
    assert bad.violation is not None and bad.violation.inv == DIRECTED_FAULTS[fault], bad.violation


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_negative_control_is_caught(fault):
    """Each invariant's check can fail: with one kvplug rule patched out, some CI seed fails
    with that invariant."""
    want, where = FAULTS[fault], WHERE.get(fault, "")
    seen = []
    first = CAUGHT_FIRST_BY.get(fault)
    for seed in ([first] if first is not None else []) + [
            s for s in range(CONTROL_SEEDS) if s != first]:
        out = run_seed(seed, frozenset([fault]))
        if out.violation is not None:
            seen.append((seed, str(out.violation)))
            if out.violation.inv == want and where in str(out.violation):
                return
    raise AssertionError(f"{fault}: no CI seed caught it as {want}{where} (caught: {seen})")


def test_failing_seed_shrinks_to_a_short_reproduction():
    faults = frozenset(["leak_pins"])
    seed = next(s for s in range(CONTROL_SEEDS) if run_seed(s, faults).violation is not None)
    cfg = config_for(seed, faults)
    events = events_for(seed)
    small = shrink(cfg, events, "I5")
    assert len(small) <= 5 < len(events)
    again = run(cfg, small)
    assert again.violation is not None and again.violation.inv == "I5"
    text = reproduce(seed, faults)
    assert f"seed {seed}: I5" in text and "arrive" in text


def test_a_seed_replays_exactly():
    a, b = run_seed(7), run_seed(7)
    assert (a.events, a.at, str(a.violation)) == (b.events, b.at, str(b.violation))
    assert a.schedule == b.schedule
    assert a.trace == b.trace and len(a.trace) > len(a.schedule)


#: seeds of 20 events each (a run that depends on the hash seed made 13 of 120 differ, so 40
#: miss it with odds of about 1%; the seeds themselves are fixed). Before posix took
#: its LRU stamps from the runtime's clock, seed 19 differed run alone in 2 of 3 tries (the real
#: clock's milliseconds tied stamps or not; tests/backends/test_posix.py fails every time)
REPLAY_SEEDS = 32
#: a seed with the lossless codec (its queued puts once replayed in an address-given order)
CODEC_SEED = 70000021


def replayed_seeds() -> list[int]:
    return [*range(REPLAY_SEEDS), CODEC_SEED]


def test_seeds_replay_alone_in_other_processes_with_other_hash_seeds():
    """Every seed's outcome (every event's trace, the violation, every count: Outcome.digest) is
    the same run after the others in one process (``PYTHONHASHSEED=1``) as run alone, each in a
    process of its own (``PYTHONHASHSEED=2``): nothing a seed leaves behind, no set of strings
    (vLLM iterates sets of request ids; the simulation hands it sorted ones: sim.world.Sorted)
    and no real clock (posix's LRU stamps are the runtime's) decides what a seed does."""
    from kvplug.connector.sim.replay import elsewhere

    seeds = replayed_seeds()
    in_turn, alone = elsewhere([(seeds, False, "1"), (seeds, True, "2")], n=20, timeout_s=900)
    assert sorted(in_turn) == sorted(alone) == seeds
    assert len(set(in_turn.values())) == len(seeds)  # a digest per seed, never a constant
    differ = sorted(s for s in seeds if in_turn[s] != alone[s])
    assert not differ, f"seeds whose outcome differs run in turn and alone: {differ}"


_MODEL_DIR_SCRIPT = """
import os, sys
from kvplug.connector.sim.engine import _model_dir
model = _model_dir()
if os.fork() == 0:
    sys.exit(0)  # a forked child exiting normally runs the exit handlers it inherited
os.wait()
assert os.path.isfile(os.path.join(model, "config.json")), "the child took the model away"
print(model)
"""


def test_the_model_directory_is_removed_when_its_process_exits(tmp_path):
    """Each simulating process makes its model's files once, in the temporary directory, and
    removes them when it exits (thousands of processes in a search); a forked child exiting
    leaves its parent's in place."""
    out = subprocess.run([sys.executable, "-c", _MODEL_DIR_SCRIPT], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path / "kvplug-sim-model-"))
    assert list(tmp_path.iterdir()) == []


def test_a_codec_tiers_queued_puts_are_waited_for_in_the_order_they_run():
    """A tier with a codec queues its puts on one encoder thread; ``flush`` waits for them in the
    order they were queued: waited for as a set of futures, the simulation would run them in an
    order memory addresses give (seeds 112, 70000021 and 70000058, lossless codec: 2-3 digests in
    6 fresh processes each). The simulated runtime refuses a set, and seed 70000021 is among the
    replayed seeds above."""
    from kvplug.connector.sim.runtime import SimRuntime

    with pytest.raises(TypeError, match="deterministic order"):
        SimRuntime().wait_all({object()}, 1.0)
    assert CODEC_SEED in replayed_seeds()
