"""What the scheduler-side connector tells the workers each step (LoadSpec / SaveSpec / ReqMeta).

Everything here is pickled inside vLLM's ``SchedulerOutput`` to every worker process, so it is
plain dataclasses of ints, bytes and lists. Token ranges are absolute positions in the request's
token sequence; chunk ``i`` covers tokens ``[i * chunk_size, min((i + 1) * chunk_size, end))`` and
is named by ``hashes[i - first_chunk]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` into the request's blocks.

    ``start`` is what vLLM already holds (its own prefix-cache hit, block aligned); ``end`` is the
    external hit. The chunks covering ``[first_chunk * chunk_size, end)`` are fetched whole and only
    the blocks at or past ``start`` are written. ``tiers`` names where lookup found each chunk.
    """

    start: int
    end: int
    first_chunk: int
    hashes: list[bytes]
    tiers: list[str] = field(default_factory=list)


@dataclass
class SaveSpec:
    """Store the chunks covering tokens ``[start, end)``; ``start`` is chunk aligned.

    Every chunk is ``chunk_size`` tokens except possibly the last, a block-aligned partial chunk
    (only with ``save_partial_chunk`` or the producer role).
    """

    start: int
    end: int
    first_chunk: int
    hashes: list[bytes]


@dataclass
class ReqMeta:
    """One request's work for this step: its current block table and what to load/store."""

    req_id: str
    block_ids: list[int]
    load: LoadSpec | None = None
    save: SaveSpec | None = None


@dataclass
class KVPlugMetadata(KVConnectorMetadata):
    """The per-step payload: one ReqMeta per request with work."""

    chunk_size: int
    block_size: int
    requests: list[ReqMeta] = field(default_factory=list)

    def chunk_range(self, spec: LoadSpec | SaveSpec, index: int) -> tuple[int, int]:
        """Token range ``[s, e)`` of the ``index``-th chunk of a spec (clipped to ``spec.end``)."""
        s = (spec.first_chunk + index) * self.chunk_size
        return s, min(s + self.chunk_size, spec.end)
