"""One simulated engine: vLLM's real Scheduler (or its AsyncScheduler) and KV cache manager, one
kvplug worker per TP rank (1, 2 or 4: real WorkerSide, StorageManager, local_cpu and posix tiers,
or three tiers with a remote value store) over CPU paged KV, every kvplug task run by
:class:`.runtime.SimRuntime`, and the invariants checked after every event.

The forward pass writes oracle-style KV (:mod:`.oracle`) and samples each token from the KV it
read. Each event of a schedule (:mod:`.schedule`) is applied by :meth:`World.apply`;
:meth:`World.quiesce` finishes every request and task and checks the end state. A violation
raises :class:`Violation` naming the invariant. What the engine is built from is in
:mod:`.engine`, how the model runner calls the workers in :mod:`.runner`. The checks, the
faults and the operator's events are parts the world owns (one attribute each, each with its own
state), called at the points where what they check happens: ``chunks`` (I1), ``reads`` (I2),
``reports`` (I3), ``blocks`` (I4), ``quiescence`` (I5) in :mod:`.checks`, ``capacity`` (I6, I7)
in :mod:`.capacity`, ``clears`` (I8) and ``operator`` in :mod:`.manage`, ``clients`` (I9) and
``kv_events`` (I11) in :mod:`.clients`, ``stalls`` (I10) in :mod:`.stalls`, ``faults`` in
:mod:`.faults`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import random
import shutil
import tempfile
import uuid
from collections import Counter, deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .capacity import CapacityCheck
from .checks import BlockCheck, ChunkCheck, QuiescenceCheck, ReadCheck, ReportCheck
from .clients import ClientCheck, EventCheck
from .engine import (
    TENSORS,
    SimConfig,
    SimLookup,
    SimRemoteLookup,
    Violation,
    _block_hasher,
    _fast_discovery,
    _tmp_root,
    _vllm_config,
)
from .faults import Faults
from .manage import ClearCheck, Operator
from .oracle import SLOT, Oracle, digest, prefix_hashes, slot_value, token_of
from .runner import ConnectorRunner, DirectRunner
from .runtime import SimRuntime
from .stalls import StallCheck
from .values import STORES

_STEP = "step"  # a step's part of the trace (folded into its event's digest)
_RANKED = frozenset(("lose", "evict", "corrupt", "gate", "outage", "partial", "remote"))  # ev[1]: a rank


@functools.cache
def _zeroing_kv_cache_config() -> type:
    """vLLM's ``KVCacheConfig`` of an engine whose new blocks must be zeroed (Mamba layers or
    mixed precision: ``needs_kv_cache_zeroing``; the simulated model's groups are attention
    ones, so the property is set rather than derived). vLLM's scheduler then hands the model
    runner ``new_block_ids_to_zero`` every step, and kvplug's layout says ``zeroes_new_blocks``."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    class ZeroingKVCacheConfig(KVCacheConfig):
        needs_kv_cache_zeroing = True  # type: ignore[assignment]

    return ZeroingKVCacheConfig


class Sorted(set):
    """A set of request ids that iterates in sorted order. vLLM iterates the sets of request
    ids it is handed (``_update_from_kv_xfer_finished`` frees blocks in ``finished_sending``'s
    order, which orders its free queue, so later block ids and prefix-cache evictions), and a
    set of strings iterates in an order that depends on ``PYTHONHASHSEED``: the simulation hands
    vLLM and kvplug these instead, so a seed replays the same in any process."""

    def __iter__(self):  # type: ignore[override]
        return iter(sorted(set.__iter__(self)))


class World:
    """One seed's engine (see the module docstring)."""

    def __init__(self, cfg: SimConfig) -> None:
        from kvplug.connector.protocol.config import ConnectorConfig
        from kvplug.connector.protocol.groups import layout_of
        from kvplug.connector.protocol.identity import Identity
        from kvplug.connector.worker.side import WorkerSide
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        self.cfg = cfg
        block_size, chunk_size = cfg.block_size, cfg.chunk_size
        self.block_size, self.chunk_size = block_size, chunk_size
        self.runtime = SimRuntime()
        self.violation: Violation | None = None  # raised inside kvplug (which may swallow it)
        self.counts: Counter[str] = Counter()  # what the schedule exercised (figures)
        #: figures read from the tiers' stats at quiescence (posix evictions, rescans, vanished
        #: files): reported with the counts, in the trace's end
        self.figures: Counter[str] = Counter()
        self.chunks = ChunkCheck(self)  # I1
        self.reads = ReadCheck(self)  # I2
        self.reports = ReportCheck(self)  # I3
        self.blocks = BlockCheck(self)  # I4
        self.capacity = CapacityCheck(self)  # I6, I7
        self.clears = ClearCheck(self)  # I8
        self.stalls = StallCheck(self)  # I10
        self.clients = ClientCheck(self)  # I9
        self.kv_events = EventCheck(self) if cfg.kv_events else None  # I11
        self.faults = Faults(self)  # the injected faults
        self.operator = Operator(self)  # an operator's clears and pins
        self.events: list[tuple] = []
        self.n_events = 0
        _fast_discovery()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvplug-sim-", dir=_tmp_root()))
        vllm_config = _vllm_config(cfg)
        full = FullAttentionSpec(block_size, num_kv_heads=1, head_size=SLOT // 2, dtype=torch.float16)
        groups = [KVCacheGroupSpec(["f0", "f1"], full)]
        if cfg.hybrid:
            swa = SlidingWindowSpec(block_size, num_kv_heads=1, head_size=SLOT // 2, dtype=torch.float16,
                                    sliding_window=cfg.window)
            groups.append(KVCacheGroupSpec(["s0", "s1"], swa))
        kv_cache_config = (_zeroing_kv_cache_config() if cfg.zeroing else KVCacheConfig)(
            num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        #: vLLM's asynchronous scheduling: step N+1 is scheduled (and run) before step N's
        #: output reaches the scheduler (its engine core's batch queue of two); pipeline
        #: parallelism: the plain Scheduler behind a batch queue of ``batch_queue``
        sched_cls = AsyncScheduler if cfg.async_scheduling else Scheduler
        self.depth = 2 if cfg.async_scheduling else cfg.batch_queue
        self.layout = layout_of(kv_cache_config, block_size)
        if cfg.inline_chunks is not None:  # the scheduler's budget for disk hits inside a step
            vllm_config.kv_transfer_config.kv_connector_extra_config["in_step_load_bytes"] = (
                cfg.inline_chunks * chunk_size * self.layout.block_bytes // block_size)
        self.scheduler = sched_cls(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=False,
            block_size=block_size, structured_output_manager=StructuredOutputManager(vllm_config))
        if self.kv_events is not None:  # the scheduler publishes each step's events there
            self.scheduler.kv_event_publisher = self.kv_events
        # model layers in forward order: (group, tensor)
        self.layers = ([(g, j) for j in range(TENSORS) for g in range(len(groups))])
        self.oracle = Oracle(len(self.layers), self._attends)
        self.workers: list[Any] = []
        self.runners: list[DirectRunner] = []  # how the model runner calls each (.runner)
        self.kv: list[torch.Tensor] = []
        engine = f"sim-{uuid.uuid4().hex[:8]}"
        self.runtime.late = cfg.late
        self.tp = tp = cfg.tp
        self.urls = [f"sim://{engine}/{rank}" for rank in range(tp)]
        for rank in range(tp):
            l1 = {"backend": "local_cpu", "eviction": cfg.eviction,
                  "options": {"capacity": "32KiB" if cfg.small_tiers else "1MiB",
                              "prefault": True}}  # its ticker: a simulation task
            tiers = [l1, self._lower_tier(rank)]
            if cfg.remote:  # the value store behind posix (a remote tier of a three-tier stack)
                tiers.append(self._value_tier(rank))
            if cfg.tenants:  # a tenant's chunks: a few in L1 (2-4 chunks)
                l1["quotas"] = {"default": 512}
            ccfg = ConnectorConfig(chunk_size=chunk_size, async_save=cfg.async_save,
                                   layerwise=cfg.layerwise and not cfg.hybrid,
                                   log_every_load=False, save_decode=True, tiers=tiers)
            w = WorkerSide(ccfg, Identity("sim", f"sim-bs{block_size}", tp, rank, engine), self.layout,
                           runtime=self.runtime)
            t = torch.zeros((TENSORS, cfg.num_blocks, block_size, SLOT), dtype=torch.uint8)
            caches = {}
            for _gi, g in enumerate(groups):
                for j, name in enumerate(g.layer_names):
                    caches[name] = t[j]
            runner = ConnectorRunner(w, ccfg, self.layout) if cfg.via_connector \
                else DirectRunner(w)
            runner.register_kv_caches(caches, cfg.kv_events, ccfg.kv_events_max_chunks)
            assert w.storage is not None
            w.storage.add_wrapper(self.chunks.plugin(rank))
            self.capacity.watch(rank, w.storage)
            self.stalls.watch(rank, w.storage)
            self.workers.append(w)
            self.runners.append(runner)
            self.kv.append(t)
        #: SimConfig.neighbour: another process's StorageManager on rank 0's posix directory
        self.neighbour = None
        if cfg.neighbour and cfg.lower == "posix" and not cfg.tier:
            from kvplug.storage_manager import StorageManager

            self.neighbour = StorageManager(ConnectorConfig(chunk_size=chunk_size, tiers=[self._lower_tier(0)]),
                                            runtime=self.runtime)
            self.neighbour.add_wrapper(self.chunks.neighbour_plugin())
        self.runtime.drain()  # the tiers' start-up work (posix's scan of its empty directory)
        for rank in range(tp):  # a remote tier hung or gone from the start (SimConfig.remote)
            if cfg.remote == "hung":
                self.faults.gate_remote(rank, True)
            elif cfg.remote == "gone":
                self.faults.outage(rank, True)
        if cfg.remote_lookup:
            self.lookup = SimRemoteLookup(
                self.workers, self.runtime, self.scheduler.connector.scheduler_side.cfg.lookup_timeout_s,
                random.Random(f"lookup {replace(cfg, faults=frozenset())} {sorted(cfg.faults)}"))
        else:
            self.lookup = SimLookup(self.workers)
        sched = self.scheduler.connector.scheduler_side
        sched.lookup = self.lookup
        sched.drop_last_block = cfg.drop_last_block  # as drops_last_block(vllm_config) sets it
        epochs = iter(range(1, 1 << 30))  # weights epochs that replay (the engine draws random ones)
        sched.draw_epoch = lambda: f"sim-epoch-{next(epochs)}"
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.agg = KVOutputAggregator(tp)
        self._snap: dict[str, Any] = {}  # the requests and tables of the step in flight
        self._drafts: dict[str, list[int]] = {}  # the step's draft tokens (speculative decoding)
        #: the tokens the model runner sampled, by request and index (the scheduler learns them
        #: a step or more later under asynchronous scheduling)
        self.runner_tokens: dict[str, dict[int, int]] = {}
        #: the engine core's batch queue (asynchronous scheduling, pipeline parallelism): steps
        #: that ran, newest first, their output not handed to vLLM yet
        self._queue: deque[tuple[Any, Any, Any]] = deque()
        #: speculative decoding: the drafter's guesses (SimConfig.spec_tokens)
        self._drafter = random.Random(f"drafts {replace(cfg, faults=frozenset())}")
        self.next_req = 0
        self.quiescence = QuiescenceCheck(self)  # I5 (its thread count: the engine's, built)
        self.closed = False
        #: a digest of everything the schedule made happen, one per event (replay checks)
        self.trace: list[str] = []
        self._trace = hashlib.blake2b(digest_size=12)

    def _lower_tier(self, rank: int) -> dict[str, Any]:
        """The tier behind L1: posix on a RAM disk, the simulated value store, or the backend
        under test (``SimConfig.tier``: ``{tmp}`` in its options is this rank's directory)."""
        cfg = self.cfg
        if cfg.tier:
            backend, options = cfg.tier
            tier = {"backend": backend, "name": "tier",
                    "options": json.loads(options.replace("{tmp}", str(self.tmp / f"r{rank}")))}
        elif cfg.lower == "values":
            tier = self._value_tier(rank)
        else:  # the policies and quotas under test (admission: any tier)
            tier = {"backend": "posix", "eviction": cfg.eviction,
                    "options": {"path": str(self.disk_dir(rank)), "io_threads": 1,
                                "capacity": "48KiB" if cfg.small_tiers else "64MiB"}}
            if cfg.shared_dir or cfg.neighbour:  # each write looks first: the bound holds (I6)
                tier["options"]["rescan_interval_s"] = 0
            if cfg.tenants:  # a tenant's chunks: half the disk
                tier["quotas"] = {"default": "24KiB" if cfg.small_tiers else "32MiB"}
        if not cfg.tier:
            tier["admission"] = {"policy": cfg.admission}
        if cfg.codec:
            tier["codec"] = cfg.codec
        return tier

    def _value_tier(self, rank: int) -> dict[str, Any]:
        """The simulated value store (:mod:`.values`) as a tier: behind L1, or behind posix
        (``SimConfig.remote``: a remote tier of a three-tier stack)."""
        return {"backend": "kvplug.connector.sim.values:SimValueTier", "name": "values",
                "options": {"url": self.urls[rank], "io_threads": 1, "timeout_s": 1.0,
                            "negative_cache_s": 0.5, "breaker_backoff_s": 1.0}}

    def disk_dir(self, rank: int) -> Path:
        """Rank ``rank``'s posix directory: its own, or one shared by every rank's process
        (``SimConfig.shared_dir``: each sees the others' files in its scans and rescans, evicts
        them for room, and has its own pins, held open against the others' evictions)."""
        return self.tmp / ("shared" if self.cfg.shared_dir else f"r{rank}")

    # -- model -----------------------------------------------------------------------------------
    def _attends(self, layer: int, p: int) -> range:
        g, _ = self.layers[layer]
        if g == 1:  # sliding window: the last `window` positions
            return range(max(0, p - self.cfg.window + 1), p + 1)
        return range(0, p + 1)

    def tokens_of(self, req: Any, end: int) -> list[int]:
        """The request's first ``end`` tokens as the model runner has them: the scheduler's,
        then this step's drafts (speculative decoding), then the tokens the runner sampled that
        the scheduler has not seen yet (asynchronous scheduling's placeholders)."""
        tokens = list(req.all_token_ids)[:end]
        drafts = self._drafts.get(req.request_id, ())
        known = self.runner_tokens.get(req.request_id, {})
        for p in range(len(tokens), end):
            i = p - req.num_tokens
            if 0 <= i < len(drafts):
                tokens.append(drafts[i])
            elif p in known:
                tokens.append(known[p])
            else:  # never sampled (not seen so far): a token of its own, counted
                self.figures["placeholder tokens the runner never sampled"] += 1
                tokens.append(3 + int.from_bytes(hashlib.blake2b(
                    f"{req.request_id}:{p}".encode(), digest_size=4).digest(), "little") % 997)
        return tokens

    def forward(self, scheduler_output: Any, samples: dict[str, range]) -> tuple[dict[str, int],
                                                                                 dict[str, list[int]]]:
        """The fake model: layer by layer (every request's tokens of a layer, then the next
        layer, as a real forward pass), on every rank, write every scheduled token's KV, then
        read the last layer's (as the logits would), so every layer's KV is read by some
        computation. Returns the requests that read KV other than the oracle's (tainted), each
        with the first position (any layer, any rank) whose read was wrong, and the tokens
        sampled at each position of ``samples`` (per request): a function of the last layer's
        KV each position attends to, on every rank (:func:`.oracle.token_of`)."""
        block_size = self.block_size
        tainted: dict[str, int] = {}
        reqs = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req, tables = self._snap[req_id]  # as scheduled (an abort mid-step freed it since)
            end = req.num_computed_tokens  # schedule() advanced it: this step's tokens end here
            tokens = self.tokens_of(req, end)
            reqs.append((req_id, end - n, end, tokens, prefix_hashes(tokens), tables))
        layerwise = self.cfg.layerwise and not self.cfg.hybrid
        last = len(self.layers) - 1
        reads: dict[str, list[list[bytes]]] = {r: [[] for _ in ps] for r, ps in samples.items()}

        def check_read(req_id: str, m: int, start: int, end: int, got: list[bytes],
                       want: list[bytes]) -> None:
            """The step's tokens ``[start, end)`` read layer ``m`` at the positions it attends
            to: note the first one that is not the oracle's."""
            if start >= end:
                return
            for q in range(self._attends(m, start).start, end):
                if got[q] != want[q]:
                    tainted[req_id] = min(q, tainted.get(req_id, q))
                    return

        for rank in range(self.tp):
            buf = self.kv[rank].numpy()
            runner = self.runners[rank]
            prev: dict[str, tuple[list[bytes], list[bytes]]] = {}
            for m, (g, j) in enumerate(self.layers):
                if layerwise:
                    self._hook(rank, "wait_for_layer_load", lambda r=runner, j=j:
                               r.wait_for_layer_load(f"f{j}"))
                for req_id, start, end, tokens, ph, tables in reqs:
                    want = self.oracle.slots(rank, m, tokens, end, ph)
                    table = tables[g]
                    cur = self._read(buf, j, table, end)
                    if m > 0:
                        before, before_want = prev[req_id]
                        check_read(req_id, m - 1, start, end, before, before_want)
                    for p in range(start, end):
                        if m == 0:
                            v = slot_value(rank, 0, ph[p], b"")
                        else:
                            v = slot_value(rank, m, ph[p],
                                           digest([before[q] for q in self._attends(m - 1, p)]))
                        buf[j, table[p // block_size], p % block_size] = np.frombuffer(v, dtype=np.uint8)
                        cur[p] = v
                    prev[req_id] = (cur, want)
                if layerwise:
                    self._hook(rank, "save_kv_layer", lambda r=runner, j=j:
                               r.save_kv_layer(f"f{j}", self._metadata))
            for req_id, start, end, *_ in reqs:  # the logits' read of the last layer
                cur, want = prev[req_id]
                check_read(req_id, last, start, end, cur, want)
                for i, p in enumerate(samples.get(req_id, ())):
                    reads[req_id][i].append(digest([cur[q] for q in self._attends(last, p)]))
        return tainted, {r: [token_of(x) for x in xs] for r, xs in reads.items()}

    def _read(self, buf: np.ndarray, j: int, table: list[int], end: int) -> list[bytes]:
        num_blocks = -(-end // self.block_size)
        raw = buf[j, table[:num_blocks]].tobytes()
        return [raw[p * SLOT:(p + 1) * SLOT] for p in range(end)]

    # -- events ------------------------------------------------------------------------------------
    def apply(self, ev: tuple) -> None:
        self.n_events += 1
        self.events.append(ev)
        kind = ev[0]
        self.counts[f"event {kind}" + (f" ({ev[1][0]} mid-step)" if kind == "step" and len(ev) > 1
                                       and ev[1] else "")] += 1
        if kind in _RANKED:  # the schedule draws ranks 0 and 1: this seed's ranks of them
            ev = (kind, self.rank(ev[1]), *ev[2:])
        with torch.inference_mode():
            if kind == "arrive":
                self.arrive(*ev[1:])
            elif kind == "step":
                self.step(ev[1] if len(ev) > 1 else None)
            elif kind == "lose":
                self.faults.lose(*ev[1:])
            elif kind == "task":
                self.runtime.step(ev[1])
            elif kind == "drain":  # every queued task that may run (directed schedules)
                self.runtime.drain()
            elif kind == "abort":
                self.faults.abort(ev[1])
            elif kind == "evict":
                self.faults.evict(*ev[1:])
            elif kind == "corrupt":
                self.faults.corrupt(*ev[1:])
            elif kind == "gate":
                self.faults.gate(ev[1], ev[2])
            elif kind == "settle":
                self.runtime.settle = ev[1]
            elif kind == "reset":
                self.faults.reset()
            elif kind == "outage":
                self.faults.outage(ev[1], ev[2])
            elif kind == "remote":  # a three-tier stack's remote tier slow (gated) or not
                self.faults.gate_remote(ev[1], ev[2])
            elif kind == "partial":
                self.faults.partial(ev[1])
            elif kind == "clear":  # an operator's clears and pins (.manage)
                self.operator.clear(ev[1], ev[2])
            elif kind in ("pin", "unpin"):
                self.operator.pin(ev[1], ev[2], kind == "pin")
            elif kind == "neighbour":
                self.faults.neighbour(ev[1], ev[2])
            else:  # pragma: no cover
                raise ValueError(f"unknown event {ev!r}")
        self.capacity.check()  # I6
        self.note(ev, self.runtime.ran)
        if self.violation is not None:
            raise self.violation

    def rank(self, r: int) -> int:
        """The rank a fault event drawn for rank ``r`` hits (``SimConfig.rank_offset``)."""
        return (r + self.cfg.rank_offset) % self.tp

    def note(self, *what: Any) -> None:
        """Fold ``what`` (plain values, in a fixed order) into the trace of this event."""
        self._trace.update(repr(what).encode())
        if what and what[0] is not _STEP:
            self.trace.append(self._trace.hexdigest())

    def arrive(self, prefix: tuple[int, ...], suffix: tuple[int, ...], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req_id = f"r{self.next_req}"
        self.next_req += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        salt = f"sim-tenant-{prefix[0] % 2}" if self.cfg.tenants else None
        # priority scheduling: a priority from the request's tokens (lower runs first)
        priority = (suffix[0] if suffix else prefix[-1]) % 3 if self.cfg.priority else 0
        prompt = list(prefix) + list(suffix)
        self.scheduler.add_request(Request(req_id, prompt, sp, None, priority=priority,
                                   block_hasher=_block_hasher(self.block_size), cache_salt=salt))
        self.reports.arrived(req_id)
        self.clients.arrived(req_id, prompt)

    # -- one engine step -------------------------------------------------------------------------
    def _hook(self, rank: int, what: str, fn: Any) -> Any:
        """One of the model runner's calls into rank ``rank``'s worker, on vLLM's engine thread
        there (I10)."""
        self.stalls.hook = what
        with self.runtime.engine_thread(rank, what):
            return self.crashing(what, fn)

    def step(self, mid: tuple | None = None) -> None:
        """One engine step; ``mid``: an event that happens between the scheduler's decisions
        (lookups, pins) and the workers' first hook (another thread's work, a tier losing a
        chunk after lookup). With a batch queue (asynchronous scheduling, pipeline
        parallelism) the step's output reaches the scheduler later (:meth:`_queued`)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        if self._pipelined() and self._queue and not self.scheduler.has_requests():
            self._update(*self._queue.pop())  # vLLM's engine core: nothing to schedule
            return
        scheduler_output = self.crashing("schedule", self.scheduler.schedule)
        mgr = self.scheduler.kv_cache_manager
        # what the model runner was handed: an abort mid-step (vLLM's asynchronous scheduling
        # takes aborts while a batch runs) frees the request in the scheduler, not in the batch
        self._snap = {r: (self.scheduler.requests[r], [list(t) for t in mgr.get_block_ids(r)])
                      for r in scheduler_output.num_scheduled_tokens}
        self._drafts = {r: list(d) for r, d in
                        (getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}).items()}
        self.blocks.scheduled()
        if mid is not None:
            self.apply(mid)
        #: blocks freed by an abort mid-step: the batch in flight still uses them, vLLM may
        #: rewrite them from the next forward on (I4 checks them there)
        self.blocks.mid_step_done()
        metadata = scheduler_output.kv_connector_metadata
        self._metadata = metadata
        self._count_plan(scheduler_output, metadata)
        self.chunks.register(metadata)  # I1: what the step's saves must store
        self.stalls.begin_step()
        if self.cfg.zeroing == "v2":  # update_requests, then pre_forward's handle_preemptions
            self.blocks.zero_new_blocks(scheduler_output, "as the V2 runner zeroes new blocks (before "
                                        "handle_preemptions)")
        for rank, runner in enumerate(self.runners):
            self._hook(rank, "handle_preemptions", lambda r=runner: r.handle_preemptions(metadata))
        if self.cfg.zeroing == "v1":  # _update_states, after handle_preemptions
            self.blocks.zero_new_blocks(scheduler_output, "as the V1 runner zeroes new blocks")
        for rank, runner in enumerate(self.runners):  # vLLM's bind_connector_metadata
            self._hook(rank, "bind", lambda r=runner: r.bind(metadata))
        self.blocks.before_forward("before the forward", scheduler_output, metadata)  # I4, the poison
        sync = getattr(scheduler_output, "has_sync_kv_loads", True)
        if sync:
            for rank, runner in enumerate(self.runners):
                self._hook(rank, "start_load_kv", lambda r=runner: r.start_load_kv(metadata))
        samples = self._samples(scheduler_output)
        tainted, sampled_at = self.forward(scheduler_output, samples)
        if not sync:
            for rank, runner in enumerate(self.runners):
                self._hook(rank, "start_load_kv", lambda r=runner: r.start_load_kv(metadata))
        outs = []
        finished = Sorted(scheduler_output.finished_req_ids)
        for rank, runner in enumerate(self.runners):
            if self.cfg.order == "0.32":
                self._hook(rank, "wait_for_save", lambda r=runner: r.wait_for_save(metadata))
            kout = self._hook(rank, "get_finished", lambda r=runner: r.output(finished))
            if self.cfg.order != "0.32":
                self._hook(rank, "wait_for_save", lambda r=runner: r.wait_for_save(metadata))
            self._hook(rank, "clear_connector_metadata", runner.clear)
            outs.append(kout)
        self.stalls.end_step(self.counts["steps"])
        for rank, k in enumerate(outs):
            for r in k.finished_sending or ():
                self.reports.sending(rank, r)  # I3
        ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [self._verified(r, sampled_at.get(r, []), samples.get(r)) for r in ids]
        runner_outputs = []
        for k in outs:
            o = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                  sampled_token_ids=[list(x) for x in sampled])
            o.kv_connector_output = k
            runner_outputs.append(o)
        out = self.agg.aggregate(runner_outputs)
        kv_output: KVConnectorOutput = out.kv_connector_output
        for name in ("finished_sending", "finished_recving"):  # vLLM iterates them: see Sorted
            if getattr(kv_output, name):
                setattr(kv_output, name, Sorted(getattr(kv_output, name)))
        self.reads.check(tainted, kv_output)  # I2: wrong KV read, and vLLM told in this step
        self.note(_STEP, sorted(scheduler_output.num_scheduled_tokens.items()),
                  sorted(scheduler_output.finished_req_ids),
                  [(r, mgr.get_block_ids(r)) for r in sorted(scheduler_output.num_scheduled_tokens)],
                  *(sorted(x or ()) for x in (kv_output.finished_sending, kv_output.finished_recving,
                                              kv_output.failed_recving, kv_output.invalid_block_ids)),
                  sorted(tainted.items()), sampled)
        self.counts["load errors"] += bool(kv_output.invalid_block_ids) + len(kv_output.failed_recving or ())
        self.counts["tainted forwards"] += len(tainted)
        self.faults.step_ended()
        self._queued(scheduler_output, out, kv_output)

    def _count_plan(self, scheduler_output: Any, metadata: Any) -> None:
        """Count what the scheduler planned for the step (what the schedule exercised)."""
        c = self.counts
        c["steps"] += 1
        if self.cfg.async_scheduling:  # steps that ran ahead of tokens vLLM had not seen
            c["async steps ahead of their tokens"] += any(
                self._snap[r][0].num_output_placeholders > 1 for r in scheduler_output.num_scheduled_tokens)
        elif self._pipelined():  # steps scheduled before an earlier step's output was seen
            c["batch-queue steps ahead of an output"] += bool(self._queue)
        c["preempted"] += len(metadata.preempted)
        c["unwritten blocks read"] += len(metadata.unwritten)
        c["draft tokens scheduled"] += sum(map(len, self._drafts.values()))
        trackers = self.scheduler.connector.scheduler_side.trackers
        for r in metadata.requests:
            if r.load is not None:
                c["background loads" if r.load.background else "sync loads"] += 1
                t = trackers.get(r.req_id)
                if t is not None and t.usable_tokens < t.lookup_tokens:
                    c["loads short of their hit's last block (drafter)"] += 1
            if r.save is not None:
                c["saves"] += 1

    def crashing(self, what: str, fn: Any) -> Any:
        """``fn()``, one of vLLM's calls (``what``): an exception it raises is a violation
        (``crash``: vLLM's own asserts), a violation it raises passes through."""
        try:
            return fn()
        except Violation:
            raise
        except Exception as exc:
            raise Violation("crash", f"{what} raised {type(exc).__name__}: {exc}") from exc

    def keep(self, v: Violation) -> Violation:
        """A violation found inside kvplug (a tier's hook, a wrapped eviction), which may
        swallow it: kept as the run's (the first one kept stays) and raised after the event.
        Returns the one kept."""
        self.violation = self.violation or v
        return self.violation

    def _pipelined(self) -> bool:
        """Pipeline parallelism's batch queue (the plain Scheduler; not asynchronous
        scheduling's, which the simulation runs as before: one step ahead, always)."""
        return self.depth > 1 and not self.cfg.async_scheduling

    def _queued(self, scheduler_output: Any, out: Any, kv_output: Any) -> None:
        """The step's output into the engine core's batch queue; the oldest one handed to the
        scheduler once the queue is full (vLLM's ``step_with_batch_queue``: it schedules while
        the queue has room and there is something to run)."""
        self._queue.appendleft((scheduler_output, out, kv_output))
        if self._pipelined():
            if len(self._queue) < self.depth and (scheduler_output.total_num_scheduled_tokens > 0
                                                  or self.scheduler.has_requests()):
                return
            self._update(*self._queue.pop())
            return
        while len(self._queue) >= self.depth:
            self._update(*self._queue.pop())

    def _samples(self, scheduler_output: Any) -> dict[str, range]:
        """Per scheduled request, the positions whose logits sample a token: the last one when
        the step reaches the end of the tokens the scheduler has (asynchronous scheduling: every
        step past the prompt), and each draft's position (speculative decoding)."""
        out = {}
        for r, n in scheduler_output.num_scheduled_tokens.items():
            req = self._snap[r][0]
            end = req.num_computed_tokens
            if self.cfg.async_scheduling:
                if not req.is_prefill_chunk:
                    out[r] = range(end - 1, end)
            elif end >= req.num_tokens:
                out[r] = range(max(end - n, req.num_tokens - 1), end)
        return out

    def _verified(self, req_id: str, tokens: list[int], at: range | None) -> list[int]:
        """The tokens the step hands vLLM for ``req_id``: the one sampled, or with drafts, each
        draft the model agrees with and the token after the last of them (vLLM rolls the
        rejected ones back); noted as the model runner's."""
        drafts = self._drafts.get(req_id)
        if drafts and tokens:
            out = [tokens[0]]
            for i, d in enumerate(drafts):
                if i + 1 >= len(tokens) or d != tokens[i]:
                    break
                out.append(tokens[i + 1])
            self.counts["draft tokens rejected"] += len(drafts) - (len(out) - 1)
        else:
            out = tokens[-1:]
        if at is not None:
            known = self.runner_tokens.setdefault(req_id, {})
            for i, t in enumerate(out):
                known[at.start + 1 + i] = t
        return out

    def _update(self, scheduler_output: Any, out: Any, kv_output: Any) -> None:
        """Hand one step's output to vLLM's scheduler (I3 on it first, I9 on what it sends the
        clients); a drafter then proposes the next drafts."""
        self.reports.check(kv_output)  # I3
        sent = self.crashing("update_from_output", lambda: self.scheduler.update_from_output(scheduler_output, out))
        self.blocks.output_seen()
        self.clients.outputs(sent)
        if self.cfg.spec_tokens:
            self._draft()

    def _draft(self) -> None:
        """Speculative decoding: the drafter's guesses for every running request, most of them
        the oracle's tokens (a drafter that is often right), the others random (rejected)."""
        from vllm.v1.outputs import DraftTokenIds

        ids, drafts = [], []
        for req in list(self.scheduler.running):
            if req.is_finished() or req.is_prefill_chunk:
                continue
            tokens, guess = list(req.all_token_ids), []
            for _ in range(self.cfg.spec_tokens):
                t = (self.oracle.token(self.tp, tokens, len(tokens) - 1)
                     if self._drafter.random() < 0.7 else self._drafter.randrange(3, 1000))
                guess.append(t)
                tokens.append(t)
            ids.append(req.request_id)
            drafts.append(guess)
        if ids:
            self.crashing("update_draft_token_ids",
                          lambda: self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts)))

    def flush_output(self) -> None:
        """A batch queue with nothing left to schedule: vLLM's engine core takes the oldest
        output."""
        if self._queue:
            self._update(*self._queue.pop())

    # -- the end ------------------------------------------------------------------------------------
    def quiesce(self, max_steps: int = 300) -> None:
        """Open every gate, run every request and task to the end, then check I1 (every chunk
        every tier holds) and I5 (nothing held)."""
        with torch.inference_mode():
            for rank in range(self.tp):
                self.faults.gate(rank, False)
                self.faults.outage(rank, False)
            for i in range(max_steps):
                if not self.scheduler.has_requests() and not self.runtime.queue and not self._queue:
                    break
                self.runtime.drain()
                if self.scheduler.has_requests():  # as vLLM's engine: also to hand over finished ids
                    self.step()
                else:
                    self.flush_output()
                if self.violation is not None:
                    raise self.violation
                if i and i % 20 == 0 and self.faults.vllm_stalled():
                    self.counts["vLLM stalls (aborted)"] += 1
                    self.faults.abort_all()
            else:
                raise Violation("I3", f"never quiescent: vLLM holds {sorted(self.scheduler.requests)}, "
                                      f"{len(self.runtime.queue)} tasks queued")
            self.operator.release_pins()
            if self.violation is not None:
                raise self.violation
            self.quiescence.check()  # I5, I1 over every tier
            if self.kv_events is not None:  # I11, after a last look at every tier
                self.kv_events.check_end([r.watch for r in self.runners])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            with contextlib.suppress(Exception):
                for t in w.storage.stats().values():
                    self.counts["tier timeouts"] += int(t.get("timeouts", 0))
                    self.counts["corrupt chunks detected"] += int(t.get("corrupt", 0))
        c = self.counts
        c[f"config {self.cfg.tier[0] if self.cfg.tier else self.cfg.lower} tier"] += 1
        c["config codec " + (self.cfg.codec or "none")] += 1
        c[f"config TP {self.tp}"] += 1
        c["config posix shared by every rank" if self.cfg.shared_dir else "config own dirs"] += 1
        c["config a neighbour process on rank 0's posix" if self.neighbour is not None
          else "config no neighbour"] += 1
        c["config zeroing " + (self.cfg.zeroing or "none")] += 1
        c["config async scheduling" if self.cfg.async_scheduling else "config sync scheduling"] += 1
        c["config real lookup path" if self.cfg.remote_lookup else "config lookups at once"] += 1
        c["config drafter drops a hit's last block" if self.cfg.drop_last_block
          else "config no last-block drop"] += 1
        c["config inline disk-hit budget " + ("default" if self.cfg.inline_chunks is None
                                              else f"{self.cfg.inline_chunks} chunk(s)")] += 1
        c[f"config block size {self.block_size}, chunk size {self.chunk_size}"] += 1
        c[f"config batch queue {self.cfg.batch_queue} (pipeline parallel)"
          if self._pipelined() else "config no pipeline-parallel batch queue"] += 1
        c[f"config three tiers, remote {self.cfg.remote}" if self.cfg.remote
          else "config two tiers"] += 1
        c["config priority scheduling" if self.cfg.priority else "config fcfs scheduling"] += 1
        c[f"config load failure policy {self.cfg.load_failure_policy}"] += 1
        c[f"config {self.cfg.spec_tokens} draft token(s) a step" if self.cfg.spec_tokens
          else "config no speculative decoding"] += 1
        c["config KV events on" if self.cfg.kv_events else "config KV events off"] += 1
        c["config workers through KVPlugConnector" if self.cfg.via_connector
          else "config workers through WorkerSide"] += 1
        c.update(self.stalls.counts)
        c["max engine wait in a step (ms)"] = round(self.stalls.max_waited * 1000)
        c["late tier calls (begun, timed out)"] += self.runtime.late_calls
        for rank in range(self.tp):
            self.faults.gate(rank, False)
        with contextlib.suppress(Exception):
            self.runtime.drain()
        if isinstance(self.lookup, SimRemoteLookup):
            c["lookups answered after the first ask"] += self.lookup.answered_late
            c["lookup timeouts (real client)"] += self.lookup.timeouts
            c["lookups expired at a service"] += sum(s.expired for s in self.lookup.services)
            with contextlib.suppress(Exception):
                self.lookup.close()
        for runner in self.runners:
            with contextlib.suppress(Exception):
                runner.close()
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.close()
        if self.neighbour is not None:
            with contextlib.suppress(Exception):
                self.neighbour.close()
        for url in self.urls:
            STORES.pop(url, None)
        shutil.rmtree(self.tmp, ignore_errors=True)
