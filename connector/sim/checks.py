"""The invariants of the simulation (I1-I8, see connector/sim/README.md), as a part of
:class:`.world.World`: what each saved chunk must hold and the check of every stored or loaded
chunk against it (I1), vLLM's block pool, the poison and the copies in flight (I4), what the
workers report to vLLM (I3), the tiers' capacities and pins (I6, I7), and the end state (I1 over
every tier, I5). I2 is checked in the step, where the forward pass's taint is known; I8 in
:mod:`.manage`, I9 and I11 in :mod:`.clients`, I10 in :mod:`.stalls`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .engine import POISON, TENSORS, Violation
from .oracle import SLOT


def _put_check_plugin(world: Any, rank: int) -> Any:
    from kvplug.hookspecs import hookimpl

    class _Check:
        @hookimpl(wrapper=True)
        def batched_submit_put(self, keys: Any, objs: Any) -> Any:
            for k, o in zip(keys, objs, strict=False):
                try:
                    world.check_chunk(rank, k, o, "put")
                except Violation as v:  # the StorageManager takes a tier's exception for a fault
                    world.violation = world.violation or v
                    raise
            world.restored(rank, keys)  # I8: stored again, served again
            return (yield)

        @hookimpl(wrapper=True)
        def get(self, key: Any) -> Any:
            res = yield
            return loaded(key, world.lose_once(rank, key, res))

        @hookimpl(wrapper=True)
        def batched_get(self, keys: Any) -> Any:
            res = yield
            if not isinstance(res, list):
                return res
            return [loaded(k, world.lose_once(rank, k, r)) for k, r in zip(keys, res, strict=False)]

        @hookimpl(wrapper=True)
        def batched_get_nowait(self, keys: Any) -> Any:
            res = yield
            if not isinstance(res, list):
                return res
            return [loaded(k, world.lose_once(rank, k, r)) for k, r in zip(keys, res, strict=False)]

        @hookimpl(wrapper=True)
        def get_layers(self, key: Any, first_layer: int, num_layers: int) -> Any:
            res = yield
            return loaded(key, world.lose_once(rank, key, res), first_layer)

    def loaded(key: Any, obj: Any, first_layer: int = 0) -> Any:
        """I1 on what a tier returns: the oracle of its key (its layers from ``first_layer``)."""
        if obj is not None:
            world.counts["tier objects checked"] += 1
            world.check_served(rank, key)  # I8: never a chunk a clear removed
            try:
                world.check_chunk(rank, key, obj, "get", first_layer)
            except Violation as v:
                world.violation = world.violation or v
                raise
        return obj

    return _Check()


def _neighbour_store_plugin(world: Any) -> Any:
    """On the neighbour process's StorageManager: a chunk it hands its tier is stored again on
    rank 0's directory (I8 no longer applies to it), at the moment it is handed over, not when
    the neighbour queued it (a clear in between cannot see a store still queued in another
    process, and that store lands after the clear)."""
    from kvplug.hookspecs import hookimpl

    class _Stored:
        @hookimpl(wrapper=True)
        def batched_submit_put(self, keys: Any, objs: Any) -> Any:
            world.restored(0, keys)
            return (yield)

    return _Stored()


@dataclass
class ReqLog:
    sending: int = 0
    frees: int = 0
    recving: int = 0


class Checks:
    """The checks of :class:`.world.World` (a part of it: they read its scheduler, workers,
    oracle and registry)."""

    # -- I1 ---------------------------------------------------------------------------------------
    def register(self, md: Any) -> None:
        """Record what each chunk this step saves must hold (for I1)."""
        from kvplug.connector.protocol.groups import group_hash

        for r in md.requests:
            if r.save is None:
                continue
            req = self.s.requests.get(r.req_id) or self._snap.get(r.req_id, (None,))[0]
            if req is None:
                continue
            tokens = tuple(self.tokens_of(req, max(req.num_tokens, req.num_computed_tokens)))
            for i, h in enumerate(r.save.hashes):
                s, e = md.chunk_range(r.save, i)
                for rank, w in enumerate(self.workers):
                    for g in range(len(self.layout.groups)):
                        hh = group_hash(h, self.layout.groups[g]) if self.layout.multi else h
                        # under the step's weights epoch (a reset in this step switches it)
                        self.registry[rank].setdefault(w.key(hh, md.epoch, r.tenant),
                                                       (g, s, e, tokens[:e]))

    def expected(self, rank: int, key: Any) -> torch.Tensor | None:
        ent = self.registry[rank].get(key)
        if ent is None:
            return None
        g, s, e, tokens = ent
        pages = -(-(e - s) // self.bs)
        out = np.zeros((TENSORS, pages, self.bs * SLOT), dtype=np.uint8)
        for m, (gg, j) in enumerate(self.layers):
            if gg != g:
                continue
            slots = self.oracle.slots(rank, m, tokens, e)
            raw = b"".join(slots[s:e])
            flat = np.frombuffer(raw, dtype=np.uint8)
            out[j].reshape(-1)[: flat.size] = flat
        return torch.from_numpy(out)

    def check_chunk(self, rank: int, key: Any, obj: Any, where: str,
                    first_layer: int | None = None) -> None:
        """``obj`` holds the oracle's chunk of ``key`` (``first_layer``: a layer range of it
        from there, as ``get_layers`` returns)."""
        want = self.expected(rank, key)
        if want is None:
            raise Violation("I1", f"rank {rank} {where}: a chunk no save planned ({key})")
        got = obj.tensor
        if first_layer is not None and tuple(got.shape[1:]) == tuple(want.shape[1:]) \
                and first_layer + got.shape[0] <= want.shape[0]:
            want = want[first_layer:first_layer + got.shape[0]]
        if tuple(got.shape) != tuple(want.shape):
            raise Violation("I1", f"rank {rank} {where}: shape {tuple(got.shape)} != "
                                  f"{tuple(want.shape)}")
        g, s, e, _ = self.registry[rank][key]
        n = (e - s) * SLOT
        for j in range(got.shape[0]):
            a = got[j].reshape(-1)[:n]
            if not torch.equal(a, want[j].reshape(-1)[:n]):
                raise Violation("I1", f"rank {rank} {where}: chunk [{s},{e}) group {g} tensor "
                                      f"{j + (first_layer or 0)} differs from the oracle")
        seen = self.registry_seen(rank)
        if key not in seen:
            seen.add(key)
            self.stored[rank].append(key)

    def registry_seen(self, rank: int) -> set:
        if not hasattr(self, "_seen"):
            self._seen: list[set] = [set() for _ in self.workers]
        return self._seen[rank]

    # -- vLLM's block pool ------------------------------------------------------------------------
    def held_blocks(self) -> set[int]:
        mgr = self.s.kv_cache_manager
        return {b for r in self.s.requests for t in mgr.get_block_ids(r) for b in t} - {0}

    def free_blocks(self) -> set[int]:
        pool = self.s.kv_cache_manager.block_pool
        return {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}

    def poison_and_check_copies(self, when: str, so: Any, md: Any) -> None:
        """I4, right before the forward pass (the first moment vLLM may rewrite a block it
        freed: every kvplug hook that must order a copy first has run): no block vLLM handed
        back is read or written by a copy still in flight. Then every block whose content vLLM
        does not vouch for is poisoned: free blocks its prefix cache cannot serve (no block hash
        in its cached-block map), and blocks allocated since the last forward that vLLM does not
        count as computed (its own prefix hit); a copy that reads one later stores poison (I1),
        a forward that reads one is tainted (I2)."""
        free = self.free_blocks() - self.spare  # freed mid-step: the batch in flight owns them
        self.check_copies(free, when, "freed blocks")
        held = self.held_blocks()
        fresh = held - self.owned  # allocated by this schedule: vLLM's contract says garbage
        self.owned = held
        if self.cfg.prefix_caching:
            blocks = self.s.kv_cache_manager.block_pool.blocks
            free = {b for b in free if blocks[b].block_hash is None}
            fresh -= self._computed_blocks(so, md)
        if free or fresh:
            self.counts["blocks poisoned"] += len(free | fresh)
            idx = sorted(free | fresh)
            for t in self.kv:
                t.numpy()[:, idx] = POISON  # (a view: numpy's indexing costs far less here)

    def _computed_blocks(self, so: Any, md: Any) -> set[int]:
        """The blocks of this step's requests (and of the loads it starts) that vLLM counts as
        computed before the step: its own prefix hit, never a load's target."""
        loads = {r.req_id: r.load.start for r in md.requests if r.load is not None}
        mgr = self.s.kv_cache_manager
        out: set[int] = set()
        for req_id in set(so.num_scheduled_tokens) | set(loads):
            req = self.s.requests.get(req_id)
            if req is None:
                continue
            done = req.num_computed_tokens - so.num_scheduled_tokens.get(req_id, 0)
            if req_id in loads:  # vLLM's own hit ends where the load begins
                done = loads[req_id]
            for table in mgr.get_block_ids(req_id):
                out.update(table[:done // self.bs])
        return out - {0}

    def check_copies(self, blocks: set[int], when: str, what_blocks: str) -> None:
        """I4: no save copy or background load still in flight touches ``blocks`` (blocks vLLM
        may rewrite from ``when`` on)."""
        for rank, w in enumerate(self.workers):
            saves, bg = w._saves, w._background
            copies = [(f"a save copy of {sorted(job.req_ids)} reads", pj.block_ids)
                      for job in list(getattr(saves, "_jobs", ()) if saves is not None else ())
                      for pj in job.jobs]
            copies += [(f"a load of {ld.req.req_id} will write", c.block_ids)
                       for ld, _ in (list(getattr(bg, "_inflight", {}).values())
                                     if bg is not None else ())
                       for c in ld.chunks]
            for what, block_ids in copies:
                bad = blocks.intersection(block_ids)
                if bad:
                    raise Violation("I4", f"rank {rank} {when}: {what} {what_blocks} "
                                          f"{sorted(bad)}")

    def zero_new_blocks(self, so: Any, when: str) -> None:
        """vLLM's model runner zeroes the step's newly allocated blocks (an engine that needs
        it: ``new_block_ids_to_zero``), then applies the step's copy-on-write block copies;
        ``when``: where in the step the runner does it (the V2 runner before
        ``handle_preemptions``). I4 first: no copy in flight may touch a block rewritten here
        (a block a preemption or a sliding window freed, already handed to another request);
        a save that copies it later stores zeros, which I1 catches."""
        ids = set(so.new_block_ids_to_zero or ())
        cow = list(getattr(so, "kv_cache_block_copies", None) or ())
        if not ids and not cow:
            return
        self.check_copies(ids | {c.dst_block_id for c in cow}, when, "blocks it rewrites")
        self.counts["blocks zeroed by the model runner"] += len(ids)
        if ids:
            idx = sorted(ids)
            for t in self.kv:
                t.numpy()[:, idx] = 0
        for c in cow:  # attention groups never make partial hits (Mamba's): for completeness
            self.counts["copy-on-write block copies"] += 1
            for t in self.kv:
                t[:, c.dst_block_id] = t[:, c.src_block_id]

    def _count(self, rank: int, req: str, what: str) -> None:
        c = self.log.setdefault(req, ReqLog())
        if what == "sending":
            key = f"_{rank}_sent_{req}"
            if getattr(self, key, False):
                raise Violation("I3", f"rank {rank} reported {req} in finished_sending twice")
            setattr(self, key, True)
        _ = c

    def _check_reports(self, ko: Any) -> None:
        """I3 on the aggregated output, before vLLM sees it."""
        from vllm.v1.request import RequestStatus

        for r in ko.finished_sending or ():
            c = self.log.setdefault(r, ReqLog())
            c.sending += 1
            c.frees += 1
            if r not in self.s.requests:
                raise Violation("I3", f"{r} reported in finished_sending after vLLM freed it")
        for r in ko.finished_recving or ():
            c = self.log.setdefault(r, ReqLog())
            c.recving += 1
            if r not in self.s.requests:
                raise Violation("I3", f"{r} reported in finished_recving after vLLM freed it")
            st = self.s.requests[r].status
            if RequestStatus.is_finished(st):
                c.frees += 1
            elif st != RequestStatus.WAITING_FOR_REMOTE_KVS:
                raise Violation("I3", f"{r} reported in finished_recving while {st.name}")
        for r, c in self.log.items():
            if c.frees > 1 or c.sending > 1:
                raise Violation("I3", f"{r} reported finished {c.frees} times "
                                      f"(sending {c.sending}, recving {c.recving})")

    # -- I6, I7 (policies and capacity) ----------------------------------------------------------
    def watch_evictions(self, rank: int, storage: Any) -> None:
        """I7: wrap where each tier drops an entry for room (L1's ``_drop``, posix's unlink of
        victims): a victim some lookup has pinned is a violation, whatever policy chose it."""
        l1 = storage.backend("local_cpu")
        disk = storage.backend("posix") if "posix" in storage.tier_names else None
        drop = l1._drop

        def checked_drop(key: Any) -> int:
            if key in l1._pins:
                self.violation = self.violation or Violation(
                    "I7", f"rank {rank}: L1 ({self.cfg.eviction}) evicted a pinned chunk {key}")
                raise self.violation
            return drop(key)

        l1._drop = checked_drop
        for name in ("unlink_victims", "unlink_now") if disk is not None else ():
            real = getattr(disk.directory, name)

            def checked(victims: list, real: Any = real) -> int:
                pinned = [rel for rel, _ in victims if rel in disk.directory.index.pins]
                if pinned:
                    self.violation = self.violation or Violation(
                        "I7", f"rank {rank}: posix ({self.cfg.eviction}) evicted pinned "
                              f"chunk file(s) {pinned}")
                    raise self.violation
                return real(victims)

            setattr(disk.directory, name, checked)

    def check_tiers(self) -> None:
        """I6: no tier holds more than its capacity (L1: bytes and pool; posix: the bytes
        indexed and reserved by writes in flight), whatever its policies."""
        for rank, w in enumerate(self.workers):
            st = w.storage
            if st is None:
                continue
            l1 = st.backend("local_cpu")
            if l1._bytes > l1.capacity:
                raise Violation("I6", f"rank {rank}: L1 holds {l1._bytes} B over its capacity "
                                      f"{l1.capacity} ({self.cfg.eviction})")
            if "posix" not in st.tier_names:  # the value store or a backend under test
                self.counts["tier capacity checks"] += 1
                continue
            disk = st.backend("posix")
            index = disk.directory.index
            with disk.directory.lock:  # the writer thread changes these together under it
                held = index.bytes + index.reserved
                tenants = dict(index.tenants or {})
                reserved = dict(index.tenant_reserved)
            shared = (self.cfg.shared_dir or self.cfg.neighbour) and not self.cfg.strict_shared_i6
            if held > disk.capacity:
                if shared:  # other processes' files in this view (SimConfig.strict_shared_i6)
                    self.figures["posix views over capacity (shared directory)"] += 1
                    continue
                raise Violation("I6", f"rank {rank}: posix holds {held} B over its capacity "
                                      f"{disk.capacity} ({self.cfg.eviction}/{self.cfg.admission})")
            self.counts["tier capacity checks"] += 1
            if not self.cfg.tenants:
                continue
            for name, quotas, usage in (
                    ("L1", l1._quotas, l1._tenant_bytes),
                    ("posix", disk.directory.quotas, {t: n + reserved.get(t, 0) for t, n in tenants.items()})):
                for tenant, n in usage.items():
                    limit = quotas.limit(tenant)
                    if limit is not None and n > limit and shared and name == "posix":
                        self.figures["posix views over a quota (shared directory)"] += 1
                    elif limit is not None and n > limit:
                        raise Violation("I6", f"rank {rank}: tenant {tenant} holds {n} B on "
                                              f"{name}, over its quota {limit}")
                self.figures[f"{name} tenants held"] += len(usage)

    def check_end(self) -> None:
        if self.violation is not None:
            raise self.violation
        for rank, w in enumerate(self.workers):
            st = w.storage
            st.flush(10)
            for t in st._tiers:  # I1: every chunk every tier holds (decoded by its codec)
                for key in list(self.registry[rank]):
                    obj = t.hooks["get"](key=key)
                    if obj is not None:
                        try:
                            self.check_chunk(rank, key, obj, f"end, tier {t.name}")
                        finally:
                            obj.ref_down()
            if w._pins:
                raise Violation("I5", f"rank {rank}: pins held at quiescence for "
                                      f"{sorted(w._pins)}")
            saves = w._saves
            if saves is not None:
                left = (saves.in_flight(), dict(getattr(saves, "_busy", {})),
                        set(getattr(saves, "_tracked", ())), set(getattr(saves, "_finished", ())))
                if left[0] or left[1] or left[2] or left[3]:
                    raise Violation("I5", f"rank {rank}: saves tracked at quiescence {left}")
            if w._background is not None and len(w._background):
                raise Violation("I5", f"rank {rank}: {len(w._background)} loads in flight")
            stats = st.stats()
            for what, tier, stat in (("L1 evictions", "local_cpu", "evictions"),
                                     ("posix evictions", "posix", "evictions"),
                                     ("posix admission refusals", "posix", "admission_rejected")):
                self.figures[f"{what} ({self.cfg.eviction}/{self.cfg.admission})"] += \
                    int(stats.get(tier, {}).get(stat, 0))
            for stat in ("rescans", "vanished"):  # other processes' files (shared_dir)
                self.figures[f"posix {stat}"] += int(stats.get("posix", {}).get(stat, 0))
            for name, s in stats.items():
                if s.get("pinned", 0):
                    raise Violation("I5", f"rank {rank}: tier {name} holds {s['pinned']} pins")
            st.evict(tiers=["local_cpu"], nbytes=1 << 30)
            l1 = st.stats()["local_cpu"]
            if l1.get("pool_used", 0):
                raise Violation("I5", f"rank {rank}: {l1['pool_used']} B of L1's pool still in "
                                      "use with every entry evicted (a memory object leaked)")
        sched = self.s.connector.scheduler_side  # disk hits the scheduler had loaded inside the step
        self.figures["disk hits loaded inline"] += int(
            sched.stats.totals().get("inline_local_loads", 0))
        left = [f for f in self.rt.queue if f.pool.name != "kvplug-events"]  # (this check's
        if left:  # evictions woke the KV events' watch: its look comes after, I11)
            raise Violation("I5", f"{len(left)} tasks still queued")
        if threading.active_count() > self.threads0 + 8:
            raise Violation("I5", f"{threading.active_count()} threads (started with "
                                  f"{self.threads0})")
