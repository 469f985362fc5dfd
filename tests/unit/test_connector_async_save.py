"""Asynchronous saves against vLLM's own Scheduler (no model): a save still in flight when its
request finishes, is aborted or is preempted never reads a block after vLLM freed it, nothing
leaks, and every stored chunk is exact.

The harness runs vLLM's real ``Scheduler`` and a real kvplug ``WorkerSide`` step by step in
vLLM's order (``handle_preemptions``, ``start_load_kv``, the forward pass, ``wait_for_save``,
``get_finished``), the forward pass writing each request's KV as random bytes per (request,
block). Every block vLLM has freed is poisoned at once (vLLM may reuse it from then on), so a copy
that read a block after it was freed stores poison. A tier whose writes wait for a gate holds the
save thread mid-put, so the saves behind it stay in flight across steps: the order is forced,
never timed. Negative controls show the check catches a worker that releases blocks too early.
"""

from __future__ import annotations

import time
import uuid
import zlib

import pytest
import torch

from tests.support.gpu_kv_fixture import CUDA, KVFixture
from tests.support.vllm_helpers import FakeLookup, make_request, make_scheduler, model_runner_output, prompt

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.groups import GroupLayout  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.metadata import KVPlugMetadata, ReqMeta, SaveSpec  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402
from kvplug.connector.worker.store import AsyncSaves  # noqa: E402

BS, CHUNK = 4, 16
HANG_S = 60  # only catches a hang


def pattern(req_id: str, block: int, layers: int, page: int) -> torch.Tensor:
    """The KV the 'forward pass' writes into logical block ``block`` of a request."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{req_id}:{block}".encode()))
    return torch.randint(0, 256, (layers, page), dtype=torch.uint8, generator=g)


class Steps:
    """vLLM's scheduler and one kvplug worker, stepped as vLLM's engine and model runner do."""

    def __init__(self, model_dir, tmp_path, num_blocks: int, v2_order: bool = False,
                 zeroes_new_blocks: bool = False) -> None:
        #: vLLM's V2 model runner: blocks the step allocates are zeroed (here: poisoned) before
        #: ``handle_preemptions`` runs, where the engine zeroes new blocks
        self.v2_order = v2_order
        self.gate = tmp_path / f"gate-{uuid.uuid4().hex[:6]}"
        self.gate.mkdir()
        extra = {"chunk_size": CHUNK, "async_save": True, "report_to_client": False}
        self.scheduler = make_scheduler(model_dir, extra=extra, block_size=BS, num_blocks=num_blocks,
                                        max_num_batched_tokens=64)
        self.scheduler.connector.scheduler_side.lookup = FakeLookup()  # nothing stored before: no loads
        cfg = ConnectorConfig(chunk_size=CHUNK, async_save=True, log_every_load=False,
                              tiers=[{"backend": "local_cpu", "options": {"capacity": "16MiB"}},
                                     {"name": "gated", "backend": "tests.support.tiers_for_tests:GatedPutTier",
                                      "options": {"gate": str(self.gate)}}])
        self.fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=num_blocks)
        self.w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0,
                                          f"t-{uuid.uuid4().hex[:8]}"),
                            GroupLayout(block_size=BS, zeroes_new_blocks=zeroes_new_blocks))
        self.w.register_kv_caches(self.fx.caches)
        self.saves: AsyncSaves = self.w._saves  # type: ignore[assignment]
        assert self.saves is not None
        self.saved: list[tuple[str, int, int, bytes]] = []  # (request, start, end, hash)
        self.events: list[tuple] = []  # ("sent", req) / ("preempted", req, copies in flight)
        self.n = 0

    # -- vLLM's side ----------------------------------------------------------------------------
    def held_blocks(self) -> set[int]:
        mgr = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return {b.block_id for blocks in mgr.req_to_blocks.values() for b in blocks}

    def poison_free(self) -> None:
        """vLLM may rewrite every block it does not hold: make that visible."""
        held = self.held_blocks()
        self.fx.poison([b for b in range(1, self.fx.B) if b not in held])

    def forward(self, scheduler_output) -> None:
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # advanced by schedule(): this step's tokens end here
            table = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for j in range((end - n) // BS, -(-end // BS)):
                pat = pattern(req_id, j, self.fx.L, self.fx.page)
                for layer in range(self.fx.L):
                    o = self.fx.offset(layer, table[j])
                    self.fx.buf[o: o + self.fx.page].view(torch.uint8).copy_(pat[layer])

    def step(self) -> set[str]:
        with torch.inference_mode():  # as vLLM's model runner: its tensors are inference tensors
            return self._step()

    def _step(self) -> set[str]:
        from vllm.v1.outputs import KVConnectorOutput

        self.n += 1
        scheduler_output = self.scheduler.schedule()
        metadata = scheduler_output.kv_connector_metadata
        for r in metadata.preempted:
            self.events.append(("preempted", r, self.saves._busy.get(r, 0)))
        if self.v2_order:  # update_requests zeroes the step's new blocks, then pre_forward
            self.poison_free()
        self.w.handle_preemptions(metadata)
        self.poison_free()  # the coming forward pass may rewrite preempted requests' blocks
        self.w.start_load_kv(metadata)
        self.forward(scheduler_output)
        for m in metadata.requests:
            if m.save is not None:
                for i, h in enumerate(m.save.hashes):
                    self.saved.append((m.req_id, *metadata.chunk_range(m.save, i), h))
        self.w.wait_for_save(metadata)
        sent, _ = self.w.get_finished(scheduler_output.finished_req_ids)
        self.events += [("sent", r) for r in sorted(sent)]
        out = model_runner_output(scheduler_output)
        out.kv_connector_output = KVConnectorOutput(finished_sending=sent or None)
        self.scheduler.update_from_output(scheduler_output, out)
        self.poison_free()
        return sent

    def open_gate(self) -> None:
        (self.gate / "open").touch()
        self.events.append(("gate opened",))

    def run_out(self) -> None:
        """Step until vLLM holds no request (a hang is caught)."""
        end = time.monotonic() + HANG_S
        while self.scheduler.requests:
            assert time.monotonic() < end, f"requests never finished: {list(self.scheduler.requests)}"
            self.step()
            time.sleep(0.001)

    # -- checks ---------------------------------------------------------------------------------
    def mismatches(self) -> list[tuple[str, int, int]]:
        """Every chunk sent to be saved, read back from storage, against the KV the forward pass
        wrote (a chunk read from a freed, poisoned block differs)."""
        self.saves.close()  # every copy and put is over
        bad = []
        for req_id, s, e, h in self.saved:
            obj = self.w.storage.get(self.w.key(h))
            want = torch.stack([pattern(req_id, j, self.fx.L, self.fx.page)
                                for j in range(s // BS, e // BS)], dim=1)
            if obj is None or not torch.equal(obj.tensor, want):
                bad.append((req_id, s, e))
            if obj is not None:
                obj.ref_down()
        return bad

    def assert_nothing_leaked(self) -> None:
        assert self.saves.in_flight() == 0 and not self.saves._busy
        assert not self.saves._tracked and not self.saves._finished
        assert self.w.stats.totals().get("store_failures", 0) == 0
        self.w.storage.evict(tiers=["local_cpu"], nbytes=1 << 30)
        l1 = self.w.storage.stats()["local_cpu"]
        assert (l1["entries"], l1["pinned"], l1["pool_used"]) == (0, 0, 0)  # no object held

    def close(self) -> None:
        (self.gate / "open").touch()
        self.w.close()


@pytest.fixture
def steps(model_dir, tmp_path):
    made: list[Steps] = []

    def make(num_blocks: int = 200, **kw) -> Steps:
        made.append(Steps(model_dir, tmp_path, num_blocks, **kw))
        return made[-1]

    yield make
    for st in made:
        st.close()


def until(st: Steps, cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        st.step()
    raise AssertionError(f"never happened: {what}")


def finish_with_save_in_flight(st: Steps, abort: bool) -> None:
    """Run request "a" until it finishes (or is aborted) while a copy of it waits behind the
    gated put; it must stay held until the gate opens."""
    from vllm.v1.request import RequestStatus

    st.scheduler.add_request(make_request("a", prompt(40, 1), max_tokens=100 if abort else 12))
    until(st, lambda: st.saves._busy.get("a", 0) >= 1 and len(list(st.gate.glob("put-*"))) >= 1
          and len(st.saved) > 3, "a save of 'a' queued behind the gated put")
    if abort:
        st.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    else:
        until(st, lambda: "a" not in {r.request_id for r in st.scheduler.running}, "'a' finished")
    assert st.saves._busy.get("a", 0) >= 1  # not vacuous: its copy is still queued
    for _ in range(5):  # held: vLLM keeps (and never reuses) its blocks
        assert "a" not in st.step()
        assert "a" in st.scheduler.requests
    st.open_gate()
    st.run_out()


@pytest.mark.parametrize("abort", [False, True], ids=["finishes", "aborted"])
def test_a_request_that_ends_with_a_save_in_flight_is_held_until_its_copy(steps, abort):
    st = steps()
    finish_with_save_in_flight(st, abort)
    kinds = [e for e in st.events if e[0] in ("sent", "gate opened")]
    assert kinds == [("gate opened",), ("sent", "a")]  # order, not timing
    assert st.mismatches() == []
    assert len(st.saved) >= 3
    st.assert_nothing_leaked()


def test_preemption_with_a_save_in_flight_copies_before_the_blocks_are_reused(steps):
    st = steps(num_blocks=24)  # two requests outgrow it while decoding: one is preempted
    st.scheduler.add_request(make_request("a", prompt(24, 2), max_tokens=40))
    st.scheduler.add_request(make_request("b", prompt(24, 3), max_tokens=40))
    until(st, lambda: any(e[0] == "preempted" and e[2] for e in st.events),
          "a preemption with a copy of the preempted request in flight")
    assert not (st.gate / "open").exists()  # the copy was queued behind the gated put
    assert st.w.stats.totals().get("store_copies_on_preemption", 0) >= 1
    st.open_gate()
    st.run_out()
    assert st.mismatches() == []
    st.assert_nothing_leaked()


def preempt_with_a_save_in_flight(st: Steps) -> None:
    """A preemption while the preempted request's save is in flight (its put, or also its copy,
    held behind the gated put)."""
    st.scheduler.add_request(make_request("a", prompt(24, 2), max_tokens=40))
    st.scheduler.add_request(make_request("b", prompt(24, 3), max_tokens=40))
    until(st, lambda: any(e[0] == "preempted" for e in st.events),
          "a preemption while the gate holds the saves")
    preempted = {e[1] for e in st.events if e[0] == "preempted"}
    assert preempted & {r for r, *_ in st.saved}  # not vacuous: it had saves
    # the tier's thread reaches the gate on its own time (no step needed): wait for it, bounded
    deadline = time.monotonic() + 60
    while not list(st.gate.glob("put-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(st.gate.glob("put-*")) and not (st.gate / "open").exists()
    st.open_gate()
    st.run_out()


def test_v2_runner_zeroing_before_handle_preemptions_stores_exact_kv(steps):
    """vLLM's V2 model runner zeroes a step's new blocks (``needs_kv_cache_zeroing``) before it
    calls ``handle_preemptions``: a block a preemption freed is rewritten before kvplug's wait
    there. kvplug orders each step's copies when submitted for such an engine."""
    st = steps(num_blocks=24, v2_order=True, zeroes_new_blocks=True)
    preempt_with_a_save_in_flight(st)
    assert st.mismatches() == []
    st.assert_nothing_leaked()


def test_control_v2_runner_order_without_ordering_at_submit_stores_poison(steps):
    """The race is real: the same engine, kvplug not told that it zeroes new blocks."""
    st = steps(num_blocks=24, v2_order=True, zeroes_new_blocks=False)
    preempt_with_a_save_in_flight(st)
    assert st.mismatches() != []


def run_into_held_blocks(st: Steps) -> None:
    """"a" finishes while its copy waits behind the gated put (vLLM keeps its blocks); "b" goes
    on decoding until it needs a block that only "a"'s would give."""
    st.scheduler.add_request(make_request("a", prompt(24, 6), max_tokens=12))
    st.scheduler.add_request(make_request("b", prompt(20, 7), max_tokens=40))  # fits once "a" is freed
    until(st, lambda: "a" not in {r.request_id for r in st.scheduler.running}, "'a' finished")
    until(st, lambda: st.saves._busy.get("a", 0) >= 1, "'a''s last copy queued (gate closed)")
    assert "a" in st.scheduler.requests  # held
    pool = st.scheduler.kv_cache_manager.block_pool

    def at_the_wall() -> bool:  # "b"'s next token needs a block; none is free
        b = st.scheduler.requests["b"]
        return any(e[0] == "preempted" for e in st.events) or (
            pool.get_num_free_blocks() == 0 and b.num_computed_tokens % BS == 0)

    until(st, at_the_wall, "'b' at the block 'a' holds")


def test_a_running_request_waits_for_held_blocks_instead_of_being_preempted(steps):
    """``has_pending_block_frees``: blocks that a save will give back soon are waited for; a
    preemption would throw "b"'s KV away (recompute or reload)."""
    st = steps(num_blocks=20)
    run_into_held_blocks(st)
    stalled = st.scheduler.requests["b"].num_computed_tokens
    for _ in range(5):  # not vacuous: "b" cannot go on while "a" holds its blocks
        st.step()
    assert st.scheduler.requests["b"].num_computed_tokens == stalled
    assert st.scheduler.connector.has_pending_block_frees()
    st.open_gate()
    st.run_out()
    assert not [e for e in st.events if e[0] == "preempted"]
    assert st.events.index(("gate opened",)) < st.events.index(("sent", "a"))
    assert not st.scheduler.connector.has_pending_block_frees()  # released with finished_sending
    assert st.mismatches() == []
    st.assert_nothing_leaked()


def test_control_without_pending_frees_the_running_request_is_preempted(steps, monkeypatch):
    from kvplug.connector import KVPlugConnector

    monkeypatch.setattr(KVPlugConnector, "has_pending_block_frees", lambda self: False)
    st = steps(num_blocks=20)
    run_into_held_blocks(st)
    until(st, lambda: any(e[0] == "preempted" for e in st.events), "a preemption")
    assert [e[1] for e in st.events if e[0] == "preempted"] == ["b"]
    assert "a" in st.scheduler.requests  # its blocks were still held when "b" was preempted
    st.open_gate()
    st.run_out()


def test_a_lookup_waits_for_a_put_in_flight_of_its_chunks(steps):
    """Asynchronous puts end after the step: a lookup of those chunks waits for them (bounded),
    so the request after a finished one finds what it stored, as with synchronous saves."""
    st = steps()
    st.scheduler.add_request(make_request("a", prompt(40, 5), max_tokens=4))
    until(st, lambda: len(list(st.gate.glob("put-*"))) >= 1, "a put held by the gate")
    keys = [st.w.key(h) for _, _, _, h in st.saved[:1]]
    assert st.saves.settle(keys, timeout=0.2) is False  # its put is held: the bound is kept
    assert st.w.storage.lookup_prefix(keys, pin=False).num_chunks == 1  # L1 took it already
    st.open_gate()
    assert st.saves.settle(keys, timeout=HANG_S) is True
    assert not st.saves._pending.keys() & set(keys)
    st.run_out()
    assert st.mismatches() == []
    st.assert_nothing_leaked()


def test_a_request_that_saved_nothing_is_never_held(steps):
    st = steps()  # the gate stays closed: nothing of this request waits on it
    st.scheduler.add_request(make_request("n", prompt(40, 4), max_tokens=12,
                                          kv_transfer_params={"kvplug_save": False}))
    st.run_out()
    assert st.saved == [] and ("sent", "n") not in st.events
    st.assert_nothing_leaked()


# -- negative controls: the checks above catch a worker that lets vLLM free blocks too early ----

def test_control_reporting_sent_before_the_copy_stores_poison(steps, monkeypatch):
    def too_early(self, finished):
        with self._lock:
            out = self._tracked.intersection(finished)
            self._tracked -= out
        return out

    monkeypatch.setattr(AsyncSaves, "take_sent", too_early)
    st = steps()
    from vllm.v1.request import RequestStatus

    st.scheduler.add_request(make_request("a", prompt(40, 1), max_tokens=100))
    until(st, lambda: st.saves._busy.get("a", 0) >= 1 and len(st.saved) > 3, "a queued save")
    st.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    st.step()
    assert "a" not in st.scheduler.requests  # freed (and poisoned) while its copy was queued
    st.open_gate()
    assert st.mismatches() != []


def test_control_ignoring_preemptions_stores_poison(steps, monkeypatch):
    monkeypatch.setattr(WorkerSide, "handle_preemptions", lambda self, metadata: None)
    st = steps(num_blocks=24)
    st.scheduler.add_request(make_request("a", prompt(24, 2), max_tokens=40))
    st.scheduler.add_request(make_request("b", prompt(24, 3), max_tokens=40))
    until(st, lambda: any(e[0] == "preempted" and e[2] for e in st.events), "a preemption")
    st.open_gate()
    st.run_out()
    assert st.mismatches() != []


def test_cpu_has_no_stream_the_async_copy_calls_are_done_on_return():
    from kvplug.gpu import PagedKV, gather_many_async, layerwise_store

    fx = KVFixture("LBHNC", torch.bfloat16, L=3, B=16)
    kv = PagedKV.from_kv_caches(fx.caches)
    ids = [1, 4, 5, 9]
    bulk, lw = (torch.zeros((3, len(ids), fx.page), dtype=torch.uint8) for _ in range(2))
    assert gather_many_async(kv, [(ids, bulk)]) is None
    steps = layerwise_store(kv, [(ids, lw)], wait=False)
    assert list(steps) == [0, 1, 2] and steps.event is None
    assert torch.equal(bulk, fx.ref_obj(ids)) and torch.equal(lw, fx.ref_obj(ids))


# -- CUDA: the copy is ordered by an event, with no host synchronisation in the step -----------

@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("layerwise", [False, True], ids=["bulk", "layerwise"])
def test_cuda_save_queues_without_host_sync_and_stores_exact_pages(tmp_path, layerwise):
    fx = KVFixture("LBNHC", torch.bfloat16, L=3, B=32, device="cuda")
    cfg = ConnectorConfig(chunk_size=CHUNK, layerwise=layerwise, log_every_load=False,
                          tiers=[{"backend": "local_cpu", "options": {"capacity": "16MiB"}}])
    assert cfg.async_save is None  # the default on CUDA is asynchronous
    w = WorkerSide(cfg, Identity("m", f"LBNHC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(fx.caches)
    try:
        assert w._saves is not None and w._saves.on_cuda
        ids = [3, 7, 8, 9, 20, 21, 22, 30]
        want = fx.ref_obj(ids)
        hashes = [bytes([i]) * 32 for i in range(2)]
        metadata = KVPlugMetadata(CHUNK, BS, [ReqMeta("r", ids, save=SaveSpec(0, 32, 0, hashes))])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
        try:
            for name in (w.kv.layer_names if layerwise else ()):
                w.save_kv_layer(name, metadata)
            w.wait_for_save(metadata)
            w.handle_preemptions(KVPlugMetadata(CHUNK, BS, preempted=["r"]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        fx.poison(ids)  # queued on the engine's stream: after the copy (handle_preemptions)
        end = time.monotonic() + HANG_S
        while "r" not in w.get_finished({"r"})[0]:
            assert time.monotonic() < end
            time.sleep(0.001)
        w._saves.close()
        for i, h in enumerate(hashes):
            obj = w.storage.get(w.key(h))
            assert obj is not None and torch.equal(obj.tensor.cpu(), want[:, 4 * i: 4 * i + 4])
            obj.ref_down()
    finally:
        w.close()
