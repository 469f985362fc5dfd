"""What clients receive and what routers are told, as parts of :class:`.world.World` with their
own state:

* **I9** (:class:`ClientCheck`), a client never receives a token the oracle would not produce:
  the simulated model samples each token from the KV its forward read (:func:`.oracle.token_of`),
  so a request whose output used wrong KV ends with other tokens; when vLLM finishes a request
  (its ``EngineCoreOutput`` says why), every token the client was sent is the oracle's next
  token after the ones before it. Requests aborted or failed (``kv_load_failure_policy``
  ``fail``) are left out.
* **I11** (:class:`EventCheck`), KV events say what the tiers hold: with vLLM's KV events on,
  kvplug's ``BlockStored`` for a tier never announces a block the tier is already announced to
  hold, its ``BlockRemoved`` only withdraws blocks announced (each once); at quiescence, after
  a last look at every tier (past the watch's back-off from a tier that did not answer and its
  wait for a store in flight: the events catch up within them), every block still announced
  for a tier is covered by a chunk that tier holds on every rank (a router that follows the
  events is sent to a miss at most that long).
"""

from __future__ import annotations

from typing import Any

from .engine import Violation
from .oracle import prefix_hashes


class ClientCheck:
    """I9 (see the module docstring)."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.prompts: dict[str, list[int]] = {}
        self.received: dict[str, list[int]] = {}

    def arrived(self, req_id: str, prompt: list[int]) -> None:
        self.prompts[req_id] = list(prompt)
        self.received[req_id] = []

    def outputs(self, engine_core_outputs: Any) -> None:
        """What ``update_from_output`` sends the clients (per client index)."""
        from vllm.v1.engine import FinishReason

        for eco in (engine_core_outputs or {}).values():
            for o in eco.outputs:
                got = self.received.setdefault(o.request_id, [])
                got.extend(o.new_token_ids)
                reason = o.finish_reason
                if reason is None:
                    continue
                c = self.world.counts
                if reason in (FinishReason.ABORT, FinishReason.ERROR):
                    c[f"requests finished {reason.name.lower()} (tokens not compared)"] += 1
                    continue
                self.check(o.request_id)
                c["requests whose tokens matched the oracle's"] += 1
                c["client tokens compared with the oracle's"] += len(got)

    def check(self, req_id: str) -> None:
        w = self.world
        prompt, got = self.prompts[req_id], self.received[req_id]
        tokens = prompt + got
        ph = prefix_hashes(tokens)
        for i, t in enumerate(got):
            p = len(prompt) + i - 1  # the position whose logits sampled it
            want = w.oracle.token(w.tp, tokens, p, ph)
            if t != want:
                raise Violation("I9", f"{req_id}'s client received token {t} at index {p + 1}, "
                                      f"where the oracle's KV samples {want} (tokens before it: "
                                      f"{len(prompt)} of prompt, {i} received)")


class EventCheck:
    """I11 (see the module docstring). Stands in for vLLM's event publisher, which the
    scheduler hands each step's events (``publish``)."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.announced: set[tuple[str, int, Any]] = set()  # (tier, group, block hash)

    # vLLM's EventPublisher
    def publish(self, batch: Any) -> None:
        for ev in batch.events:
            self.event(ev)

    def shutdown(self) -> None:
        pass

    def event(self, ev: Any) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        tiers = self.world.workers[0].storage.tier_names
        medium = getattr(ev, "medium", None)
        if medium not in tiers:  # vLLM's own events (its GPU blocks)
            return
        group = getattr(ev, "group_idx", 0) or 0
        c = self.world.counts
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                if (medium, group, h) in self.announced:
                    raise Violation("I11", f"BlockStored for a block tier {medium!r} was already "
                                           f"announced to hold (group {group})")
                self.announced.add((medium, group, h))
            c["KV events: blocks stored"] += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                if (medium, group, h) not in self.announced:
                    raise Violation("I11", f"BlockRemoved for a block tier {medium!r} was not "
                                           f"announced to hold (never, or removed before)")
                self.announced.discard((medium, group, h))
            c["KV events: blocks removed"] += len(ev.block_hashes)

    def check_end(self, watches: list[Any]) -> None:
        """The last look (every tier swept, the news handed to the scheduler's book), then
        every block still announced is held on every rank."""
        from kvplug.connector.protocol.metadata import KVPlugKVEvents
        from kvplug.connector.worker.tier_watch import PENDING_S

        w = self.world
        book = getattr(w.scheduler.connector, "_book", None)
        if book is None or any(x is None for x in watches):
            return
        # past the watch's back-off from a tier that did not answer (30 s at most) and its wait
        # for a store handed to a tier that may block (PENDING_S): its news catch up by then
        w.runtime.clock += PENDING_S + 30.0
        for watch in watches:
            for tier in w.workers[0].storage.tier_names:
                watch.dirty(tier)
        w.runtime.drain()
        news = KVPlugKVEvents()
        for watch in watches:
            part = watch.take()
            if part is not None:
                news.add_events(part.get_all_events())
        book.add(news, w.scheduler.connector._sched.epoch)
        for ev in book.take():
            self.event(ev)
        held = self._held_blocks(book)
        for tier, group, h in sorted(self.announced, key=repr):
            if (tier, h) not in held:
                raise Violation("I11", f"at quiescence a block is announced in tier {tier!r} "
                                       f"(group {group}) that not every rank's tier holds")
        w.counts["KV events: blocks announced at quiescence (all held)"] += len(self.announced)

    def _held_blocks(self, book: Any) -> set[tuple[str, Any]]:
        """(tier, vLLM block hash) of the blocks of every chunk each tier holds on every rank
        (the chunks' blocks as the scheduler's book names them)."""
        w = self.world
        out: set[tuple[str, Any]] = set()
        for tier in w.workers[0].storage.tier_names:
            every: set[bytes] | None = None
            for rank, worker in enumerate(w.workers):
                keys = list(w.chunks.registry[rank])
                found = worker.storage.holds(tier, keys) if keys else []
                mine = {k.chunk_hash for k, hit in zip(keys, found or (), strict=False) if hit}
                every = mine if every is None else every & mine
            for chunk in every or ():
                blocks = book._live.get(chunk) or book._named.get(chunk)
                if blocks is not None:
                    out.update((tier, h) for h in blocks.hashes)
        return out
