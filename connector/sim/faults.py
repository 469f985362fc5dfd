"""The faults and client actions a schedule injects, as a part of :class:`.world.World`: aborts,
evictions, chunks lost or corrupted after lookup, gated (slow) tiers, the value store's outages
and partial replies, a neighbour process on rank 0's directory, ``reset_cache``, and what
happens when vLLM's own scheduler stalls (every request aborted, as clients that time out).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .world import World


def _flipped(data: bytes, pick: int) -> bytes:
    """``data`` (a chunk file or value) with one byte flipped inside a layer's bytes (``pick``
    chooses the layer); the last byte where the header cannot be parsed. Not the last byte: it
    is the last layer's alignment padding, which no read ever sees."""
    from kvplug import chunkfile as cf

    out = bytearray(data)
    if not out:
        return data
    try:
        header = cf.decode_header(bytes(out[:cf.header_size(bytes(out[:8]))]), len(out))
        offsets = header.data_offsets
        at = offsets[pick % len(offsets)] + (pick * 7) % max(1, header.layer_nbytes)
    except Exception:  # noqa: BLE001 - not a chunk we can parse: the last byte
        at = len(out) - 1
    out[at] ^= 0xFF
    return bytes(out)


class Faults:
    """The fault events of :class:`.world.World`. They act on the world's scheduler (``s``,
    through :meth:`.World.crashing`), workers and their tiers, the value stores, the neighbour
    process (``neighbour``), and pick chunks from what the tiers held (:attr:`.ChunkCheck.stored`,
    ``registry``). Its state: per rank, the chunks lost until the step ends."""

    def __init__(self, world: World) -> None:
        self.world = world
        #: per rank: keys whose reads find nothing until the current (or next) step ends
        self.lost: list[set] = [set() for _ in range(world.cfg.tp)]

    def step_ended(self) -> None:
        """The step's losses end with it."""
        for lost in self.lost:
            lost.clear()

    def abort(self, pick: int) -> None:
        from vllm.v1.request import RequestStatus

        w = self.world
        live = sorted(r for r, q in w.scheduler.requests.items()
                      if not RequestStatus.is_finished(q.status))
        if live:
            w.counts["abort " + w.scheduler.requests[live[pick % len(live)]].status.name] += 1
            w.crashing("abort", lambda: w.scheduler.finish_requests(
                live[pick % len(live)], RequestStatus.FINISHED_ABORTED))

    def evict(self, rank: int, tier: str, pick: int | None) -> None:
        """One stored chunk (``pick``) evicted from a tier of ``rank`` (or from all); every
        chunk it holds when ``pick`` is None."""
        w = self.world
        keys = w.chunks.stored[rank]
        if keys:
            st = w.workers[rank].storage
            st.flush(5)
            st.evict(keys=list(keys) if pick is None else [keys[pick % len(keys)]],
                     tiers=None if tier == "all" else [tier])

    def lose(self, rank: int, pick: int) -> None:
        """Reads of a stored chunk on ``rank`` find nothing, in every tier, until the current (or
        next) step ends (a chunk missing at load time although lookup found it: evicted,
        deleted, unreadable)."""
        worker = self.world.workers[rank]
        pinned = [k for r in sorted(worker._pins) for k in worker._pins[r][0]]
        keys = pinned or self.world.chunks.stored[rank]  # preferably one a lookup just promised
        if keys:
            self.lost[rank].add(keys[pick % len(keys)])

    def lose_once(self, rank: int, key: Any, res: Any) -> Any:
        if res is not None and key in self.lost[rank]:  # lost until the step ends
            res.ref_down()
            return None
        return res

    def corrupt(self, rank: int, pick: int) -> None:
        w = self.world
        st = w.workers[rank].storage
        st.flush(5)
        from .values import STORES

        store = STORES.get(w.urls[rank])
        if store is not None and (w.cfg.lower == "values" or pick % 2):
            # the value store (behind L1, or behind posix every other pick): a byte flipped
            names = sorted(store.values)
            if names:
                name = names[pick % len(names)]
                store.values[name] = _flipped(store.values[name], pick)
            return
        files = sorted(p for p in w.disk_dir(rank).rglob("*") if p.is_file()
                       and not p.name.startswith("."))
        if files:
            f = files[pick % len(files)]
            mtime = f.stat().st_mtime_ns  # the tier's LRU stamp, from the simulated clock
            f.write_bytes(_flipped(f.read_bytes(), pick))
            os.utime(f, ns=(mtime, mtime))  # not the real clock's, which would not replay

    def gate(self, rank: int, on: bool) -> None:
        w = self.world
        st = w.workers[rank].storage
        for t in st._tiers:
            if t.pool is not None:
                t.pool.gated = on

    def gate_remote(self, rank: int, on: bool) -> None:
        """A three-tier stack's remote tier (the value store behind posix) blocks or answers
        again: its calls time out while it blocks (with ``late``, their results arrive when it
        answers again)."""
        w = self.world
        st = w.workers[rank].storage
        for t in st._tiers:
            if t.name == "values" and t.pool is not None:
                t.pool.gated = on

    def outage(self, rank: int, on: bool) -> None:
        """The value store of ``rank`` goes down (every call raises) or comes back."""
        from .values import STORES

        w = self.world
        st = STORES.get(w.urls[rank])
        if st is not None:
            st.down = on

    def partial(self, rank: int) -> None:
        """The value store's next batch read answers only its first half."""
        from .values import STORES

        w = self.world
        st = STORES.get(w.urls[rank])
        if st is not None:
            st.partial += 1

    def neighbour(self, op: str, pick: int) -> None:
        """Another engine process (same model, rank 0) on rank 0's posix directory: it stores
        a chunk rank 0 planned (the oracle's bytes: it computed the same KV), which rank 0's
        lookups then find on disk though it may never have written it, or evicts one by name
        (its file unlinked at once, even while rank 0 holds a lookup's pin on it)."""
        w = self.world
        neighbour = w.neighbour
        keys = list(w.chunks.registry[0])
        if neighbour is None or not keys:
            return
        key = keys[pick % len(keys)]
        w.counts[f"neighbour {op}"] += 1
        if op == "evict":
            neighbour.evict(keys=[key])
            return
        from kvplug.memory import heap_memory_obj

        want = w.chunks.expected(0, key)
        _, s, e, _ = w.chunks.registry[0][key]
        if "neighbour_wrong_bytes" in w.cfg.faults:  # the control: another chunk's bytes
            other = w.chunks.expected(0, keys[(pick + 1) % len(keys)])
            if other is not None and other.shape == want.shape:
                want = other
        obj = heap_memory_obj(tuple(want.shape), want.dtype, num_tokens=e - s)
        obj.tensor.copy_(want)
        try:  # I8: stored again once the neighbour hands it to its tier (ChunkCheck)
            neighbour.batched_put([key], [obj])
        finally:
            obj.ref_down()

    def reset(self) -> None:
        w = self.world
        fn = getattr(w.scheduler.connector, "reset_cache", None)
        if fn is not None:
            w.crashing("reset_cache", fn)

    def vllm_stalled(self) -> bool:
        """vLLM 0.32's scheduler stuck with nothing kvplug owes it: no request running, every
        load reported (``finished_recving``), nothing queued; the requests that loaded hold the
        cache while the head of the waiting queue needs blocks to go on (waiting requests are
        never preempted). Seen with caches that hold less than two requests and several
        asynchronous loads; not a kvplug violation: vLLM's own scheduler cannot go on (benchmarks/JOURNAL.md, the
        deterministic simulation)."""
        from vllm.v1.request import RequestStatus

        w = self.world
        reqs = list(w.scheduler.requests.values())
        serving = getattr(w.lookup, "serving", lambda f: False)  # the lookups' answers
        owed = [f for f in w.runtime.queue  # (the workers' stats sampler: a gauge, owed nobody)
                if not serving(f) and f.pool.name != "kvplug-tenant-stats"]
        if owed or not reqs:
            return False
        waiting = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS,
                   RequestStatus.PREEMPTED)
        if any(q.status not in waiting for q in reqs):  # running, or held for kvplug's saves
            return False
        remote = [q.request_id for q in reqs if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        return all(r in w.scheduler.finished_recving_kv_req_ids for r in remote)

    def abort_all(self) -> None:
        """Abort every request (as clients that time out): kvplug must still end clean (I5)."""
        from vllm.v1.request import RequestStatus

        w = self.world
        live = sorted(r for r, q in w.scheduler.requests.items()
                      if not RequestStatus.is_finished(q.status))
        if live:
            w.crashing("abort", lambda: w.scheduler.finish_requests(
                live, RequestStatus.FINISHED_ABORTED))
