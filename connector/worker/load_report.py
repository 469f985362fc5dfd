"""The one record of how a worker's loads ended, until each party takes its part.

Every finished load's :class:`.recovery.LoadOutcome` (and every step's
:class:`.recovery.UnwrittenRead`) is recorded here once, through the recovery rule
(:func:`.recovery.recover`), and becomes what vLLM and people see: the blocks vLLM recomputes
(``get_block_ids_with_load_errors``, or ``failed_recving`` by request with several KV cache
groups), the per-request result the scheduler reads (:class:`..protocol.metadata.KVPlugWorkerMeta`),
what the step's store leaves out (:meth:`LoadReports.tainted`), the counters and latency
(:mod:`..protocol.stats`) and a log line. Kept apart from :mod:`.side`, which routes vLLM's calls,
and from :mod:`.load`, because it is bookkeeping only: it never touches a block or a tier.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..protocol.config import ConnectorConfig
from ..protocol.groups import GroupLayout
from ..protocol.metadata import KVPlugMetadata, KVPlugWorkerMeta
from ..protocol.stats import LATENCY_PREFIX, LOAD_BYTES_PREFIX, TIER_PREFIX, StatsRecorder
from . import recovery
from .recovery import LoadOutcome, UnwrittenRead

logger = logging.getLogger("kvplug.connector")


class LoadReports:
    """How a worker's loads ended, collected until taken: by vLLM (:meth:`take_load_errors`,
    :meth:`take_failed`), the scheduler (:meth:`take_report`) and the step's store
    (:meth:`tainted`). :meth:`record` is the only writer."""

    def __init__(self, cfg: ConnectorConfig, rank: int, layout: GroupLayout,
                 stats: StatsRecorder) -> None:
        self.cfg = cfg
        self.rank = rank
        self.layout = layout
        self.stats = stats
        self._recompute: set[int] = set()  # blocks vLLM recomputes (one KV cache group)
        self._failed_requests: set[str] = set()  # several groups: by request, not by block
        self._meta = KVPlugWorkerMeta()  # for the scheduler
        self._skip_requests: set[str] = set()  # the step's store leaves these out...
        self._skip_blocks: set[int] = set()  # ...and the step's requests holding one of these

    def record(self, outcome: LoadOutcome | UnwrittenRead, tier_order: Sequence[str] = ()) -> None:
        """A load is over (or a step reads unwritten blocks): what it leads to
        (:func:`.recovery.recover`), its result, stats and a log line (``tier_order``: the
        tiers fastest first, for the latency of the farthest one it read from)."""
        got = recovery.recover(outcome, self.layout.multi)
        self._recompute.update(got.recompute)
        if got.failed_request is not None:
            self._failed_requests.add(got.failed_request)
        self._meta.num_failed_blocks.update(got.num_failed_blocks)
        for req_id, tok in got.store_from.items():
            self._meta.failed_from[req_id] = min(tok, self._meta.failed_from.get(req_id, tok))
        if got.skip_request is not None:
            self._skip_requests.add(got.skip_request)
        self._skip_blocks |= got.skip_blocks
        for name, value in got.counters.items():
            self.stats.add(name, value)
        if got.warning:
            logger.warning("%s", got.warning)
        if isinstance(outcome, LoadOutcome):
            self._loaded(outcome, tier_order)

    def _loaded(self, outcome: LoadOutcome, tier_order: Sequence[str]) -> None:
        """What a load moved: the per-request result, the counters, the latency, a log line."""
        req_id, per_tier, dt = outcome.req_id, dict(outcome.tokens), outcome.seconds
        loaded, nbytes = sum(per_tier.values()), sum(outcome.nbytes.values())
        self._meta.loaded[req_id] = per_tier
        self._meta.load_ms[req_id] = dt * 1e3
        for name, value in (("loads", 1), ("load_tokens", loaded), ("load_bytes", nbytes),
                            ("load_seconds", dt)):
            self.stats.add(name, value)
        for tier, n in per_tier.items():
            self.stats.add(TIER_PREFIX + tier, n)
            self.stats.add(LOAD_BYTES_PREFIX + tier, outcome.nbytes[tier])
        if per_tier and tier_order:  # latency by the farthest tier it read from
            self.stats.observe(LATENCY_PREFIX + max(per_tier, key=tier_order.index), dt)
        if self.cfg.log_every_load and loaded and self.rank == 0:
            logger.info("kvplug: request %s loaded %d tokens (%s) in %.1f ms (%.2f GB/s)",
                        req_id, loaded, ", ".join(f"{n} from {t}" for t, n in per_tier.items()),
                        dt * 1e3, nbytes / dt / 1e9 if dt > 0 else 0.0)

    def take_report(self) -> KVPlugWorkerMeta | None:
        """Per-request load results since the last call (for the scheduler)."""
        if not self._meta:
            return None
        out, self._meta = self._meta, KVPlugWorkerMeta()
        return out

    def take_failed(self) -> set[str]:
        """Requests whose load failed (several KV cache groups: vLLM's ``failed_recving``)."""
        out, self._failed_requests = self._failed_requests, set()
        return out

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        out, self._recompute = self._recompute, set()
        return out

    def tainted(self, metadata: KVPlugMetadata | None) -> set[str]:
        """The requests whose KV this step computed over a failed load (theirs, or a block of
        theirs that failed, or an unwritten block it read), so nothing of theirs is stored;
        forgets the step's failures (called once per step, when its store starts)."""
        out, self._skip_requests = self._skip_requests, set()
        bad, self._skip_blocks = self._skip_blocks, set()
        if metadata is not None and bad:
            out |= {r.req_id for r in metadata.requests if bad.intersection(r.block_ids, *r.tables)}
        return out
