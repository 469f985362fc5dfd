"""The checkers of the engine's data path (connector/sim/README.md), each a part of
:class:`.world.World` with its own state, called where the world makes the thing it checks
happen:

* :class:`ChunkCheck` (**I1**): what each saved chunk must hold, every chunk a tier is handed or
  returns, every chunk every tier holds at quiescence;
* :class:`ReadCheck` (**I2**): a forward that read wrong KV had its load error reach vLLM;
* :class:`ReportCheck` (**I3**): what the workers report to vLLM;
* :class:`BlockCheck` (**I4**): vLLM's block pool against the copies in flight, and the poison;
* :class:`QuiescenceCheck` (**I5**, with I1 over every tier): the end state.

The others: I6 and I7 in :mod:`.capacity`, I8 in :mod:`.manage`, I9 and I11 in :mod:`.clients`,
I10 in :mod:`.stalls`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .engine import POISON, TENSORS, Violation
from .oracle import SLOT

if TYPE_CHECKING:
    from .world import World


class ChunkCheck:
    """**I1**, every chunk any tier holds equals what the model computes for its tokens.

    Reads from the world: the scheduler's requests and the step's snapshot (``s``, ``tokens_of``,
    ``_snap``), the workers' keys, the layout, the layers and the oracle; counts what it checks.
    A violation raised inside kvplug (a tier's hook) is kept on the world (:meth:`.World.keep`),
    which raises it at the event."""

    def __init__(self, world: World) -> None:
        self.world = world
        tp = world.cfg.tp
        #: per rank: what every stored key must hold -> (group, start, end, tokens)
        self.registry: list[dict[Any, tuple[int, int, int, tuple[int, ...]]]] = [{} for _ in range(tp)]
        #: per rank: keys in the order a tier first held them (what faults and clears pick from)
        self.stored: list[list[Any]] = [[] for _ in range(tp)]
        self._seen: list[set] = [set() for _ in range(tp)]  # (the same keys, as a set)

    def register(self, metadata: Any) -> None:
        """Record what each chunk this step saves must hold."""
        from kvplug.connector.protocol.groups import group_hash

        w = self.world
        for r in metadata.requests:
            if r.save is None:
                continue
            req = w.scheduler.requests.get(r.req_id) or w._snap.get(r.req_id, (None,))[0]
            if req is None:
                continue
            tokens = tuple(w.tokens_of(req, max(req.num_tokens, req.num_computed_tokens)))
            for i, h in enumerate(r.save.hashes):
                s, e = metadata.chunk_range(r.save, i)
                for rank, worker in enumerate(w.workers):
                    for g in range(len(w.layout.groups)):
                        hh = group_hash(h, w.layout.groups[g]) if w.layout.multi else h
                        # under the step's weights epoch (a reset in this step switches it)
                        self.registry[rank].setdefault(worker.key(hh, metadata.epoch, r.tenant),
                                                       (g, s, e, tokens[:e]))

    def expected(self, rank: int, key: Any) -> torch.Tensor | None:
        """The oracle's chunk of ``key`` on ``rank`` (None: no save planned it)."""
        ent = self.registry[rank].get(key)
        if ent is None:
            return None
        w = self.world
        g, s, e, tokens = ent
        pages = -(-(e - s) // w.block_size)
        out = np.zeros((TENSORS, pages, w.block_size * SLOT), dtype=np.uint8)
        for m, (gg, j) in enumerate(w.layers):
            if gg != g:
                continue
            slots = w.oracle.slots(rank, m, tokens, e)
            raw = b"".join(slots[s:e])
            flat = np.frombuffer(raw, dtype=np.uint8)
            out[j].reshape(-1)[: flat.size] = flat
        return torch.from_numpy(out)

    def check(self, rank: int, key: Any, obj: Any, where: str,
              first_layer: int | None = None) -> None:
        """``obj`` holds the oracle's chunk of ``key`` (``first_layer``: a layer range of it
        from there, as ``get_layers`` returns)."""
        want = self.expected(rank, key)
        if want is None:
            raise Violation("I1", f"rank {rank} {where}: a chunk no save planned ({key})")
        got = obj.tensor
        if first_layer is not None and tuple(got.shape[1:]) == tuple(want.shape[1:]) \
                and first_layer + got.shape[0] <= want.shape[0]:
            want = want[first_layer:first_layer + got.shape[0]]
        if tuple(got.shape) != tuple(want.shape):
            raise Violation("I1", f"rank {rank} {where}: shape {tuple(got.shape)} != "
                                  f"{tuple(want.shape)}")
        g, s, e, _ = self.registry[rank][key]
        n = (e - s) * SLOT
        for j in range(got.shape[0]):
            a = got[j].reshape(-1)[:n]
            if not torch.equal(a, want[j].reshape(-1)[:n]):
                raise Violation("I1", f"rank {rank} {where}: chunk [{s},{e}) group {g} tensor "
                                      f"{j + (first_layer or 0)} differs from the oracle")
        if key not in self._seen[rank]:
            self._seen[rank].add(key)
            self.stored[rank].append(key)

    def check_held(self, rank: int) -> None:
        """At quiescence: every chunk every tier of ``rank`` holds (decoded by its codec)."""
        for t in self.world.workers[rank].storage._tiers:
            for key in list(self.registry[rank]):
                obj = t.hooks["get"](key=key)
                if obj is not None:
                    try:
                        self.check(rank, key, obj, f"end, tier {t.name}")
                    finally:
                        obj.ref_down()

    def plugin(self, rank: int) -> Any:
        """A wrapper on rank ``rank``'s tiers: every chunk handed to ``batched_submit_put`` and
        every object ``get``, ``batched_get``, ``batched_get_nowait`` or ``get_layers`` returns
        is checked; it is also where the faults lose a chunk at load time
        (:meth:`.Faults.lose_once`) and where I8 learns a chunk was stored again or served."""
        from kvplug.hookspecs import hookimpl

        world, check = self.world, self

        def loaded(key: Any, obj: Any, first_layer: int = 0) -> Any:
            """I1 on what a tier returns: the oracle of its key (its layers from
            ``first_layer``)."""
            if obj is not None:
                world.counts["tier objects checked"] += 1
                world.clears.check_served(rank, key)  # I8: never a chunk a clear removed
                try:
                    check.check(rank, key, obj, "get", first_layer)
                except Violation as v:
                    world.keep(v)
                    raise
            return obj

        lose_once = world.faults.lose_once

        class _Check:
            @hookimpl(wrapper=True)
            def batched_submit_put(self, keys: Any, objs: Any) -> Any:
                for k, o in zip(keys, objs, strict=False):
                    try:
                        check.check(rank, k, o, "put")
                    except Violation as v:  # the StorageManager takes it for a tier's fault
                        world.keep(v)
                        raise
                world.clears.restored(rank, keys)  # I8: stored again, served again
                return (yield)

            @hookimpl(wrapper=True)
            def get(self, key: Any) -> Any:
                res = yield
                return loaded(key, lose_once(rank, key, res))

            @hookimpl(wrapper=True)
            def batched_get(self, keys: Any) -> Any:
                res = yield
                if not isinstance(res, list):
                    return res
                return [loaded(k, lose_once(rank, k, r)) for k, r in zip(keys, res, strict=False)]

            @hookimpl(wrapper=True)
            def batched_get_nowait(self, keys: Any) -> Any:
                res = yield
                if not isinstance(res, list):
                    return res
                return [loaded(k, lose_once(rank, k, r)) for k, r in zip(keys, res, strict=False)]

            @hookimpl(wrapper=True)
            def get_layers(self, key: Any, first_layer: int, num_layers: int) -> Any:
                res = yield
                return loaded(key, lose_once(rank, key, res), first_layer)

        return _Check()

    def neighbour_plugin(self) -> Any:
        """On the neighbour process's StorageManager: a chunk it hands its tier is stored again
        on rank 0's directory (I8 no longer applies to it), at the moment it is handed over, not
        when the neighbour queued it (a clear in between cannot see a store still queued in
        another process, and that store lands after the clear)."""
        from kvplug.hookspecs import hookimpl

        clears = self.world.clears

        class _Stored:
            @hookimpl(wrapper=True)
            def batched_submit_put(self, keys: Any, objs: Any) -> Any:
                clears.restored(0, keys)
                return (yield)

        return _Stored()


class ReadCheck:
    """**I2**, every block a forward pass reads holds the right KV, or vLLM discards that
    forward's tokens for the request: its load error reached vLLM in that step.

    Reads from the world: the forward's taint (per request, the first position read wrong), the
    step's aggregated output, vLLM's requests and block tables, the layout."""

    #: I2 on every forward (a negative control switches it off to show I9 sees what it sees)
    enabled: bool = True

    def __init__(self, world: World) -> None:
        self.world = world

    def check(self, tainted: dict[str, int], kv_output: Any) -> None:
        """Each request of ``tainted`` still in vLLM was told in ``kv_output``: with one KV cache group,
        on the block of the first position read wrong or an earlier one of its table (vLLM
        recomputes from the first block reported); with several, in ``failed_recving``."""
        w = self.world
        invalid = set(kv_output.invalid_block_ids or ())
        for r, q in sorted(tainted.items()):
            if r not in w.scheduler.requests or not self.enabled:  # aborted mid-step: vLLM
                continue  # drops what it computed
            if w.layout.multi:  # several groups: vLLM takes failed requests, not blocks
                told = r in (kv_output.failed_recving or ())
            else:  # the first block read wrong (or one before it): vLLM recomputes from there
                table = w.scheduler.kv_cache_manager.get_block_ids(r)[0]
                told = bool(invalid.intersection(table[:q // w.block_size + 1]))
            if not told:
                raise Violation("I2", f"{r}'s forward read KV that is not its oracle from token "
                                      f"{q} (block {q // w.block_size}) and no load error for that "
                                      "block or an earlier one reached vLLM in that step")


@dataclass
class ReqLog:
    """What a request was reported as, in the aggregated outputs vLLM saw (I3)."""

    sending: int = 0
    frees: int = 0
    recving: int = 0


class ReportCheck:
    """**I3**, every request is reported in ``finished_sending`` / ``finished_recving`` at most
    once, and only while vLLM holds it (``finished_recving``: while it waits for the load).

    Reads from the world: vLLM's requests and their status. Its state: each request's reports,
    and which rank reported which request in ``finished_sending``."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.log: dict[str, ReqLog] = {}
        self.sent: set[tuple[int, str]] = set()  # (rank, request) seen in finished_sending

    def arrived(self, req_id: str) -> None:
        self.log[req_id] = ReqLog()

    def sending(self, rank: int, req: str) -> None:
        """Rank ``rank`` reported ``req`` in ``finished_sending`` (once per rank)."""
        self.log.setdefault(req, ReqLog())
        if (rank, req) in self.sent:
            raise Violation("I3", f"rank {rank} reported {req} in finished_sending twice")
        self.sent.add((rank, req))

    def check(self, kv_output: Any) -> None:
        """I3 on the aggregated output, before vLLM sees it."""
        from vllm.v1.request import RequestStatus

        requests = self.world.scheduler.requests
        for r in kv_output.finished_sending or ():
            c = self.log.setdefault(r, ReqLog())
            c.sending += 1
            c.frees += 1
            if r not in requests:
                raise Violation("I3", f"{r} reported in finished_sending after vLLM freed it")
        for r in kv_output.finished_recving or ():
            c = self.log.setdefault(r, ReqLog())
            c.recving += 1
            if r not in requests:
                raise Violation("I3", f"{r} reported in finished_recving after vLLM freed it")
            st = requests[r].status
            if RequestStatus.is_finished(st):
                c.frees += 1
            elif st != RequestStatus.WAITING_FOR_REMOTE_KVS:
                raise Violation("I3", f"{r} reported in finished_recving while {st.name}")
        for r, c in self.log.items():
            if c.frees > 1 or c.sending > 1:
                raise Violation("I3", f"{r} reported finished {c.frees} times "
                                      f"(sending {c.sending}, recving {c.recving})")


class BlockCheck:
    """**I4**, no block vLLM handed back is read or written by a copy once vLLM may rewrite it;
    and the poison: every block whose content vLLM does not vouch for is overwritten before each
    forward, so a copy that reads one stores poison (I1) and a forward that reads one is tainted
    (I2).

    Reads from the world: vLLM's block pool and requests, the workers' save jobs and background
    loads in flight, the paged KV (``kv``, which it poisons and zeroes), the config's
    ``prefix_caching``; counts the blocks it poisons and zeroes. Its state: the blocks requests
    held at the last forward, and those an abort freed in the step in flight."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.owned: set[int] = set()  # blocks requests held at the last forward
        self.spare: set[int] = set()  # blocks an abort freed mid-step (the batch still uses them)
        self._free_at_schedule: set[int] = set()

    def held(self) -> set[int]:
        """The blocks vLLM's requests hold."""
        s = self.world.scheduler
        mgr = s.kv_cache_manager
        return {b for r in s.requests for t in mgr.get_block_ids(r) for b in t} - {0}

    def free(self) -> set[int]:
        """The blocks of vLLM's pool no request holds."""
        pool = self.world.scheduler.kv_cache_manager.block_pool
        return {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}

    def scheduled(self) -> None:
        """The step was scheduled: what is free now is not the batch's."""
        self._free_at_schedule = self.free()

    def mid_step_done(self) -> None:
        """What happened between the schedule and the first hook (an abort) is done: blocks it
        freed are the batch's until the next forward (vLLM may rewrite them from then on)."""
        self.spare = self.free() - self._free_at_schedule

    def output_seen(self) -> None:
        """vLLM took a step's output: the blocks its requests hold now count as theirs."""
        self.owned = self.held()

    def before_forward(self, when: str, scheduler_output: Any, metadata: Any) -> None:
        """I4, right before the forward pass (the first moment vLLM may rewrite a block it
        freed: every kvplug hook that must order a copy first has run): no block vLLM handed
        back is read or written by a copy still in flight. Then every block whose content vLLM
        does not vouch for is poisoned: free blocks its prefix cache cannot serve (no block hash
        in its cached-block map), and blocks allocated since the last forward that vLLM does not
        count as computed (its own prefix hit)."""
        w = self.world
        free = self.free() - self.spare  # freed mid-step: the batch in flight owns them
        self.check_copies(free, when, "freed blocks")
        held = self.held()
        fresh = held - self.owned  # allocated by this schedule: vLLM's contract says garbage
        self.owned = held
        if w.cfg.prefix_caching:
            blocks = w.scheduler.kv_cache_manager.block_pool.blocks
            free = {b for b in free if blocks[b].block_hash is None}
            fresh -= self._computed_blocks(scheduler_output, metadata)
        if free or fresh:
            w.counts["blocks poisoned"] += len(free | fresh)
            idx = sorted(free | fresh)
            for t in w.kv:
                t.numpy()[:, idx] = POISON  # (a view: numpy's indexing costs far less here)

    def _computed_blocks(self, scheduler_output: Any, metadata: Any) -> set[int]:
        """The blocks of this step's requests (and of the loads it starts) that vLLM counts as
        computed before the step: its own prefix hit, never a load's target."""
        s = self.world.scheduler
        loads = {r.req_id: r.load.start for r in metadata.requests if r.load is not None}
        mgr = s.kv_cache_manager
        out: set[int] = set()
        for req_id in set(scheduler_output.num_scheduled_tokens) | set(loads):
            req = s.requests.get(req_id)
            if req is None:
                continue
            done = req.num_computed_tokens - scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if req_id in loads:  # vLLM's own hit ends where the load begins
                done = loads[req_id]
            for table in mgr.get_block_ids(req_id):
                out.update(table[:done // self.world.block_size])
        return out - {0}

    def check_copies(self, blocks: set[int], when: str, what_blocks: str) -> None:
        """No save copy or background load still in flight touches ``blocks`` (blocks vLLM
        may rewrite from ``when`` on)."""
        for rank, w in enumerate(self.world.workers):
            saves, bg = w._saves, w._background
            copies = [(f"a save copy of {sorted(job.req_ids)} reads", pj.block_ids)
                      for job in list(getattr(saves, "_jobs", ()) if saves is not None else ())
                      for pj in job.jobs]
            copies += [(f"a load of {load.req.req_id} will write", c.block_ids)
                       for load, _ in (list(getattr(bg, "_inflight", {}).values())
                                       if bg is not None else ())
                       for c in load.chunks]
            for what, block_ids in copies:
                bad = blocks.intersection(block_ids)
                if bad:
                    raise Violation("I4", f"rank {rank} {when}: {what} {what_blocks} "
                                          f"{sorted(bad)}")

    def zero_new_blocks(self, scheduler_output: Any, when: str) -> None:
        """vLLM's model runner zeroes the step's newly allocated blocks (an engine that needs
        it: ``new_block_ids_to_zero``), then applies the step's copy-on-write block copies;
        ``when``: where in the step the runner does it (the V2 runner before
        ``handle_preemptions``). I4 first: no copy in flight may touch a block rewritten here
        (a block a preemption or a sliding window freed, already handed to another request);
        a save that copies it later stores zeros, which I1 catches."""
        w = self.world
        ids = set(scheduler_output.new_block_ids_to_zero or ())
        cow = list(getattr(scheduler_output, "kv_cache_block_copies", None) or ())
        if not ids and not cow:
            return
        self.check_copies(ids | {c.dst_block_id for c in cow}, when, "blocks it rewrites")
        w.counts["blocks zeroed by the model runner"] += len(ids)
        if ids:
            idx = sorted(ids)
            for t in w.kv:
                t.numpy()[:, idx] = 0
        for c in cow:  # attention groups never make partial hits (Mamba's): for completeness
            w.counts["copy-on-write block copies"] += 1
            for t in w.kv:
                t[:, c.dst_block_id] = t[:, c.src_block_id]


class QuiescenceCheck:
    """**I5**, at quiescence: no pins, no held blocks, no tracked saves or loads, no pool objects
    in use, no task queued, a bounded number of threads; with **I1** over every chunk every tier
    holds (:meth:`ChunkCheck.check_held`), rank by rank.

    Reads from the world: the workers (their pins, saves, background loads, storage and its
    stats), the runtime's queue, the scheduler side's stats; reports the tiers' figures. Its
    state: the thread count when the world was built."""

    #: threads beyond those at the start that quiescence tolerates
    SPARE_THREADS = 8

    def __init__(self, world: World) -> None:
        self.world = world
        self.threads0 = threading.active_count()

    def check(self) -> None:
        w = self.world
        cfg, figures = w.cfg, w.figures
        for rank, worker in enumerate(w.workers):
            st = worker.storage
            st.flush(10)
            w.chunks.check_held(rank)
            if worker._pins:
                raise Violation("I5", f"rank {rank}: pins held at quiescence for "
                                      f"{sorted(worker._pins)}")
            saves = worker._saves
            if saves is not None:
                left = (saves.in_flight(), dict(getattr(saves, "_busy", {})),
                        set(getattr(saves, "_tracked", ())), set(getattr(saves, "_finished", ())))
                if left[0] or left[1] or left[2] or left[3]:
                    raise Violation("I5", f"rank {rank}: saves tracked at quiescence {left}")
            if worker._background is not None and len(worker._background):
                raise Violation("I5", f"rank {rank}: {len(worker._background)} loads in flight")
            stats = st.stats()
            for what, tier, stat in (("L1 evictions", "local_cpu", "evictions"),
                                     ("posix evictions", "posix", "evictions"),
                                     ("posix admission refusals", "posix", "admission_rejected")):
                figures[f"{what} ({cfg.eviction}/{cfg.admission})"] += \
                    int(stats.get(tier, {}).get(stat, 0))
            for stat in ("rescans", "vanished"):  # other processes' files (shared_dir)
                figures[f"posix {stat}"] += int(stats.get("posix", {}).get(stat, 0))
            for name, s in stats.items():
                if s.get("pinned", 0):
                    raise Violation("I5", f"rank {rank}: tier {name} holds {s['pinned']} pins")
            st.evict(tiers=["local_cpu"], nbytes=1 << 30)
            l1 = st.stats()["local_cpu"]
            if l1.get("pool_used", 0):
                raise Violation("I5", f"rank {rank}: {l1['pool_used']} B of L1's pool still in "
                                      "use with every entry evicted (a memory object leaked)")
        sched = w.scheduler.connector.scheduler_side  # disk hits the scheduler had loaded inside the step
        figures["disk hits loaded inline"] += int(
            sched.stats.totals().get("inline_local_loads", 0))
        left = [f for f in w.runtime.queue if f.pool.name != "kvplug-events"]  # (this check's
        if left:  # evictions woke the KV events' watch: its look comes after, I11)
            raise Violation("I5", f"{len(left)} tasks still queued")
        if threading.active_count() > self.threads0 + self.SPARE_THREADS:
            raise Violation("I5", f"{threading.active_count()} threads (started with "
                                  f"{self.threads0})")
