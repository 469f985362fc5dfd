"""The last step of a worker's load (the path is in :mod:`.load`): its outcome.

A finished load becomes what vLLM and people see: the failed blocks (vLLM recomputes them:
``get_block_ids_with_load_errors``, or ``failed_recving`` by request with several KV cache
groups), the per-request result the scheduler reads (:class:`..protocol.metadata.KVPlugWorkerMeta`), the
counters and latency (:mod:`..protocol.stats`) and a log line. Kept apart from :mod:`.side`, which routes
vLLM's calls, and from :mod:`.load`, because it is bookkeeping only: it never touches a block or
a tier.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvplug.gpu import PagedKV

from ..protocol.config import ConnectorConfig
from ..protocol.groups import GroupLayout
from ..protocol.metadata import KVPlugWorkerMeta
from ..protocol.stats import LATENCY_PREFIX, LOAD_BYTES_PREFIX, TIER_PREFIX, StatsRecorder

if TYPE_CHECKING:
    from .load import RequestLoad

logger = logging.getLogger("kvplug.connector")


class LoadReports:
    """What a worker's finished loads tell vLLM and the scheduler, collected until taken."""

    def __init__(self, cfg: ConnectorConfig, rank: int, layout: GroupLayout,
                 stats: StatsRecorder) -> None:
        self.cfg = cfg
        self.rank = rank
        self.layout = layout
        self.stats = stats
        self._errors: set[int] = set()  # failed blocks (one KV cache group)
        self._failed: set[str] = set()  # several groups: failed loads, by request (not blocks)
        self._meta = KVPlugWorkerMeta()

    def record(self, ld: RequestLoad, kv: PagedKV, tier_order: list[str]) -> None:
        """The load is over: its failed blocks, its result, stats and a log line (``tier_order``:
        the tiers fastest first, for the latency of the farthest one it read from)."""
        r = ld.req
        if ld.fail_at is not None:
            bad = ld.error_blocks()
            if self.layout.multi:  # vLLM maps block ids to requests only with one group
                self._failed.add(r.req_id)
            else:
                self._errors.update(bad)
            self._meta.failed_blocks[r.req_id] = len(bad)
            first = max(ld.fail_at, ld.spec.start)
            self._meta.failed_from[r.req_id] = min(first, self._meta.failed_from.get(r.req_id,
                                                                                     first))
            self.stats.add("load_failures")
            self.stats.add("failed_blocks", len(bad))
            logger.warning("kvplug: request %s: chunk at token %d is missing or invalid; %d "
                           "blocks (tokens %d-%d) will be recomputed", r.req_id, ld.fail_at,
                           len(bad), max(ld.fail_at, ld.spec.start), ld.spec.write_end)
        per_tier: dict[str, int] = {}
        tier_bytes: dict[str, int] = {}
        loaded = nbytes = 0
        for c in ld.loaded():
            n = (min(c.end, ld.spec.write_end) - max(c.start, ld.spec.start)) if c.counts else 0
            per_tier[c.tier] = per_tier.get(c.tier, 0) + n
            loaded += n
            b = len(c.block_ids) * kv.num_layers * kv.page_bytes
            tier_bytes[c.tier] = tier_bytes.get(c.tier, 0) + b
            nbytes += b
        dt = ld.seconds
        self._meta.loaded[r.req_id] = per_tier
        self._meta.load_ms[r.req_id] = dt * 1e3
        for name, value in (("loads", 1), ("load_tokens", loaded), ("load_bytes", nbytes),
                            ("load_seconds", dt)):
            self.stats.add(name, value)
        for tier, n in per_tier.items():
            self.stats.add(TIER_PREFIX + tier, n)
            self.stats.add(LOAD_BYTES_PREFIX + tier, tier_bytes[tier])
        if per_tier and tier_order:  # latency by the farthest tier it read from
            self.stats.observe(LATENCY_PREFIX + max(per_tier, key=tier_order.index), dt)
        if self.cfg.log_every_load and loaded and self.rank == 0:
            logger.info("kvplug: request %s loaded %d tokens (%s) in %.1f ms (%.2f GB/s)",
                        r.req_id, loaded, ", ".join(f"{n} from {t}" for t, n in per_tier.items()),
                        dt * 1e3, nbytes / dt / 1e9 if dt > 0 else 0.0)

    def take_report(self) -> KVPlugWorkerMeta | None:
        """Per-request load results since the last call (for the scheduler)."""
        if not self._meta:
            return None
        out, self._meta = self._meta, KVPlugWorkerMeta()
        return out

    def take_failed(self) -> set[str]:
        """Requests whose load failed (several KV cache groups: vLLM's ``failed_recving``)."""
        out, self._failed = self._failed, set()
        return out

    def unwritten(self, blocks: list[int], failed_from: dict[str, int]) -> None:
        """Blocks a step reads that a failed load left unwritten: load errors of the step;
        ``failed_from``: per request that reads one, its first such token (the scheduler stores
        from there again, as after a failed load)."""
        self._errors.update(blocks)
        for req_id, tok in failed_from.items():
            self._meta.failed_from[req_id] = min(tok, self._meta.failed_from.get(req_id, tok))
        self.stats.add("unwritten_reads", len(blocks))
        logger.warning("kvplug: blocks %s hold no KV (a failed load's, freed before vLLM "
                       "recomputed them) and were hit in vLLM's prefix cache: reported as load "
                       "errors, so vLLM recomputes them", blocks)

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        out, self._errors = self._errors, set()
        return out
