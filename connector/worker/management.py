"""A worker's answers to the API server's management calls (lookup, clear, pin, status).

The wire (messages, the service thread, the API server's client) is
:mod:`..protocol.manage`; this module is what a call does to one worker's tiers. The rule for
each call is :mod:`kvplug.management` (one rule for the engine and for
``kvplug cache ... --config``); keys are made under the worker's current weights epoch, the one
its last step ran under.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvplug.management import clear_keys, clear_tenant, clear_tiers, pin_keys, tier_status

from ..protocol.manage import ManageClear, ManageLookup, ManageMsg, ManagePin, ManageStatus

if TYPE_CHECKING:
    from .side import WorkerSide


class WorkerManagement:
    """A worker's answers to management calls, over its StorageManager and its keys: the
    ``handle`` a :class:`~..protocol.manage.ManageService` calls with each decoded message."""

    def __init__(self, worker: WorkerSide) -> None:
        self.worker = worker

    def __call__(self, msg: ManageMsg) -> dict[str, Any]:
        w = self.worker
        storage = w.storage
        if storage is None:
            raise RuntimeError("this worker has no tiers (its KV cache is not registered, or "
                               "the model has KV cache groups kvplug cannot restore)")
        base = {"rank": w.ident.rank, "pp_rank": w.ident.pp_rank, "epoch": w.epoch}
        if isinstance(msg, ManageStatus):
            return {**base, "tiers": tier_status(storage)}
        if isinstance(msg, ManageClear):
            if msg.by_tenant:
                return {**base, "tiers": clear_tenant(storage, msg.tenant, msg.tiers)}
            if msg.hashes is None:
                return {**base, "tiers": clear_tiers(storage, msg.tiers)}
            keys = [w.key(h, tenant=msg.tenant) for h in msg.hashes]
            return {**base, "tiers": clear_keys(storage, keys, msg.tiers)}
        if isinstance(msg, ManagePin):
            return {**base, "tiers": pin_keys(
                storage, [w.key(h, tenant=msg.tenant) for h in msg.hashes], msg.tiers, msg.pin,
                [w.key(h, tenant=msg.tenant) for h in msg.optional])}
        return {**base, "tiers": self._lookup(msg)}

    def _lookup(self, msg: ManageLookup) -> dict[str, dict[str, int]]:
        """Per tier: ``held``, the leading tokens the tier holds on its own (its leading full
        chunks, then the longest partial chunk inside the next one), and ``served``, the tokens
        of this worker's hit over all tiers (unpinned) that a load would read from it."""
        w, storage, chunk_size = self.worker, self.worker.storage, self.worker.cfg.chunk_size
        assert storage is not None
        keys = [w.key(h, tenant=msg.tenant) for h in msg.hashes]
        tails = sorted(((end, w.key(h, tenant=msg.tenant)) for end, h in msg.tails),
                       key=lambda t: -t[0])

        def inside(n: int) -> list[tuple[int, Any]]:  # partial chunks in chunk n, longest first
            return [(end, k) for end, k in tails if n * chunk_size < end < (n + 1) * chunk_size]

        out: dict[str, dict[str, int]] = {}
        for tier in storage.tier_names:
            held = storage.holds(tier, keys) or [False] * len(keys)
            n = next((i for i, h in enumerate(held) if not h), len(keys))
            cand = inside(n)
            got = storage.holds(tier, [k for _, k in cand]) or [False] * len(cand)
            out[tier] = {"held": next((e for (e, _), h in zip(cand, got, strict=True) if h),
                                      n * chunk_size), "served": 0}
        found = storage.lookup_prefix(keys)
        for tier in found.tiers:
            out[tier]["served"] += chunk_size
        for end, k in inside(found.num_chunks):
            if (tier := storage.contains(k)) is not None:
                out[tier]["served"] += end - found.num_chunks * chunk_size
                break
        return out


__all__ = ["WorkerManagement"]
