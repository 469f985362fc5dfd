"""Six protocol defects between vLLM and kvplug's two sides, each reproduced on vLLM's real ``Scheduler`` (kvplug's real
scheduler side inside it) and kvplug's real ``WorkerSide`` per TP rank over CPU ``PagedKV``s,
behind the real lookup client and services: no model, no engine. Each test replays the calls that expose its defect.
Defect 5 (a save after close on CUDA) needs no scheduler: tests/unit/test_save_after_close.py.

:class:`Rig` steps them as vLLM's engine and model runner do, through the connector's own
worker-side hooks, called by vLLM's own V2 model runner connector (``ActiveKVConnector``:
``pre_forward``, ``post_forward``), in vLLM 0.32's order (``wait_for_save`` before
``get_finished``) or in 0.33's with a speculator (``post_forward(defer_finalize=True)``:
``get_finished``, load errors, stats and worker metadata first, then ``finalize_step``:
``wait_for_save``; on vLLM 0.32, which has no ``finalize_step``, that order is emulated here). The
forward pass is a KV
oracle: each block's page is a function of the rank, the group, the block's tokens and the bytes
actually in the block before it (full attention), so KV computed over stale or foreign blocks
differs from the oracle's. Every block vLLM does not hold is poisoned at once (vLLM may reuse it
from then on), so a copy that reads a block after vLLM freed it stores poison. Ranks' outputs are
merged by vLLM's own ``KVOutputAggregator``.
"""

from __future__ import annotations

import hashlib
import time
import uuid

import pytest
import torch

from tests.support.gpu_kv_fixture import KVFixture
from tests.support.vllm_helpers import make_request, make_scheduler, prompt, runner_connector, worker_connector

pytest.importorskip("vllm")

from kvplug.connector import KVPlugConnector  # noqa: E402
from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.groups import group_hash  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.lookup import LookupClient, socket_path  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402

from tests.support.tiers_for_tests import LosingTier

BS, CHUNK = 4, 16
STEPS = 400  # only catches a hang (requests never finishing)
L1 = {"backend": "local_cpu", "options": {"capacity": "16MiB"}}


def page_of(rank: int, group: int, block: int, prev: bytes, tokens: list[int], L: int,
            page: int) -> torch.Tensor:
    """The oracle's KV of one block: a function of everything that determines it."""
    h = hashlib.sha256(f"{rank}|{group}|{block}|{tokens}|".encode() + prev).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
    return torch.randint(0, 256, (L, page), dtype=torch.uint8, generator=g)


class Rig:
    """vLLM's Scheduler and ``ranks`` kvplug workers, stepped as vLLM's engine does."""

    def __init__(self, model_dir, *, tiers: list[dict], async_save: bool, ranks: int = 1,
                 num_blocks: int = 64, batch: int = 16, groups: list | None = None,
                 order: str = "0.32") -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        extra = {"chunk_size": CHUNK, "async_save": async_save, "report_to_client": False}
        self.scheduler = make_scheduler(model_dir, extra=extra, block_size=BS, num_blocks=num_blocks,
                                        max_num_batched_tokens=batch, groups=groups)
        self.order = order
        self.layout = self.scheduler.connector.scheduler_side.layout
        cfg = ConnectorConfig(chunk_size=CHUNK, async_save=async_save, log_every_load=False,
                              tiers=tiers)
        engine = f"t-{uuid.uuid4().hex[:8]}"
        self.fx: list[KVFixture] = []
        self.w: list[WorkerSide] = []
        self.c: list[KVPlugConnector] = []
        self.runner = []  # vLLM's ActiveKVConnector per rank
        for rank in range(ranks):
            fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=num_blocks, seed=rank)
            w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", ranks, rank, engine),
                           self.layout)
            self.fx.append(fx)
            self.w.append(w)
            self.c.append(worker_connector(w))
            self.runner.append(runner_connector(self.scheduler.vllm_config, self.c[-1], fx.caches))
        self.scheduler.connector.scheduler_side.lookup.close()  # the real client, asking these workers
        self.scheduler.connector.scheduler_side.lookup = LookupClient(
            [socket_path(engine, r, 0) for r in range(ranks)], cfg.lookup_timeout_s)
        self.agg = KVOutputAggregator(ranks)
        self.tokens: dict[str, list[int]] = {}  # every request's tokens, kept past its end
        self.saved: list[tuple[str, int, int, bytes]] = []  # (request, start, end, hash)
        self.events: list[tuple] = []

    # -- vLLM's side ----------------------------------------------------------------------------
    def add(self, req_id: str, tokens: list[int], max_tokens: int) -> None:
        self.scheduler.add_request(make_request(req_id, tokens, max_tokens=max_tokens))

    def held_blocks(self) -> set[int]:
        held = set()
        for mgr in self.scheduler.kv_cache_manager.coordinator.single_type_managers:
            held |= {b.block_id for blocks in mgr.req_to_blocks.values() for b in blocks}
        return held

    def poison_free(self) -> None:
        """vLLM may rewrite every block it does not hold: make that visible."""
        held = self.held_blocks()
        for fx in self.fx:
            fx.poison([b for b in range(1, fx.B) if b not in held])

    def forward(self, scheduler_output) -> None:
        """Write the KV of this step's tokens, attending over what the blocks hold."""
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # advanced by schedule(): this step's tokens end here
            toks = list(req.all_token_ids)
            self.tokens[req_id] = toks
            for g, table in enumerate(self.scheduler.kv_cache_manager.get_block_ids(req_id)):
                chained = self.layout.groups[g].kind == "full"
                for j in range((end - n) // BS, -(-end // BS)):
                    for rank, fx in enumerate(self.fx):
                        prev = (fx.ref_obj([table[j - 1]]).numpy().tobytes()
                                if chained and j else b"")
                        pat = page_of(rank, g, j, prev, toks[j * BS: min(end, (j + 1) * BS)],
                                      fx.L, fx.page)
                        for layer in range(fx.L):
                            o = fx.offset(layer, table[j])
                            fx.buf[o: o + fx.page].view(torch.uint8).copy_(pat[layer])

    def oracle(self, rank: int, group: int, req_id: str, s: int, e: int) -> torch.Tensor:
        """What the chunk ``[s, e)`` of ``req_id`` holds when computed over correct KV."""
        fx, toks = self.fx[rank], self.tokens[req_id]
        chained = self.layout.groups[group].kind == "full"
        pages, prev = [], b""
        for j in range(e // BS):
            pat = page_of(rank, group, j, prev, toks[j * BS: (j + 1) * BS], fx.L, fx.page)
            prev = pat.unsqueeze(1).numpy().tobytes() if chained else b""
            pages.append(pat)
        return torch.stack(pages[s // BS:], dim=1)

    def runner_output(self, scheduler_output):
        """A token sampled for every request whose scheduled tokens reach its end (a chunk of a
        prefill samples nothing)."""
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(scheduler_output.num_scheduled_tokens)
        done = [self.scheduler.requests[r].num_computed_tokens >= self.scheduler.requests[r].num_tokens
                for r in ids]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[[5] if d else [] for d in done])

    def step(self) -> set[str]:
        with torch.inference_mode():  # as vLLM's model runner: its tensors are inference tensors
            return self._step()

    def _step(self) -> set[str]:
        from vllm.v1.outputs import KVConnectorOutput

        scheduler_output = self.scheduler.schedule()
        metadata = scheduler_output.kv_connector_metadata
        self.events += [("preempted", r) for r in metadata.preempted]
        for m in metadata.requests:
            if m.save is not None:
                self.saved += [(m.req_id, *metadata.chunk_range(m.save, i), h)
                               for i, h in enumerate(m.save.hashes)]
        for a in self.runner:  # handle_preemptions, bind, the synchronous loads
            a.pre_forward(scheduler_output)
        self.poison_free()  # the coming forward pass may rewrite blocks vLLM freed
        self.forward(scheduler_output)
        outs = []
        real_033 = hasattr(self.runner[0], "finalize_step")
        for a, c in zip(self.runner, self.c):
            if self.order == "0.32":
                kvo = a.post_forward(scheduler_output.finished_req_ids)  # wait_for_save, then get_finished
            elif real_033:  # 0.33 with a speculator: the draft model's forward comes between
                kvo = a.post_forward(scheduler_output.finished_req_ids, defer_finalize=True)
                a.finalize_step()
            else:  # 0.33's order emulated on 0.32
                if a._pending_load_kwargs is not None:  # as post_forward: loads after the forward
                    a._start_load_kv()
                res = c.get_transfer_results(scheduler_output.finished_req_ids)
                kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                        finished_recving=res.finished_recving or None,
                                        failed_recving=res.failed_recving or set(),
                                        invalid_block_ids=c.get_block_ids_with_load_errors(),
                                        kv_connector_stats=c.get_kv_connector_stats(),
                                        kv_connector_worker_meta=c.build_connector_worker_meta())
                c.wait_for_save()
                c.clear_connector_metadata()
            out = self.runner_output(scheduler_output)
            out.kv_connector_output = kvo
            outs.append(out)
        merged = self.agg.aggregate(outs)
        kvo = merged.kv_connector_output
        sent = set(kvo.finished_sending or ())
        self.events += [("sent", r) for r in sorted(sent)]
        self.events += [("recved", r) for r in sorted(kvo.finished_recving or ())]
        self.scheduler.update_from_output(scheduler_output, merged)
        self.poison_free()
        return sent

    def until(self, cond, what: str) -> None:
        for _ in range(STEPS):
            if cond():
                return
            self.step()
        raise AssertionError(f"never happened: {what}")

    def run_out(self) -> None:
        """Step until vLLM holds no request (a hang is caught)."""
        for _ in range(STEPS):
            if not self.scheduler.requests:
                return
            self.step()
            time.sleep(0.001)  # let the save thread run
        raise AssertionError(f"requests never finished: {sorted(self.scheduler.requests)}; vLLM still "
                             f"holds them (held by kvplug: {sorted(self.scheduler.connector.scheduler_side.held)})")

    # -- checks ---------------------------------------------------------------------------------
    def settle(self) -> None:
        for w in self.w:
            if w._saves is not None:
                w._saves.close()  # every copy and put is over

    def stored(self, rank: int, group: int, h: bytes) -> torch.Tensor | None:
        w = self.w[rank]
        obj = w.storage.get(w.key(group_hash(h, self.layout.groups[group])
                                  if self.layout.multi else h))
        if obj is None:
            return None
        out = obj.tensor.clone()
        obj.ref_down()
        return out

    def mismatches(self) -> list[tuple]:
        """Every chunk sent to be saved and now stored, against the oracle (any rank, group)."""
        self.settle()
        bad = []
        for req_id, s, e, h in self.saved:
            for rank in range(len(self.w)):
                for g in range(len(self.layout.groups)):
                    got = self.stored(rank, g, h)
                    if got is not None and not torch.equal(got, self.oracle(rank, g, req_id, s,
                                                                            e)):
                        bad.append((req_id, s, e, rank, g))
        return bad

    def close(self) -> None:
        for w in self.w:
            w.close()
        self.scheduler.connector.scheduler_side.lookup.close()


@pytest.fixture
def rig(model_dir):
    made: list[Rig] = []

    def make(**kw) -> Rig:
        made.append(Rig(model_dir, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def gated(tmp_path, name: str = "gated", kind: str = "GatedPutTier", **opts) -> tuple[dict, object]:
    gate = tmp_path / f"gate-{uuid.uuid4().hex[:6]}"
    gate.mkdir()
    return ({"name": name, "backend": f"tests.support.tiers_for_tests:{kind}",
             "options": {"gate": str(gate), "max_wait_s": 60, **opts}}, gate)


# -- 1: nothing computed over a failed load is stored; the range is stored again later -------------

@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_1_kv_computed_over_a_failed_load_is_not_stored_and_is_stored_after_recompute(
        rig, async_save):
    lost = {"name": "mem", "backend": "tests.support.tiers_for_tests:LosingTier"}
    r = rig(tiers=[L1, lost], async_save=async_save)
    p = prompt(60, 11)
    r.add("p0", p[:33], max_tokens=1)  # stores chunks [0,16) and [16,32) in both tiers
    r.run_out()
    h16 = next(h for q, s, _, h in r.saved if q == "p0" and s == 16)
    w = r.w[0]
    assert w._saves is None or w._saves.settle([w.key(h16)], 60)
    w.storage.evict(keys=[w.key(h16)], tiers=["local_cpu"])  # only the tier that never blocks has it ...
    LosingTier.lost = {h16.hex()}  # ... and loses it between lookup and load
    try:
        r.add("q", p, max_tokens=2)
        r.run_out()
    finally:
        LosingTier.lost = set()
    totals = w.stats.totals()
    assert totals.get("load_failures") == 1  # not vacuous: the load did fail, in the step
    assert [(s, e) for q, s, e, _ in r.saved if q == "q"][0] == (32, 48)  # sent in that step
    assert r.mismatches() == []  # nothing stored is wrong ...
    sent = {s: h for q, s, _, h in r.saved if q == "q"}
    for s in (16, 32):  # ... and the failed chunk and the one computed over it are stored again
        assert s in sent and r.stored(0, 0, sent[s]) is not None, f"chunk at {s} not stored"


# -- 2: sliding-window blocks are copied before vLLM reuses them -----------------------------------

def test_2_sliding_window_blocks_are_copied_before_the_window_frees_them(rig, tmp_path):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                            sliding_window=8)
    tier, gate = gated(tmp_path)
    r = rig(tiers=[L1, tier], async_save=True, num_blocks=48,
            groups=[KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["swa"], swa)])
    assert r.layout.multi and r.layout.sliding
    saves = r.w[0]._saves
    r.add("a", prompt(48, 12), max_tokens=2)  # 16 tokens a step: a chunk a step
    r.until(lambda: len(list(gate.glob("put-*"))) >= 1 and saves.in_flight() >= 1,
            "a sliding-window save queued behind a held put")
    r.step()  # the window moves on: vLLM frees (and may reuse) the blocks that save reads
    (gate / "open").touch()
    r.run_out()
    sliding = [x for x in r.saved if x[0] == "a"]
    assert any(r.stored(0, 1, h) is not None for _, _, _, h in sliding)  # not vacuous
    assert r.mismatches() == []


# -- 3: a request is reported finished once -------------------------------------------------------

def test_3_preempted_request_aborted_while_loading_is_reported_once(rig, tmp_path):
    from vllm.v1.request import RequestStatus

    slow, gate = gated(tmp_path, "slow", "GatedTier")
    r = rig(tiers=[L1, slow], async_save=True, num_blocks=24, batch=64)
    r.add("a", prompt(24, 2), max_tokens=40)
    r.add("b", prompt(24, 3), max_tokens=40)
    r.until(lambda: any(e[0] == "preempted" for e in r.events), "a preemption")
    victim = next(e[1] for e in r.events if e[0] == "preempted")
    w = r.w[0]
    keys = [w.key(h) for q, _, _, h in r.saved if q == victim]
    assert keys and w._saves.settle(keys, 60)  # it saved: vLLM held it at finish before
    w.storage.evict(tiers=["local_cpu"], nbytes=1 << 30)  # its chunks: only in the slow tier
    r.until(lambda: r.scheduler.requests[victim].status == RequestStatus.WAITING_FOR_REMOTE_KVS,
            "the preempted request waiting for its background load")
    r.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
    r.step()  # vLLM asserts ("assert req_id in self.requests") on a second report
    (gate / "open").touch()
    r.run_out()
    reports = [e for e in r.events if e[0] in ("sent", "recved") and e[1] == victim]
    assert reports == [("recved", victim)]
    assert not r.scheduler.connector.has_pending_block_frees()
    assert r.mismatches() == []


# -- 4: a chunk a rank never pinned -----------------------------------------------------------------

def test_4_a_rank_loads_a_key_it_never_pinned(rig):
    """Two ranks: rank 0 holds a longer stored tail than rank 1, so the hit (the minimum) names
    a tail rank 0 holds but never pinned."""
    r = rig(tiers=[L1], async_save=False, ranks=2, batch=64)
    p1 = prompt(41, 21)
    r.add("p1", p1, max_tokens=1)  # chunks 0-1 and the tail ending at 40
    r.run_out()
    r.add("p2", p1[:37], max_tokens=1)  # the tail ending at 36
    r.run_out()
    h40 = next(h for q, _, e, h in r.saved if q == "p1" and e == 40)
    assert next(h for q, _, e, h in r.saved if q == "p2" and e == 36)
    r.w[1].storage.evict(keys=[r.w[1].key(h40)])  # rank 1: only the tail at 36
    r.add("p3", p1 + prompt(3, 22), max_tokens=1)
    r.run_out()  # no ValueError: 'unknown' is not in list (start_load_kv)
    for w in r.w:  # both ranks loaded 32 tokens for p2 and 36 for p3, exactly
        assert w.stats.totals().get("load_tokens") == 32 + 36
        assert w.stats.totals().get("load_failures", 0) == 0
    assert r.mismatches() == []


# -- 6: finished_sending does not depend on vLLM's call order ----------------------------------------

@pytest.mark.parametrize("order", ["0.32", "0.33"])
def test_6_a_request_whose_only_save_is_its_last_is_reported(rig, order):
    r = rig(tiers=[L1], async_save=True, order=order)
    r.add("a", prompt(4, 31), max_tokens=4)  # no save until its end: [0, 4) then
    r.run_out()  # freed (kvplug reports it), with 0.33's order too
    assert [(s, e) for q, s, e, _ in r.saved if q == "a"] == [(0, 4)]
    assert ("sent", "a") in r.events
    assert not r.scheduler.connector.has_pending_block_frees()
    assert r.mismatches() == []


@pytest.mark.parametrize("order", ["0.32", "0.33"])
def test_6_a_request_is_reported_only_after_its_last_copy(rig, tmp_path, order):
    tier, gate = gated(tmp_path)
    (gate / "open").touch()
    r = rig(tiers=[L1, tier], async_save=True, batch=64, order=order)
    saves = r.w[0]._saves
    r.add("a", prompt(40, 32), max_tokens=6)  # saves at its prefill, and [32, 44) at its end
    # (a busy machine may answer the first lookup late: vLLM asks again a step later)
    r.until(lambda: any(q == "a" for q, *_ in r.saved), "a's prefill saved")
    assert saves.settle([r.w[0].key(h) for *_, h in r.saved], 60)
    (gate / "open").unlink()  # from now on every put waits
    puts = len(list(gate.glob("put-*")))
    r.add("x", prompt(20, 33), max_tokens=40)  # its save holds the save thread mid-put
    r.until(lambda: len(list(gate.glob("put-*"))) > puts, "x's put held")
    r.until(lambda: "a" not in {q.request_id for q in r.scheduler.running}, "'a' finished")
    for _ in range(3):  # its last save is sent in the first: held until that copy is done
        assert "a" not in r.step()
    assert [(s, e) for q, s, e, _ in r.saved if q == "a"][-1] == (32, 44)
    assert saves._busy.get("a") == 1  # not vacuous: its last copy is still queued
    (gate / "open").touch()
    r.run_out()
    assert ("sent", "a") in r.events
    assert r.mismatches() == []
