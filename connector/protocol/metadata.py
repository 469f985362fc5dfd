"""The messages between the two sides: what the scheduler-side connector tells the workers each
step (LoadSpec / SaveSpec / ReqMeta in KVPlugMetadata), and what the workers tell it back (load
results, KVPlugWorkerMeta; their tiers' KV events, KVPlugKVEvents).

Everything here is pickled inside vLLM's ``SchedulerOutput`` to every worker process, so it is
plain dataclasses of ints, bytes and lists. Token ranges are absolute positions in the request's
token sequence; chunk ``i`` covers tokens ``[i * chunk_size, min((i + 1) * chunk_size, end))`` and
is named by ``hashes[i - first_chunk]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` into the request's blocks.

    ``start`` is what vLLM already holds (its own prefix-cache hit, block aligned); ``end`` is the
    external hit. The chunks covering ``[first_chunk * chunk_size, end)`` are fetched whole and only
    the blocks at or past ``start`` are written. ``background``: vLLM loads it asynchronously (a
    chunk is in a tier that may block); the workers report it in ``finished_recving``. ``upto``:
    no block at or past it is written (an EAGLE/MTP drafter: vLLM recomputes the last block of
    the stored range, see :mod:`kvplug.connector.scheduler.side`); None: up to ``end``.
    """

    start: int
    end: int
    first_chunk: int
    hashes: list[bytes]
    background: bool = False
    upto: int | None = None

    @property
    def write_end(self) -> int:
        """Where the blocks written stop (the tokens vLLM takes as loaded)."""
        return self.end if self.upto is None else min(self.upto, self.end)


@dataclass
class SaveSpec:
    """Store the chunks covering tokens ``[start, end)``; ``start`` is chunk aligned.

    Every chunk is ``chunk_size`` tokens except possibly the last, a block-aligned partial chunk
    (with ``save_partial_chunk``, the default, or the producer role).
    """

    start: int
    end: int
    first_chunk: int
    hashes: list[bytes]


@dataclass
class ReqMeta:
    """One request's work for this step: its current block table and what to load/store.
    ``finished``: vLLM finished the request and frees its blocks once the workers report this
    save done (``finished_sending``). ``tables``: with several KV cache groups, each group's
    block table (``block_ids`` is group 0's); see :mod:`.groups`."""

    req_id: str
    block_ids: list[int]
    load: LoadSpec | None = None
    save: SaveSpec | None = None
    finished: bool = False
    tables: tuple[list[int], ...] = ()  # every KV cache group's block table (hybrid models only)
    tenant: str = ""  # the request's tenant id (kvplug.policies.tenants.tenant_id): in its keys


@dataclass
class KVPlugMetadata(KVConnectorMetadata):
    """The per-step payload: one ReqMeta per request with work."""

    chunk_size: int
    block_size: int
    requests: list[ReqMeta] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # vLLM freed their blocks this step
    #: the weights epoch this step's loads and stores are keyed under (``reset_cache`` draws a
    #: new one; the workers switch before anything else of the step)
    epoch: str = ""
    #: vLLM scheduled no token this step (it runs no forward pass; only waits on loads)
    idle: bool = False
    #: (an idle step) requests wait for chunks a producer named (..scheduler.handoff): the
    #: step pauses a little, rather than vLLM running empty steps back to back meanwhile
    handoffs: bool = False
    #: blocks this step reads that a failed load left unwritten: every worker reports them as
    #: load errors, so vLLM recomputes them (see :mod:`..scheduler.unwritten`)
    unwritten: list[int] = field(default_factory=list)

    def chunk_range(self, spec: LoadSpec | SaveSpec, index: int) -> tuple[int, int]:
        """Token range ``[s, e)`` of the ``index``-th chunk of a spec (clipped to ``spec.end``)."""
        s = (spec.first_chunk + index) * self.chunk_size
        return s, min(s + self.chunk_size, spec.end)


@dataclass
class KVPlugWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: per request, tokens loaded per tier,
    load time and blocks that failed (so the scheduler can report it in ``kv_transfer_params``).
    Merged across TP ranks: rank loads agree, failures take the maximum (the first failed
    token, the minimum)."""

    loaded: dict[str, dict[str, int]] = field(default_factory=dict)
    load_ms: dict[str, float] = field(default_factory=dict)
    num_failed_blocks: dict[str, int] = field(default_factory=dict)
    #: first token whose load failed, per request (the scheduler stores from there again)
    failed_from: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPlugWorkerMeta:
        if isinstance(other, KVPlugWorkerMeta):
            for req_id, tiers in other.loaded.items():
                self.loaded.setdefault(req_id, tiers)
            for req_id, ms in other.load_ms.items():
                self.load_ms[req_id] = max(ms, self.load_ms.get(req_id, 0.0))
            for req_id, n in other.num_failed_blocks.items():
                self.num_failed_blocks[req_id] = max(n, self.num_failed_blocks.get(req_id, 0))
            for req_id, tok in other.failed_from.items():
                self.failed_from[req_id] = min(tok, self.failed_from.get(req_id, tok))
        return self

    def __bool__(self) -> bool:
        return bool(self.loaded or self.num_failed_blocks or self.failed_from)


# -- KV events: which chunks each worker's tiers took and lost (..worker.tier_watch) --------------
class TierEvent(NamedTuple):
    """One worker's news: chunk ``chunk_hash`` entered (``stored``) or left tier ``tier``, about
    its key under weights ``epoch`` (the scheduler's book drops news of another epoch than its
    own: a step's news may reach it after ``reset_cache``)."""

    stored: bool
    tier: str
    chunk_hash: bytes
    epoch: str = ""


class KVPlugKVEvents(KVConnectorKVEvents):
    """A step's :class:`TierEvent` list from the workers (vLLM concatenates them across workers;
    the scheduler's :class:`..scheduler.events.TierEventBook` counts ranks itself, across steps)."""

    def __init__(self, events: Iterable[TierEvent] = (), num_workers: int = 1) -> None:
        self.events: list[Any] = list(events)
        self.num_workers = num_workers

    def add_events(self, events: list[Any]) -> None:
        self.events.extend(events)

    def aggregate(self) -> KVPlugKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events.clear()

    def __repr__(self) -> str:
        return f"<KVPlugKVEvents {len(self.events)} events from {self.num_workers} workers>"
