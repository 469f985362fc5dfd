"""The worker's transfers, in one shape for both directions.

A load moves KV from the tiers into vLLM's blocks (:mod:`.load`), a store from the blocks into
the tiers (:mod:`.store`). Both are jobs of an engine step that the worker submits, reports when
they are over, and waits for when vLLM is about to need what they touch, as vLLM's own offloading
worker does (``transfer_async``, ``get_finished``, ``wait``):

====================================  ==============================================================
``expect(metadata)``                  ``bind_connector_metadata``: the step's saves are held until
                                      submitted; the unwritten blocks it reads are load errors
``submit(Load(metadata))``            ``start_load_kv``: the step's loads
``submit(Store(metadata, layer))``    ``save_kv_layer``: that layer of the step's store
``submit(Store(metadata))``           ``wait_for_save``: ``wait_loads``, then the step's store
                                      (``store_step``)
``finished(finished, idle)``          ``get_finished``: (``finished_sending``, ``finished_recving``)
``wait_layer(layer)``                 ``wait_for_layer_load``: the loads wrote every layer up to it
``wait_freed(freed)``                 ``handle_preemptions``: copies that read freed blocks come first
``wait_puts(keys, timeout)``          a lookup: the puts of these chunks are over
``wait_idle()``                       sleep: every load is over, every copy has read its blocks
====================================  ==============================================================

The one rule between the directions lives here (:meth:`Transfers.store_step`): a step's store
comes after its loads (it must never read a block a load is still writing), and leaves out every
request whose KV the step computed over a failed load
(:meth:`.load_report.LoadReports.tainted`, from the recovery rule :func:`.recovery.recover`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

from kvplug.gpu import PagedKV, PageJob, gather_many, scatter_many
from kvplug.keys import CacheKey
from kvplug.storage_manager import StorageManager

from ..protocol.groups import GroupLayout
from ..protocol.metadata import KVPlugMetadata
from .load import Loads
from .store import Stores


class TransferParts(NamedTuple):
    """What loads and stores both move between, built once by the worker side: the paged KV
    cache, the tiers, the KV cache groups, and the key a chunk hash stands under."""

    kv: PagedKV
    storage: StorageManager
    layout: GroupLayout
    key: Callable[[bytes], CacheKey]


class Load(NamedTuple):
    """Tiers -> blocks: every load ``metadata`` names (None: the step has none)."""

    metadata: KVPlugMetadata | None


class Store(NamedTuple):
    """Blocks -> tiers: the chunks ``metadata`` saves; ``layer``: layer-wise, only the layer just
    computed (None: the step's forward is over, store what is left)."""

    metadata: KVPlugMetadata | None
    layer: str | None = None


class Finished(NamedTuple):
    """What :meth:`Transfers.finished` reports to vLLM."""

    sending: set[str]  # finished requests whose blocks no save reads any more
    recving: set[str]  # requests whose background load is over (or vLLM finished them)


class Transfers:
    """One worker's loads and stores (built once the KV cache and the tiers exist)."""

    def __init__(self, loads: Loads, stores: Stores) -> None:
        self.loads = loads
        self.stores = stores

    def expect(self, metadata: KVPlugMetadata) -> None:
        """vLLM bound the coming step's metadata (before its forward and any ``get_finished``
        of the step, in every vLLM version and call order)."""
        self.loads.expect(metadata)
        self.stores.expect(metadata)

    def submit(self, job: Load | Store) -> None:
        """Start ``job`` (see the module docstring)."""
        if isinstance(job, Load):
            self.loads.start(job.metadata)
        elif job.layer is not None:
            self.stores.start(job.metadata, layer=job.layer)
        else:
            self.store_step(job.metadata)

    def store_step(self, metadata: KVPlugMetadata | None) -> None:
        """The step's store, once its forward is over (``wait_for_save``): the step's loads end
        first (:meth:`wait_loads`: a store never reads a block a load is still writing, and a
        load's failure is recorded before the store asks what it taints), then everything the
        step computed over a failed load is left out."""
        self.wait_loads()
        self.stores.start(metadata, skip=self.loads.reports.tainted(metadata))

    def finished(self, finished: Collection[str], idle: bool = False) -> Finished:
        """The transfers that are over: requests vLLM may free (``finished``: those vLLM
        finished since the last step), background loads written (``idle``: the step ran no
        forward, so wait a little for a fetch)."""
        sending = self.stores.finished(finished)
        return Finished(sending, self.loads.finished(finished, idle))

    # -- waits: each for what vLLM (or a lookup) needs next ---------------------------------------
    def wait_loads(self) -> None:
        """The step's in-step loads are over (every layer written) and their outcomes recorded
        (:meth:`.load.Loads.wait_all`)."""
        self.loads.wait_all()

    def wait_layer(self, layer: str) -> None:
        """Layer-wise: the step's loads wrote every layer up to ``layer``
        (``wait_for_layer_load``: vLLM computes it next; :meth:`.load.Loads.wait_layer`)."""
        self.loads.wait_layer(layer)

    def wait_freed(self, freed: Collection[str]) -> None:
        """``handle_preemptions``: the coming forward, which may rewrite the blocks vLLM freed
        (``freed``: preempted requests; sliding-window blocks always), comes after every copy
        that reads them (:meth:`.store.Stores.wait_freed`)."""
        self.stores.wait_freed(freed)

    def wait_puts(self, keys: Collection[CacheKey], timeout: float) -> bool:
        """A lookup: the puts of ``keys`` are over; False if they did not end within
        ``timeout`` seconds (:meth:`.store.Stores.wait_puts`)."""
        return self.stores.wait_puts(keys, timeout)

    def wait_idle(self) -> None:
        """Sleep: every transfer stops touching the KV memory (every load is over, every copy has
        read its blocks; puts may go on, they read host memory only)."""
        self.wait_loads()
        self.stores.wait_copies()

    def warm_up(self) -> None:
        """Set up now (vLLM registering its KV cache, before any step) what the first store and
        the first load would otherwise set up on the way: the save thread, the background-load
        threads, the tiers' call threads, and the copy paths between blocks and L1 memory, run
        once on block 0 of every layer (read, then written back with its own bytes: vLLM has
        run nothing on the cache yet). benchmarks/bench_first_request.py measures the first
        store and load against the second."""
        self.loads.background.start_threads()
        if self.stores.saves is not None:
            self.stores.saves.start_threads()
        storage, kv = self.loads.storage, self.loads.kv
        storage.start_threads()
        page = storage.allocate((kv.num_layers, 1, kv.page_bytes), num_tokens=1)
        if page is None:
            return
        try:
            gather_many(kv, [PageJob([0], page.tensor)])
            scatter_many(kv, [PageJob([0], page.tensor)])
        finally:
            page.ref_down()

    def close(self) -> None:
        """Drop the loads in flight; finish every save (before the tiers close)."""
        self.loads.close()
        self.stores.close()
