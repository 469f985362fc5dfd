"""What one simulated engine is built from: the sizes, the seed's configuration, vLLM's config
(built once per process), the block hasher, and the lookup the scheduler asks (every rank at
once). :class:`Violation` is what every check raises.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: vLLM block size and kvplug chunk size (tokens) of most seeds (``SimConfig.block_size`` and
#: ``chunk_size``); :data:`PRODUCTION_GEOMETRY` in a few
BS, CS = 4, 8
PRODUCTION_GEOMETRY = (16, 256)
TENSORS = 2  # KV tensors per rank (each holds one layer of every group)
RANKS = 2  # TP ranks by default (a seed's ``SimConfig.tp``: 1, 2 or 4)
POISON = 0xEE


class Violation(AssertionError):
    """An invariant failed: ``inv`` is I1..I5 (or ``crash``), ``what`` says how."""

    def __init__(self, inv: str, what: str) -> None:
        super().__init__(f"{inv}: {what}")
        self.inv, self.what = inv, what


@dataclass(frozen=True)
class SimConfig:
    """What a seed fixes besides its events."""

    hybrid: bool = True  # a full and a sliding-window KV cache group (else one full group)
    window: int = 6  # sliding window (tokens)
    num_blocks: int = 24
    max_batched: int = 16  # chunked prefill: tokens per step
    prefix_caching: bool = False
    async_save: bool = True
    layerwise: bool = False  # one group only
    order: str = "0.32"  # "0.33": get_finished (and errors, stats) before wait_for_save
    faults: frozenset[str] = frozenset()  # negative controls (see .controls)
    # the tiers' policies (both tiers' eviction; admission on posix) and small tiers
    # (L1 of 8 pool pages, posix of ~10 files), so capacity, eviction order and pins are tested
    eviction: str = "lru"
    admission: str = "always"
    small_tiers: bool = False
    tenants: bool = False  # requests carry one of two cache salts; both tiers have quotas
    lower: str = "posix"  # the tier behind L1: "posix", or "values" (kvplug's value-tier base)
    codec: str = ""  # a codec on that tier ("lossless"), its puts on the encoder thread
    late: bool = False  # a gated call that times out has begun: its result arrives late
    #: the backend under test instead (``kvplug simulate``): (backend name or "module:Class",
    #: its options as JSON; ``{tmp}`` is replaced by a directory of the rank's own)
    tier: tuple[str, str] = ()
    #: the engine zeroes newly allocated blocks (vLLM's ``needs_kv_cache_zeroing``: Mamba
    #: layers, mixed-precision caches; kvplug sees it in the layout, ``zeroes_new_blocks``), and
    #: which model runner does: "v1" zeroes them after ``handle_preemptions`` (``_update_states``),
    #: "v2" before it (``update_requests``, then ``pre_forward``); "" never
    zeroing: str = ""
    async_scheduling: bool = False  # vLLM's AsyncScheduler: step N's output after N+1 runs
    tp: int = RANKS  # tensor-parallel ranks (one WorkerSide each)
    rank_offset: int = 0  # a fault event's rank r hits rank (r + rank_offset) % tp
    shared_dir: bool = False  # every rank's posix tier on one directory (processes sharing it)
    #: another engine process of the same model and rank 0 on rank 0's posix directory (its own
    #: StorageManager): it stores chunks rank 0 may never have written and evicts rank 0's
    neighbour: bool = False
    #: I6 on posix also where other processes write the directory (shared_dir, neighbour): a
    #: process bounds what it writes, but a rescan (or a lookup's stat) counts the others'
    #: files, so its view may exceed its capacity or a quota until its next write evicts; off,
    #: such excess is counted (figures), not a violation
    strict_shared_i6: bool = False
    #: the scheduler's ``in_step_load_bytes`` in chunks' bytes (None: the default): 0 sends every
    #: disk hit to the background, 1 lets a step's first small hit in and not the next
    inline_chunks: int | None = None
    #: a speculative drafter that reads the target's hidden states (EAGLE, MTP): the last block
    #: of every hit is recomputed, decode stores stay a block behind (``drop_last_block``)
    drop_last_block: bool = False
    #: the real lookup path (:class:`SimRemoteLookup`): the scheduler's ZeroMQ client and each
    #: rank's service, their answers when the schedule runs them; else answered at once
    remote_lookup: bool = False
    block_size: int = BS  # vLLM's block size (tokens)
    chunk_size: int = CS  # kvplug's chunk size (tokens)
    #: pipeline parallelism's batch queue (vLLM's engine core, ``max_concurrent_batches``): the
    #: plain Scheduler, each step's output handed to it after ``batch_queue - 1`` more steps were
    #: scheduled and ran (vLLM's config says ``pipeline_parallel_size = batch_queue``); 1: none
    batch_queue: int = 1
    #: three tiers: L1, posix and, behind them, the value tier as a remote store that is "slow"
    #: (spells of calls timing out, results arriving late), "hung" (blocked until quiescence)
    #: or "gone" (down until quiescence); "": two tiers
    remote: str = ""
    priority: bool = False  # vLLM's priority scheduling; requests draw priorities (preemption)
    #: vLLM's ``kv_load_failure_policy``: "fail" fails a request whose load failed
    load_failure_policy: str = "recompute"
    #: speculative decoding: drafts per decode step (a drafter that guesses right or wrong, so
    #: vLLM rejects some and rolls ``num_computed_tokens`` back); 0: none
    spec_tokens: int = 0
    kv_events: bool = False  # vLLM's KV events on: kvplug's TierWatch and TierEventBook
    #: the workers driven through ``KVPlugConnector``'s worker half, as vLLM's model runner calls
    #: it (``get_transfer_results``, ``get_finished``'s idle wait...); else ``WorkerSide`` directly
    via_connector: bool = False


_MODEL: dict[str, Any] = {}


def _fast_discovery() -> None:
    """Entry-point discovery once per process, not once per tier of every seed (it reads every
    installed package's metadata; the simulation builds four tiers a seed)."""
    import functools

    import kvplug.tier_setup as ts

    if not getattr(ts.load_backend_class, "cache_info", None):
        ts.load_backend_class = functools.lru_cache(maxsize=None)(ts.load_backend_class)


def _tmp_root() -> str | None:
    """A RAM disk for the posix tiers when there is one (thousands of seeds create and delete
    their directories)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _model_dir() -> str:
    """The simulated engine's model files (config and tokenizer, no weights), made once per
    process in a temporary directory the process removes when it exits."""
    if "dir" not in _MODEL:
        from kvplug.connector.demo.model import make_model

        root = Path(tempfile.mkdtemp(prefix="kvplug-sim-model-"))
        atexit.register(_remove_model_dir, root, os.getpid())
        _MODEL["dir"] = str(make_model("tiny", weights=False, root=root))
    return _MODEL["dir"]


def _remove_model_dir(root: Path, owner: int) -> None:
    """Remove ``root`` at exit, in the process that made it only (a forked child exiting
    normally must not take its parent's model away)."""
    if os.getpid() == owner:
        shutil.rmtree(root, ignore_errors=True)


def _vllm_config(cfg: SimConfig) -> Any:
    """vLLM's config for ``cfg``: built once (a ModelConfig reads the model's files), the fields
    a seed varies set before each Scheduler is built from it."""
    if "vllm_config" not in _MODEL:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )

        model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="bfloat16",
                            max_model_len=512)
        sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
        xfer = KVTransferConfig(kv_connector="KVPlugConnector",
                                kv_connector_module_path="kvplug.connector", kv_role="kv_both",
                                kv_load_failure_policy="recompute", kv_connector_extra_config={})
        _MODEL["vllm_config"] = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BS),
                                           scheduler_config=sched, device_config=DeviceConfig("cpu"),
                                           kv_transfer_config=xfer)
    from vllm.config import KVEventsConfig

    vllm_config = _MODEL["vllm_config"]
    vllm_config.cache_config.block_size = cfg.block_size
    vllm_config.cache_config.enable_prefix_caching = cfg.prefix_caching
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
    vllm_config.scheduler_config.max_num_batched_tokens = cfg.max_batched
    vllm_config.scheduler_config.async_scheduling = cfg.async_scheduling  # kvplug's connector reads it
    vllm_config.scheduler_config.policy = "priority" if cfg.priority else "fcfs"
    # what max_concurrent_batches reads (the engine core's batch queue; kvplug's connector too)
    vllm_config.parallel_config.pipeline_parallel_size = cfg.batch_queue
    vllm_config.parallel_config.tensor_parallel_size = cfg.tp  # the ranks KV events wait for
    vllm_config.kv_transfer_config.kv_load_failure_policy = cfg.load_failure_policy
    if cfg.load_failure_policy == "fail":
        _quiet_failed_loads()
    vllm_config.kv_events_config = (KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                                    if cfg.kv_events else None)
    vllm_config.kv_transfer_config.kv_connector_extra_config = {
        "chunk_size": cfg.chunk_size, "async_save": cfg.async_save, "layerwise": cfg.layerwise,
        "report_to_client": False, "log_every_load": False, "save_decode": True}
    return vllm_config


def _quiet_failed_loads() -> None:
    """vLLM logs an error for every request its ``fail`` policy fails; the simulation fails
    thousands on purpose (``SimConfig.load_failure_policy``): those lines are dropped."""
    import logging

    if "quiet" in _MODEL:
        return
    _MODEL["quiet"] = True
    logging.getLogger("vllm.v1.core.sched.scheduler").addFilter(
        lambda rec: "due to KV load failure" not in rec.getMessage())


def _block_hasher(block_size: int = BS) -> Any:
    """vLLM's per-request block hasher (prefix caching), as its engine core builds it."""
    name = f"hasher-{block_size}"
    if name not in _MODEL:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name("sha256_cbor")
        init_none_hash(fn)
        _MODEL[name] = get_request_block_hasher(block_size, fn)
    return _MODEL[name]


class SimLookup:
    """The scheduler's lookup, answered by every rank's worker at once (min over ranks, slow
    chunks from any rank), as kvplug's LookupClient does over ZeroMQ."""

    timeouts = 0
    epoch = ""  # the scheduler's weights epoch, carried by every lookup (as LookupClient does)

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self._slow: dict[str, frozenset[int]] = {}
        self._local: dict[str, frozenset[int]] = {}
        self._n = 0

    def lookup(self, req_id: str, hashes: list[bytes], tails: list[tuple[int, bytes]],
               tenant: str = "") -> int | None:
        from kvplug.connector.protocol.lookup import Lookup

        if not hashes and not tails:
            return 0
        self._n += 1
        answers, slow, local = [], set(), set()
        for w in self.workers:
            tokens, s, loc = w._on_lookup(Lookup(self._n, req_id, list(hashes), list(tails),
                                                 epoch=self.epoch, tenant=tenant))
            answers.append(tokens)
            slow.update(s)
            local.update(loc)
        self._slow[req_id] = frozenset(slow)
        self._local[req_id] = frozenset(local - slow)
        return min(answers)

    def set_epoch(self, epoch: str) -> None:
        self.epoch = epoch  # lookups are answered at once here: none is in flight to drop

    def take_slow(self, req_id: str) -> frozenset[int]:
        return self._slow.pop(req_id, frozenset())

    def take_local(self, req_id: str) -> frozenset[int]:
        return self._local.pop(req_id, frozenset())

    def release(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self._slow.pop(r, None)
            self._local.pop(r, None)
        for w in self.workers:
            w.release(list(req_ids))

    def close(self) -> None:
        pass


class SimRemoteLookup:
    """The scheduler's lookup as production makes it: kvplug's real :class:`LookupClient` and each
    rank's real :class:`LookupService`, over ZeroMQ ``inproc`` sockets, on the simulation's clock.
    A service's thread is a one-worker pool of the runtime: the messages a rank has received are
    served when the schedule runs its task (in order, releases after the lookups sent before
    them), so the scheduler sees what it sees in an engine: no answer yet (``None``: ask again),
    an answer, a timeout past ``lookup_timeout_s`` (a miss, the pins released), an answer after
    the deadline (the service drops it and its pins). ``fast`` draws, per new lookup, whether its
    answers come within the client's short wait (the usual case) or later."""

    def __init__(self, workers: list[Any], runtime: Any, timeout_s: float, fast: Any) -> None:
        import zmq
        from kvplug.connector.protocol.lookup import LookupClient, LookupService

        self.runtime, self.fast = runtime, fast
        self._ctx = zmq.Context()
        names = [f"inproc://kvplug-sim-lookup-{uuid.uuid4().hex[:8]}-{r}"
                 for r in range(len(workers))]
        self.services = [LookupService(Path(n), w._on_lookup, w.release, clock=runtime.monotonic,
                                       inproc=(self._ctx, n)) for n, w in zip(names, workers)]
        self._pools = [runtime.executor(1, f"kvplug-lookup-{r}") for r in range(len(workers))]
        self._queued: list[Any] = [None] * len(workers)
        self.client = LookupClient(names, timeout_s, wait_s=0.0, clock=runtime.monotonic,
                                   context=self._ctx)
        self.answered_late = 0  # lookups answered after the scheduler first asked

    @property
    def timeouts(self) -> int:
        return self.client.timeouts

    @property
    def epoch(self) -> str:
        return self.client.epoch

    def _serve_later(self) -> list[Any]:
        """A task per rank serving what it has received (one queued at a time)."""
        for r, (svc, pool) in enumerate(zip(self.services, self._pools, strict=True)):
            if self._queued[r] is None or self._queued[r].done():
                self._queued[r] = pool.submit(svc.serve_pending)
        return list(self._queued)

    def lookup(self, req_id: str, hashes: list[bytes], tails: list[tuple[int, bytes]],
               tenant: str = "") -> int | None:
        sent = self.client._next_id
        got = self.client.lookup(req_id, hashes, tails, tenant)
        tasks = self._serve_later()  # what it sent (a lookup, a timeout's release), served later
        if self.client._next_id == sent:  # no new lookup: an answer taken, or still waiting
            self.answered_late += got is not None
            return got
        if got is None and self.fast.random() < 0.5:
            for t in tasks:  # answered within the client's wait (a gated tier still blocks)
                self.runtime.run_task(t)
            got = self.client.lookup(req_id, hashes, tails, tenant)
        return got

    def serving(self, fut: Any) -> bool:
        """Whether ``fut`` is a lookup service's task (answers only: never work kvplug owes)."""
        return fut.pool in self._pools

    def set_epoch(self, epoch: str) -> None:
        self.client.set_epoch(epoch)
        self._serve_later()

    def take_slow(self, req_id: str) -> frozenset[int]:
        return self.client.take_slow(req_id)

    def take_local(self, req_id: str) -> frozenset[int]:
        return self.client.take_local(req_id)

    def release(self, req_ids: list[str]) -> None:
        self.client.release(list(req_ids))
        self._serve_later()

    def close(self) -> None:
        self.client.close()
        for s in self.services:
            s.close()
        self._ctx.term()
