"""How a worker's load ends, and what a failure leads to: one value, one rule.

Every load job (one request's load, in a step or in the background) ends in one frozen
:class:`LoadOutcome`, as each job of vLLM's offloading worker ends in one
``TransferResult(job_id, success)``. A step whose forward reads blocks an earlier failed load left
unwritten ends in an :class:`UnwrittenRead` (no transfer, the same consequences). :func:`recover`
is the recovery rule: from either, a :class:`Recovery` saying

* which blocks vLLM recomputes (``get_block_ids_with_load_errors``) or, with several KV cache
  groups, which request (``failed_recving``: vLLM maps block ids to requests only with one);
* per request, the first token the scheduler stores again from and how many blocks it lost
  (:class:`..protocol.metadata.KVPlugWorkerMeta`);
* what the step's store leaves out: KV its forward computed over the failure;
* the counters and the log line.

:class:`.load_report.LoadReports` records every outcome through this rule and hands each part to
whoever takes it. Nothing here touches a block or a tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvplug.gpu import num_pages

#: Why a load's first failed chunk failed (:attr:`LoadOutcome.reason`), as the log line says it.
MISSING = "is missing"  # no tier returned it: a miss, a read that raised or ran past the step
INVALID = "is invalid"  # what came back is not what this engine stores (shape, format, tokens)
UNREACHABLE = "is in no tier this load may read"  # no pin on this rank, and not in a tier
#                                                   that never blocks (an in-step load)
NO_BLOCKS = "has no blocks"  # the block table does not reach it
NO_STAGING = "has no memory to stage its layers in"  # a layer-by-layer read
STALE = "was fetched under older weights"  # a background load planned before a weights reset


@dataclass(frozen=True)
class LoadOutcome:
    """How one request's load job ended: whether every chunk reached its blocks, else the
    first token of the first chunk that failed and why, with what it moved (for the report)."""

    req_id: str
    failed_at: int | None  # first token of the first chunk that failed; None: every one loaded
    reason: str  # why that chunk failed ("" on success; one of this module's constants)
    start: int  # the load's first token (vLLM already holds the blocks before it)
    write_end: int  # where its writes end (vLLM computes the blocks after it)
    block_ids: tuple[int, ...]  # the request's block table (the first KV cache group)
    block_size: int
    in_step: bool  # this step's forward reads its blocks (an in-step load, not a background one)
    tokens: Mapping[str, int] = field(default_factory=dict)  # tokens loaded, per tier
    nbytes: Mapping[str, int] = field(default_factory=dict)  # bytes moved, per tier
    seconds: float = 0.0

    @property
    def success(self) -> bool:
        return self.failed_at is None


@dataclass(frozen=True)
class UnwrittenRead:
    """A step's forward reads ``blocks`` an earlier failed load left unwritten
    (``KVPlugMetadata.unwritten``, :mod:`..scheduler.unwritten`); ``first_token``: per request of
    the step that reads one, its first such token."""

    blocks: tuple[int, ...]
    first_token: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Recovery:
    """What one outcome leads to (empty: nothing failed)."""

    recompute: tuple[int, ...] = ()  # blocks vLLM recomputes (get_block_ids_with_load_errors)
    failed_request: str | None = None  # several KV cache groups: vLLM recomputes the request
    store_from: Mapping[str, int] = field(default_factory=dict)  # per request: stored again from
    num_failed_blocks: Mapping[str, int] = field(default_factory=dict)  # per request: blocks recomputed
    skip_request: str | None = None  # the step's store leaves this request out...
    skip_blocks: frozenset[int] = frozenset()  # ...and every request that holds one of these
    counters: Mapping[str, int] = field(default_factory=dict)  # stats to add
    warning: str = ""  # the log line ("": none)


def recompute_blocks(outcome: LoadOutcome) -> tuple[int, ...]:
    """The blocks a failed load left without valid KV, which vLLM recomputes: from its first
    failed token (or vLLM's own hit, if later) to where its writes end."""
    if outcome.failed_at is None:
        return ()
    first, size = max(outcome.failed_at, outcome.start), outcome.block_size
    return outcome.block_ids[first // size:num_pages(outcome.write_end, size)]


def recover(what: LoadOutcome | UnwrittenRead, multi: bool) -> Recovery:
    """The recovery rule (see the module docstring); ``multi``: the model has several KV cache
    groups. A failed load: vLLM recomputes its blocks (with several groups, the request), the
    scheduler stores it again from its first failed token, and if this step's forward read it,
    the step stores nothing of it nor of any request holding one of its blocks. An unwritten
    read fails like a load into those blocks: vLLM recomputes them, each request that read one
    is stored again from there, and the step stores nothing of the requests that hold them."""
    if isinstance(what, UnwrittenRead):
        return Recovery(
            recompute=what.blocks, store_from=dict(what.first_token),
            skip_blocks=frozenset(what.blocks),
            counters={"unwritten_reads": len(what.blocks)},
            warning=f"kvplug: blocks {list(what.blocks)} hold no KV (a failed load's, freed "
                    "before vLLM recomputed them) and were hit in vLLM's prefix cache: reported "
                    "as load errors, so vLLM recomputes them")
    if what.success:
        return Recovery()
    blocks = recompute_blocks(what)
    first = max(what.failed_at, what.start)  # type: ignore[type-var]
    return Recovery(
        recompute=() if multi else blocks, failed_request=what.req_id if multi else None,
        store_from={what.req_id: first}, num_failed_blocks={what.req_id: len(blocks)},
        skip_request=what.req_id if what.in_step else None,
        skip_blocks=frozenset(blocks) if what.in_step else frozenset(),
        counters={"load_failures": 1, "failed_blocks": len(blocks)},
        warning=f"kvplug: request {what.req_id}: chunk at token {what.failed_at} {what.reason}; "
                f"{len(blocks)} blocks (tokens {first}-{what.write_end}) will be recomputed")
