"""``KVPlugConnector``: the vLLM ``KVConnectorBase_V1`` entry point (thin; the work is elsewhere).

vLLM builds one instance per process: role SCHEDULER in the engine core (delegates to
:mod:`.scheduler.side`) and role WORKER in every worker (delegates to :mod:`.worker.side`);
what both sides share is in :mod:`.protocol`. Configure it with
``kv_connector_extra_config``: a kvplug config dict (``chunk_size``, ``tiers``, ``layerwise``...)
or ``{"config_file": "kvplug.yaml"}``; see :class:`kvplug.connector.protocol.config.ConnectorConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.platforms import current_platform

from .compat import drops_last_block, event_group_fields, runs_ahead
from .prom import KVPlugPromMetrics, hit_sources
from .protocol.config import async_save_enabled, load_connector_config
from .protocol.groups import layout_of
from .protocol.identity import build_identity, keys_digest
from .protocol.lookup import LookupClient, socket_path
from .protocol.metadata import KVPlugKVEvents, KVPlugMetadata, KVPlugWorkerMeta
from .protocol.stats import KVPlugStats
from .scheduler.events import TierEventBook, event_key, events_enabled
from .scheduler.side import SchedulerSide
from .worker.side import WorkerSide
from .worker.tier_watch import TierWatch, watch_tiers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvplug.connector")


def _setup_logging() -> None:
    """Route kvplug's log lines through vLLM's handlers (same format, every process)."""
    root = logging.getLogger("kvplug")
    if root.handlers:
        return
    handlers = logging.getLogger("vllm").handlers
    if handlers:
        for h in handlers:
            root.addHandler(h)
        root.propagate = False
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def _warn_fail_policy(policy: str) -> None:
    """vLLM's default ``kv_load_failure_policy`` is ``fail``: one chunk lost between lookup and load
    (evicted, corrupt, a tier down) would fail the whole request instead of recomputing it."""
    if policy == "fail":
        logger.warning("kv_load_failure_policy is 'fail' (vLLM's default): a kvplug load error "
                       "fails the request. Set \"kv_load_failure_policy\": \"recompute\" in "
                       "--kv-transfer-config so vLLM recomputes the blocks instead.")


class KVPlugConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV-cache storage for vLLM: local RAM, disk, GDS, remote, any plugin tier.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on; per-group handling (full and
    sliding-window attention; other groups stop hits at vLLM's own cache) is in :mod:`.groups`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _setup_logging()
        xfer = vllm_config.kv_transfer_config
        assert xfer is not None
        self.config = load_connector_config(dict(xfer.kv_connector_extra_config or {}))
        # the scheduler (holding finished requests' blocks) and the workers must agree
        self.config.async_save = async_save_enabled(self.config, current_platform.device_type)
        self.kv_role = xfer.kv_role or "kv_both"
        block_size = vllm_config.cache_config.block_size
        tp = vllm_config.parallel_config.tensor_parallel_size
        pp = vllm_config.parallel_config.pipeline_parallel_size
        engine_id = xfer.engine_id or "default"
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # KV events for routers (--kv-events-config): see .events
        self._events_on = events_enabled(vllm_config, self.config.kv_events)
        self._watch: TierWatch | None = None
        self._book: TierEventBook | None = None
        self.layout = layout_of(kv_cache_config, block_size)
        if self.layout.multi:
            if self.config.layerwise:  # a tensor holds several groups' layers: saved after all
                self.config = self.config.model_copy(update={"layerwise": False})
            if role == KVConnectorRole.SCHEDULER:
                logger.info("kvplug: %d KV cache groups (%s); every load is asynchronous, "
                            "bulk transfers", len(self.layout.groups), self.layout.describe())
                if not self.layout.servable:
                    logger.warning("%s", self.layout.unsupported_message())
        if role == KVConnectorRole.SCHEDULER:
            _warn_fail_policy(xfer.kv_load_failure_policy)
            # every worker (TP rank x PP stage) answers; the hit is the minimum over them
            client = LookupClient([socket_path(engine_id, r, p) for p in range(pp)
                                   for r in range(tp)], self.config.lookup_timeout_s)
            # disaggregated prefill: hand-offs name the keys' identity (.scheduler.handoff)
            digest = keys_digest(build_identity(vllm_config, self.config, tp_rank=0,
                                                kv_cache_config=kv_cache_config)) \
                if self.kv_role in ("kv_producer", "kv_consumer") else ""
            self._sched = SchedulerSide(self.config, block_size, self.kv_role, client,
                                        self.layout,
                                        drop_last_block=drops_last_block(vllm_config),
                                        runs_ahead=runs_ahead(vllm_config),
                                        keys_digest=digest)
            if self._events_on:
                fields = event_group_fields(kv_cache_config)
                self._book = TierEventBook(
                    block_size, self.config.chunk_size, tp * pp, self.config.kv_events_max_chunks,
                    [fields[g.index] for g in self.layout.full if g.index < len(fields)],
                    salt_key=event_key(self.config),
                    salted_tokens=self.config.kv_events_salted_tokens)
                self._sched.on_chunks = self._book.record
                logger.info("kvplug KV events on: BlockStored/BlockRemoved per tier (media %s)",
                            ",".join(self.config.tier_names()))
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )
            ident = build_identity(vllm_config, self.config,
                                   tp_rank=get_tensor_model_parallel_rank(),
                                   pp_rank=get_pp_group().rank_in_group,
                                   kv_cache_config=kv_cache_config)
            self._worker = WorkerSide(self.config, ident, self.layout)
        logger.info("kvplug connector (%s, %s): chunk_size=%d, tiers=%s, %s, %s saves",
                    role.name.lower(), self.kv_role, self.config.chunk_size,
                    ",".join(self.config.tier_names()),
                    "layer-wise" if self.config.layerwise else "bulk",
                    "asynchronous" if self.config.async_save else "synchronous")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise mode needs PIECEWISE CUDA graphs: under full graphs the per-layer hooks
        (``wait_for_layer_load``/``save_kv_layer``) never run and attention reads unloaded blocks.
        vLLM passes ``kv_connector_extra_config`` (a dict, maybe naming a file; env applies)."""
        try:
            return load_connector_config(dict(extra_config or {})).layerwise
        except Exception:  # noqa: BLE001 - the connector reports a bad config; be safe here
            return bool((extra_config or {}).get("layerwise", True))

    @property
    def requires_kv_delivery(self) -> bool:
        """False in every role. vLLM, when True (its default for a producer), drops the output
        of a request preempted while it was in flight and recomputes the request, because a
        producer that hands off blocks would hand off blocks the preemption freed. kvplug's
        producer hands off nothing from blocks at the end: its saves were sent as the prompt
        was computed, and a preemption orders the next step after their copies
        (``handle_preemptions``), so what its hand-off names is being stored whatever becomes
        of the request. A store lost downstream costs the consumer its wait, then a recompute
        of those tokens: never wrong KV, and never a prefill run twice."""
        return False

    # -- worker side ---------------------------------------------------------------------------
    def _meta(self) -> KVPlugMetadata | None:
        metadata = self._connector_metadata
        return metadata if isinstance(metadata, KVPlugMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
        if self._events_on and self._worker.storage is not None:
            self._watch = watch_tiers(self._worker, self.config.kv_events_max_chunks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Bound before the forward in every vLLM runner and call order: the worker learns here
        # which requests have a save coming this step (finished_sending must wait for it).
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(self._meta())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Sent: finished requests whose saves no longer read their blocks (synchronous saves:
        # their last save ran in wait_for_save; asynchronous: once their copies are done).
        # Received: background loads that are over (or whose request vLLM finished). Every rank
        # reports its own: the default get_finished_count (the world size) is right.
        if self._worker is None:
            return None, None
        metadata = self._meta()
        idle = metadata is not None and metadata.idle  # no forward: wait a little
        sent, recving = self._worker.get_finished(finished_req_ids, idle,
                                                  pause=idle and metadata is not None and metadata.handoffs)
        return sent or None, recving or None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM freed the preempted requests' blocks; the coming forward pass may rewrite them
        if self._worker is not None:
            metadata = kv_connector_metadata
            self._worker.handle_preemptions(metadata if isinstance(metadata, KVPlugMetadata) else None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # several KV cache groups: a failed load is a failed request (vLLM recomputes it all)
        res = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:
            res.failed_recving = self._worker.take_failed()
        return res

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVPlugWorkerMeta | None:
        return self._worker.take_report() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVPlugStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        return self._sched.stats.take() if self._sched is not None else None

    def get_kv_connector_kv_cache_events(self) -> KVPlugKVEvents | None:
        return self._watch.take() if self._watch is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPlugStats | None:
        return KVPlugStats(data=dict(data)) if data is not None else KVPlugStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVPlugPromMetrics:
        return KVPlugPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.lookup.close()

    # vLLM 0.33 sleep mode: the KV memory goes away and comes back (same addresses). vLLM resets
    # the connector (reset_cache) when it sleeps at level >= 1, so a new weights epoch starts.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:  # every copy that reads or writes the KV memory is over
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:  # the KV tensors are checked before any byte moves again
            self._worker.resume()

    def reset_cache(self) -> bool | None:
        """The weights changed (``reset_prefix_cache(reset_connector=True)``, sleep, pause with
        ``clear_cache``): a new weights epoch, carried to every worker by the next step's
        metadata and every later lookup, so nothing stored before is served to this engine on
        any tier; engines still on the old weights keep their hits (see :mod:`.scheduler.side`)."""
        if self._sched is not None:
            self._sched.reset()
        if self._book is not None:
            self._book.reset()
        return True

    # -- scheduler side ------------------------------------------------------------------------
    @property
    def scheduler_side(self) -> SchedulerSide | None:
        """The scheduler half this connector routes to (read-only): its trackers, lookup,
        stats and epoch, for tests, the simulation and benchmarks that watch or stand in for
        parts of it. None on a worker-role connector."""
        return self._sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        if self._sched is None or not num_external_tokens:
            return {}
        fast, slow = self._sched.hit_split(request.request_id, num_external_tokens)
        return hit_sources(fast, slow, [t.backend for t in self.config.tiers])

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output.kv_connector_worker_meta,
                                                connector_output.invalid_block_ids)
            self._sched.release_held(connector_output.finished_sending)
        if self._book is not None and self._sched is not None:
            self._book.add(connector_output.kv_cache_events, self._sched.epoch)

    def has_pending_block_frees(self) -> bool:
        # Blocks of finished requests come back once their saves' copies are done (a step or
        # two): vLLM waits for them instead of preempting a running request.
        return self._sched is not None and bool(self._sched.held)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._book.take() if self._book is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # A last save (the answer's blocks) runs next step: vLLM keeps the blocks until then.
        delay = self._sched is not None and self._sched.finish_save(request, block_ids)
        report = self._sched.request_finished(request) if self._sched is not None else None
        return delay, report

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with every KV cache group's blocks (vLLM's hybrid manager)."""
        first = list(block_ids[0]) if block_ids else []
        delay = self._sched is not None and self._sched.finish_save(request, first,
                                                                    tuple(block_ids))
        report = self._sched.request_finished(request) if self._sched is not None else None
        return delay, report
