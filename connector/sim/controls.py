"""Negative controls: known faults the simulation must catch, one per invariant.

Each fault is switched on for one run by name (``SimConfig.faults``): it patches one kvplug rule
out for the duration of the run, so the test can show the invariant that rule protects fails
within the CI seed set (the simulation is not passing vacuously).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

#: fault -> the invariant that must catch it
FAULTS = {
    "hide_load_errors": "I2",  # never tell vLLM a load failed: it computes over stale blocks
    "report_finished_twice": "I3",  # report a request in finished_sending again next step
    "skip_window_wait": "I4",  # no sliding-window liveness ordering (defect 2's rule)
    "leak_pins": "I5",  # lookups' pins are never released
    # the oracle's reads of the logits and of L1's copies
    "corrupt_last_layer_loaded": "I2",  # a bulk load writes a wrong last layer (read by logits)
    "corrupt_l1_object": "I1",  # L1 returns a wrong copy of a chunk (I1 on what tiers return)
    # a failed load's first block is left out of its load errors: caught in that step (the
    # first block read wrong must be reported; before, any block of the request passed, and it
    # was caught a step later, when vLLM had recomputed from the second and read the first)
    "report_a_later_block": "I2",
    # policies and capacity
    "evict_pinned": "I7",  # L1 takes a pinned chunk for a victim (the policy's and its own check)
    "overfill_disk": "I6",  # posix reserves room for a write without evicting anything
    "ignore_quota": "I6",  # L1 stores a tenant's chunk past its quota
    # late tier calls, checksums, codecs, saves of finished requests
    "keep_late_results": "I5",  # a tier call's late result is never released (Tier._late)
    "skip_checksums": "I1",  # chunks read without their layer checksums (corrupt values served)
    "skip_decode": "I1",  # a codec tier's reads handed on still encoded
    "release_blocks_of_saves": "I4",  # a finished request's blocks freed while a save reads them
    # an operator's clears
    "clear_leaves_entry": "I8",  # a clear (all, named chunks, a tenant) leaves an L1 entry
    # an engine whose V2 runner zeroes new blocks before handle_preemptions, kvplug not ordering
    # each step's copies when enqueued (order_at_enqueue off): a preempted request's block, handed
    # to another request, is zeroed while its save copy is still queued
    "ignore_zeroing": "I4",
    # synchronous loads under asynchronous scheduling (where kvplug loads in the background): a
    # load that fails in step N is heard of after N+1 ran over the unloaded blocks (seed 107)
    "sync_loads_under_async_scheduling": "I2",
    # the neighbour process (SimConfig.neighbour) stores another chunk's bytes under a key (as
    # an engine of other weights would without a deployment secret): rank 0 reads a file it
    # never wrote, and the check of what tiers return sees it (the simulation's own eyes)
    "neighbour_wrong_bytes": "I1",
    # an engine whose drafter reads the target's hidden states (EAGLE, MTP: SimConfig.
    # drop_last_block): vLLM is told the whole hit although the last block is not loaded
    "tell_the_dropped_block": "I2",
    # the engine step never waits on a tier (I10). An in-step load reads through
    # every tier (StorageManager.batched_get) instead of only the one its lookup pinned...
    "fall_through_to_remote": "I10",
    # ...each of its reads waits the tier's whole timeout_s instead of what is left of the
    # step's one deadline (in_step_load_deadline_s); (unpinned_tail_read: DIRECTED_FAULTS)
    "timeout_per_group": "I10",
    # ...or, before them, asks every tier that reads without waiting (batched_get_nowait, on
    # the engine thread) for all of the step's keys, pinned there or not
    "nowait_beside_the_pins": "I10",
    # load errors never reach vLLM and the simulation's I2 check is off: the tokens sampled
    # from the wrong KV reach the client, and the comparison of what clients receive sees them
    "hide_load_errors_past_i2": "I9",
    # the scheduler's KV-event book announces a chunk once one rank holds it (not every rank):
    # routers are told of blocks some rank does not hold
    "announce_on_one_rank": "I11",
}

#: fault -> what the violation must say besides its invariant (the check that must catch it)
WHERE = {"corrupt_l1_object": " get: ", "neighbour_wrong_bytes": " get: ",
         "timeout_per_group": " waited ", "nowait_beside_the_pins": "called batched_get_nowait",
         "ignore_zeroing": "V2 runner zeroes", "ignore_quota": "quota", "skip_checksums": " get: ",
         "skip_decode": " get: "}
#: faults only a directed schedule reaches (tests/sim/test_simulation.py, SCHEDULES) -> invariant
DIRECTED_FAULTS = {
    # store KV computed over a failed load; random seeds reach it rarely (1 of the first 300
    # at most): a directed schedule
    "store_after_failed_load": "I1",
    "forget_unwritten": "I2",  # a failed load's blocks are not followed until written
    "store_over_unwritten": "I1",  # a step that reads an unwritten block still stores
    # I10: a key the rank never pinned is located with storage.contains over every
    # tier and read from wherever it is, on the engine thread. With TP > 1 the hit is the
    # minimum over ranks, so a rank is sent a shorter partial chunk than the one it found:
    # that takes two partial chunks in one chunk, which block 4 / chunk 8 never has (one
    # partial per chunk) and the few production-geometry seeds do not reach in the CI set
    "unpinned_tail_read": "I10",
    # in-step loads under pipeline parallelism's batch queue (runs_ahead not seen): a load
    # that fails in step N is heard of after N+1, scheduled before N's output, read the
    # unloaded blocks (the same patch as sync_loads_under_async_scheduling)
    "sync_loads_under_a_batch_queue": "I2",
}


def _patches(name: str) -> list[tuple[Any, str, Any]]:
    from kvplug.connector.scheduler import unwritten
    from kvplug.connector.worker import load, recovery, store
    from kvplug.connector.worker import side as worker

    if name == "store_after_failed_load":
        return [(store.StoreBatch, "without", lambda self, skip: (self, []))]
    if name == "hide_load_errors":
        return [(worker.WorkerSide, "take_load_errors", lambda self: set()),
                (worker.WorkerSide, "take_failed", lambda self: set())]
    if name == "report_finished_twice":
        orig = worker.WorkerSide.get_finished

        def twice(self: Any, finished: Any = frozenset(), idle: bool = False) -> Any:
            out, recv = orig(self, finished, idle)
            again, self._sim_last_sent = getattr(self, "_sim_last_sent", set()), set(out)
            return out | again, recv

        return [(worker.WorkerSide, "get_finished", twice)]
    if name == "skip_window_wait":
        return [(store.AsyncSaves, "wait_window", lambda self: None)]
    if name == "leak_pins":
        return [(worker.WorkerSide, "release", lambda self, req_ids: None)]
    if name == "corrupt_last_layer_loaded":  # one KV cache group: a job's last layer is the
        real_scatter = load.Loads._scatter  # model's last (with two, it is group 0's, read on)

        def scatter(self: Any, jobs: list, reads: Any) -> Any:
            if not self.layout.multi:
                for i, j in enumerate(jobs):
                    pages = j.pages.clone()
                    pages[-1] ^= 0x5A
                    jobs[i] = j._replace(pages=pages)
            return real_scatter(self, jobs, reads)

        return [(load.Loads, "_scatter", scatter)]
    if name == "corrupt_l1_object":
        from kvplug.backends.local_cpu import LocalCPUBackend
        from kvplug.hookspecs import hookimpl
        from kvplug.memory import heap_memory_obj

        real_get = LocalCPUBackend.get

        def get(self: Any, key: Any) -> Any:
            obj = real_get(self, key)
            if obj is None:
                return None
            t = obj.tensor
            copy = heap_memory_obj(tuple(t.shape), t.dtype, obj.meta.fmt, obj.num_tokens)
            copy.tensor.copy_(t)
            copy.byte_view[-1:] ^= 0x5A
            obj.ref_down()
            return copy

        get.__qualname__ = "LocalCPUBackend.get"  # pluggy: a method (its first argument is self)
        return [(LocalCPUBackend, "get", hookimpl(get))]
    if name == "report_a_later_block":
        real_blocks = recovery.recompute_blocks

        def later(outcome: Any) -> tuple[int, ...]:
            blocks = real_blocks(outcome)
            return blocks[1:] if len(blocks) > 1 else blocks

        return [(recovery, "recompute_blocks", later)]
    if name == "evict_pinned":
        from kvplug.backends.local_cpu import LocalCPUBackend

        def evictable(self: Any, key: Any) -> bool:
            obj = self._entries.get(key)
            return obj is not None and obj.ref_count == 1

        return [(LocalCPUBackend, "_evictable", evictable)]
    if name == "ignore_quota":
        from kvplug.backends.local_cpu import LocalCPUBackend

        return [(LocalCPUBackend, "_within_quota", lambda self, key, size: True)]
    if name == "overfill_disk":
        from kvplug.backends.posix.index import PosixIndex

        def reserve(self: Any, size: int, capacity: int, tenant: str = "",
                    limit: int | None = None) -> list:
            self.reserved += size
            return []

        return [(PosixIndex, "reserve", reserve)]
    if name == "keep_late_results":
        from kvplug.tier_calls import Tier

        return [(Tier, "_late", lambda self, hook, fut, kwargs: None)]
    if name == "skip_checksums":
        from kvplug import chunkfile

        return [(chunkfile, "verify_layers", lambda *a, **k: True)]
    if name == "skip_decode":
        from kvplug.codecs.wrapper import CodecWrapper

        # the encoded object handed on as is (decode() drops the reference it consumed)
        return [(CodecWrapper, "_decode", lambda self, key, obj, first_layer: obj.ref_up())]
    if name == "release_blocks_of_saves":
        from kvplug.connector.scheduler.side import SchedulerSide

        real = SchedulerSide._finish_save

        def freed(self: Any, request: Any, block_ids: Any, tables: Any) -> bool:
            real(self, request, block_ids, tables)
            return False

        return [(SchedulerSide, "_finish_save", freed)]
    if name == "clear_leaves_entry":
        from kvplug import management

        def leaving(real: Any) -> Any:
            def clear(storage: Any, *args: Any, **kw: Any) -> Any:
                l1 = storage.backend("local_cpu")  # its oldest entry is kept (a wrongly held pin)
                keep = next(iter(l1._entries), None)
                if keep is not None:
                    l1._pins.pin(keep)
                try:
                    return real(storage, *args, **kw)
                finally:
                    if keep is not None:
                        l1._pins.unpin(keep)
            return clear

        return [(management, f, leaving(getattr(management, f)))
                for f in ("clear_keys", "clear_tiers", "clear_tenant")]
    if name == "ignore_zeroing":
        real_init = store.AsyncSaves.__init__

        def init(self: Any, *args: Any, **kw: Any) -> None:
            real_init(self, *args, **kw)
            self.order_at_enqueue = False

        return [(store.AsyncSaves, "__init__", init)]
    if name in ("sync_loads_under_async_scheduling", "sync_loads_under_a_batch_queue"):
        from kvplug.connector.scheduler.side import SchedulerSide

        real_sched_init = SchedulerSide.__init__

        def sched_init(self: Any, *args: Any, **kw: Any) -> None:
            real_sched_init(self, *args, **kw)
            self.runs_ahead = None

        return [(SchedulerSide, "__init__", sched_init)]
    if name == "neighbour_wrong_bytes":  # the simulation's neighbour reads it (faults.py)
        return []
    if name == "fall_through_to_remote":
        from kvplug.storage_manager import StorageManager

        return [(StorageManager, "read_pinned",
                 lambda self, keys, tiers, budget: self.batched_get(keys))]
    if name == "timeout_per_group":
        from kvplug.tier_calls import WaitBudget

        return [(WaitBudget, "remaining", lambda self: float("inf")),
                (WaitBudget, "spent", lambda self: False)]
    if name == "nowait_beside_the_pins":
        from kvplug.storage_manager import StorageManager
        from kvplug.tier_calls import release

        real_read_pinned = StorageManager.read_pinned

        def read_pinned(self: Any, keys: Any, tiers: Any, budget: Any) -> Any:
            for tier in self._tiers:
                if tier.reads_nowait():
                    release(self._read_nowait(tier, list(keys)))
            return real_read_pinned(self, keys, tiers, budget)

        return [(StorageManager, "read_pinned", read_pinned)]
    if name == "unpinned_tail_read":
        def where(self: Any, pinned: dict, background: bool) -> Any:
            if background:
                return lambda k: pinned.get(k, load.ANY_TIER)
            return lambda k: pinned.get(k) or self.storage.contains(k)

        return [(load.Loads, "_where", where)]
    if name == "hide_load_errors_past_i2":
        from .checks import ReadCheck

        return [*_patches("hide_load_errors"), (ReadCheck, "enabled", False)]
    if name == "announce_on_one_rank":
        from kvplug.connector.scheduler.events import TierEventBook

        real_book_init = TierEventBook.__init__

        def book_init(self: Any, *args: Any, **kw: Any) -> None:
            real_book_init(self, *args, **kw)
            self.num_workers = 1

        return [(TierEventBook, "__init__", book_init)]
    if name == "tell_the_dropped_block":
        from kvplug.connector.scheduler.side import SchedulerSide

        real_matched = SchedulerSide.get_num_new_matched_tokens

        def told(self: Any, request: Any, num_computed_tokens: int) -> Any:
            n, background = real_matched(self, request, num_computed_tokens)
            t = self.trackers.get(request.request_id)
            if n and t is not None and t.usable_tokens < t.lookup_tokens:
                n += t.lookup_tokens - t.usable_tokens  # the dropped block, never loaded
            return n, background

        return [(SchedulerSide, "get_num_new_matched_tokens", told)]
    if name == "store_over_unwritten":  # reported to vLLM, but neither stored again nor skipped
        real_recover = recovery.recover

        def recover(what: Any, multi: bool) -> Any:
            got = real_recover(what, multi)
            if isinstance(what, recovery.UnwrittenRead):
                got = dataclasses.replace(got, store_from={}, skip_blocks=frozenset())
            return got

        return [(recovery, "recover", recover)]
    if name == "forget_unwritten":
        return [(unwritten.UnwrittenBlocks, "failed", lambda self, block_ids, tables=(): None)]
    raise ValueError(f"unknown fault {name!r}; known: {sorted(FAULTS | DIRECTED_FAULTS)}")


@contextlib.contextmanager
def injected(faults: frozenset[str]) -> Iterator[None]:
    """Patch the named faults in for the duration of the block."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name in sorted(faults):
            for obj, attr, new in _patches(name):
                saved.append((obj, attr, obj.__dict__[attr]))
                setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)
