"""How vLLM's model runner calls one worker's half of kvplug, two ways a seed draws from:

* :class:`DirectRunner`: :class:`~kvplug.connector.worker.side.WorkerSide`'s methods, as
  ``KVPlugConnector`` routes them (the connector's own code is left out);
* :class:`ConnectorRunner`: ``KVPlugConnector``'s worker half itself, the calls vLLM's
  ``KVConnectorModelRunnerMixin`` makes (``bind_connector_metadata``, ``start_load_kv``,
  ``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``, ``get_transfer_results`` with
  ``get_finished``'s idle wait, ``get_block_ids_with_load_errors``,
  ``build_connector_worker_meta``, the KV events, ``clear_connector_metadata``). The connector is
  built without vLLM's distributed state (which its ``__init__`` reads for the ranks): the
  attributes its worker role uses, around a ``WorkerSide`` the simulation built.

Both hand back what the model runner puts in its ``KVConnectorOutput``.
"""

from __future__ import annotations

from typing import Any


class DirectRunner:
    """A worker called through ``WorkerSide`` (``watch``: its KV events' ``TierWatch``)."""

    def __init__(self, worker: Any, watch: Any = None) -> None:
        self.worker, self.watch = worker, watch

    def register_kv_caches(self, caches: dict[str, Any], events: bool, max_chunks: int) -> None:
        from kvplug.connector.worker.tier_watch import watch_tiers

        self.worker.register_kv_caches(caches)
        if events and self.worker.storage is not None:  # as KVPlugConnector does
            self.watch = watch_tiers(self.worker, max_chunks)

    def handle_preemptions(self, metadata: Any) -> None:
        self.worker.handle_preemptions(metadata)

    def bind(self, metadata: Any) -> None:
        self.worker.bind(metadata)

    def start_load_kv(self, metadata: Any) -> None:
        self.worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer: str) -> None:
        self.worker.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: str, metadata: Any) -> None:
        self.worker.save_kv_layer(layer, metadata)

    def wait_for_save(self, metadata: Any) -> None:
        self.worker.wait_for_save(metadata)

    def output(self, finished: set[str]) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        w = self.worker
        sent, recv = w.get_finished(finished)
        return KVConnectorOutput(finished_sending=sent or None, finished_recving=recv or None,
                                 failed_recving=w.take_failed(),
                                 invalid_block_ids=w.take_load_errors(),
                                 kv_connector_worker_meta=w.take_report(),
                                 kv_connector_stats=w.take_stats(),
                                 kv_cache_events=self.watch.take() if self.watch else None)

    def clear(self) -> None:
        pass

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


class ConnectorRunner(DirectRunner):
    """A worker called through ``KVPlugConnector``'s worker half (see the module docstring)."""

    def __init__(self, worker: Any, config: Any, layout: Any) -> None:
        super().__init__(worker)
        from kvplug.connector.connector import KVPlugConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        conn = object.__new__(KVPlugConnector)  # KVPlugConnector.__init__, role WORKER
        conn._connector_metadata = None
        conn._role = KVConnectorRole.WORKER
        conn.config, conn.kv_role, conn.layout = config, "kv_both", layout
        conn._sched, conn._worker, conn._book, conn._watch = None, worker, None, None
        conn._events_on = False
        self.conn = conn

    def register_kv_caches(self, caches: dict[str, Any], events: bool, max_chunks: int) -> None:
        self.conn._events_on = events
        self.conn.register_kv_caches(caches)
        self.watch = self.conn._watch

    def handle_preemptions(self, metadata: Any) -> None:
        self.conn.handle_preemptions(metadata)

    def bind(self, metadata: Any) -> None:
        self.conn.bind_connector_metadata(metadata)

    def start_load_kv(self, metadata: Any) -> None:
        self.conn.start_load_kv(None)  # the forward context: unused by kvplug

    def wait_for_layer_load(self, layer: str) -> None:
        self.conn.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: str, metadata: Any) -> None:
        self.conn.save_kv_layer(layer, None, None)  # the layer's tensor and attention metadata

    def wait_for_save(self, metadata: Any) -> None:
        self.conn.wait_for_save()

    def output(self, finished: set[str]) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        c = self.conn
        res = c.get_transfer_results(finished)
        return KVConnectorOutput(finished_sending=res.finished_sending,
                                 finished_recving=res.finished_recving,
                                 failed_recving=res.failed_recving,
                                 invalid_block_ids=c.get_block_ids_with_load_errors(),
                                 kv_connector_stats=c.get_kv_connector_stats(),
                                 kv_cache_events=c.get_kv_connector_kv_cache_events(),
                                 kv_connector_worker_meta=c.build_connector_worker_meta())

    def clear(self) -> None:
        self.conn.clear_connector_metadata()
