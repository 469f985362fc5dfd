"""The worker's transfers, in one shape for both directions.

A load moves KV from the tiers into vLLM's blocks (:mod:`.load`), a store from the blocks into
the tiers (:mod:`.store`). Both are jobs of an engine step that the worker submits, reports when
they are over, and waits for when vLLM is about to need what they touch, as vLLM's own offloading
worker does (``transfer_async``, ``get_finished``, ``wait``):

================================  ==============================================================
``expect(md)``                    ``bind_connector_metadata``: the step's saves are held until
                                  submitted; the unwritten blocks it reads are load errors
``submit(Load(md))``              ``start_load_kv``: the step's loads
``submit(Store(md, layer))``      ``save_kv_layer``: that layer of the step's store
``submit(Store(md))``             ``wait_for_save``: the step's loads end, then its store
``finished(finished, idle)``      ``get_finished``: (``finished_sending``, ``finished_recving``)
``wait(layer=...)``               ``wait_for_layer_load``: the loads wrote every layer up to it
``wait(freed=...)``               ``handle_preemptions``: copies that read freed blocks come first
``wait(puts=..., timeout=...)``   a lookup: the puts of these chunks are over
``wait()``                        sleep: every load is over, every copy has read its blocks
================================  ==============================================================

The one rule between the directions lives here: a step's store comes after its loads, and leaves
out every request whose KV the step computed over a failed load (:meth:`.load.Loads.tainted`).
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
    """Tiers -> blocks: every load ``md`` names (None: the step has none)."""

    md: KVPlugMetadata | None


class Store(NamedTuple):
    """Blocks -> tiers: the chunks ``md`` saves; ``layer``: layer-wise, only the layer just
    computed (None: the step's forward is over, store what is left)."""

    md: KVPlugMetadata | None
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

    def expect(self, md: KVPlugMetadata) -> None:
        """vLLM bound the coming step's metadata (before its forward and any ``get_finished``
        of the step, in every vLLM version and call order)."""
        self.loads.expect(md)
        self.stores.expect(md)

    def submit(self, job: Load | Store) -> None:
        """Start ``job`` (see the module docstring)."""
        if isinstance(job, Load):
            self.loads.submit(job.md)
        elif job.layer is not None:
            self.stores.submit(job.md, layer=job.layer)
        else:
            self.loads.wait()  # the step's loads are over (a failed one taints its store)
            skip = self.loads.tainted(job.md)  # computed over a failed load: not stored
            self.stores.submit(job.md, skip=skip)

    def finished(self, finished: Collection[str], idle: bool = False) -> Finished:
        """The transfers that are over: requests vLLM may free (``finished``: those vLLM
        finished since the last step), background loads written (``idle``: the step ran no
        forward, so wait a little for a fetch)."""
        sending = self.stores.finished(finished)
        return Finished(sending, self.loads.finished(finished, idle))

    def wait(self, *, layer: str | None = None, freed: Collection[str] | None = None,
             puts: Collection[CacheKey] | None = None, timeout: float = 0.0) -> bool:
        """Wait for what vLLM (or a lookup) needs next (one of the keywords; see the module
        docstring): ``layer`` (:meth:`.load.Loads.wait`), ``freed`` or ``puts`` with ``timeout``
        (:meth:`.store.Stores.wait`; False: the puts did not end in time), or nothing: every
        transfer stops touching the KV memory."""
        if layer is not None:
            self.loads.wait(layer)
            return True
        if freed is not None or puts is not None:
            return self.stores.wait(freed=freed, puts=puts, timeout=timeout)
        self.loads.wait()
        return self.stores.wait()

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
