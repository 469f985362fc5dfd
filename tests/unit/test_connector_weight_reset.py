"""Weights changed in place: after ``reset_prefix_cache(reset_connector=True)`` nothing stored
before is served to this engine, on any tier; another engine on the old weights keeps its hits.

No model: vLLM's real ``Scheduler`` (its SCHEDULER-role kvplug connector) and a real kvplug
``WorkerSide`` with an L1 and a persistent posix tier, talking over the real lookup socket, stepped
as vLLM's engine does. The "forward pass" writes KV that depends on the weights version, so a
block loaded from before the reset shows as bytes of the old version. Negative control: the same
run without ``reset_connector`` loads the old version's KV (the check can fail).
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from tests.support.gpu_kv_fixture import KVFixture
from tests.support.vllm_helpers import make_request, make_scheduler, model_runner_output, prompt

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.lookup import Lookup  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402

BS, CHUNK = 4, 16
P = prompt(41, 7)  # 2 full chunks + a block-aligned partial one (40 tokens) stored
HANG_S = 60  # only catches a hang


def kv_bytes(version: int, token_block: int, layers: int, page: int) -> torch.Tensor:
    """The KV the weights of ``version`` give the prompt's block ``token_block``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"v{version}:{token_block}".encode()))
    return torch.randint(0, 256, (layers, page), dtype=torch.uint8, generator=g)


def tiers(root) -> list[dict]:
    return [{"backend": "local_cpu", "options": {"capacity": "16MiB"}},
            {"backend": "posix", "options": {"path": str(root / "chunks")}}]


class Engine:
    """vLLM's scheduler and one kvplug worker (same engine id: real lookups over the socket)."""

    def __init__(self, model_dir, root) -> None:
        self.scheduler = make_scheduler(model_dir, extra={"chunk_size": CHUNK, "tiers": tiers(root)},
                                        block_size=BS, num_blocks=64, max_num_batched_tokens=64)
        engine_id = self.scheduler.connector._vllm_config.kv_transfer_config.engine_id
        cfg = ConnectorConfig(chunk_size=CHUNK, async_save=False, log_every_load=False,
                              tiers=tiers(root))
        self.fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=64)
        self.w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, engine_id))
        self.w.register_kv_caches(self.fx.caches)
        self.version = 0  # the weights the forward pass computes with
        self.loaded: dict[str, list[int]] = {}  # request -> versions of the blocks it loaded

    def _step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        scheduler_output = self.scheduler.schedule()
        metadata = scheduler_output.kv_connector_metadata
        self.w.start_load_kv(metadata)
        for r in metadata.requests:  # what each loaded block holds, read back from the KV cache
            if r.load is not None:
                self.loaded[r.req_id] = [self.version_of(r.block_ids[j], j)
                                         for j in range(r.load.start // BS, r.load.end // BS)]
        for req_id, n in scheduler_output.num_scheduled_tokens.items():  # the forward pass writes its KV
            end = self.scheduler.requests[req_id].num_computed_tokens
            table = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for j in range((end - n) // BS, -(-end // BS)):
                pat = kv_bytes(self.version, j, self.fx.L, self.fx.page)
                for layer in range(self.fx.L):
                    o = self.fx.offset(layer, table[j])
                    self.fx.buf[o: o + self.fx.page].view(torch.uint8).copy_(pat[layer])
        self.w.wait_for_save(metadata)
        sent, _ = self.w.get_finished(scheduler_output.finished_req_ids)
        out = model_runner_output(scheduler_output)
        out.kv_connector_output = KVConnectorOutput(finished_sending=sent or None)
        self.scheduler.update_from_output(scheduler_output, out)

    def version_of(self, block: int, j: int) -> int:
        """Which weights version wrote this block (-1: neither)."""
        got = torch.stack([self.fx.buf[self.fx.offset(layer, block):][:self.fx.page]
                           .view(torch.uint8) for layer in range(self.fx.L)])
        for v in (0, 1):
            if torch.equal(got, kv_bytes(v, j, self.fx.L, self.fx.page)):
                return v
        return -1

    def run(self, req_id: str) -> list[int]:
        """Serve the prompt to the end; the versions of the blocks it loaded ([]: none)."""
        with torch.inference_mode():
            self.scheduler.add_request(make_request(req_id, P, max_tokens=2))
            end = time.monotonic() + HANG_S
            while self.scheduler.requests:
                assert time.monotonic() < end, f"never finished: {list(self.scheduler.requests)}"
                self._step()
        return self.loaded.get(req_id, [])

    def close(self) -> None:
        self.w.close()
        self.scheduler.connector.shutdown()


@pytest.fixture
def engine(model_dir, tmp_path):
    e = Engine(model_dir, tmp_path)
    yield e
    e.close()


@pytest.mark.parametrize("reset_connector", [True, False], ids=["reset", "control-no-reset"])
def test_nothing_from_before_a_weights_reset_is_served(engine, tmp_path, reset_connector):
    e = engine
    assert e.run("a") == []  # cold: computed, stored under the weights on disk
    assert e.run("b") == [0] * 10  # 40 tokens from kvplug, all of version 0 (the setup works)
    assert e.w.storage.flush(10)  # the posix writes are over: L1 holds the only references
    e.version = 1  # the weights change in place ...
    assert e.scheduler.reset_prefix_cache(reset_connector=reset_connector)  # ... and the cache resets
    got = e.run("c")
    if not reset_connector:  # control: without the reset kvplug serves the old weights' KV
        assert got == [0] * 10
        return
    assert got == []  # computed, not loaded: nothing stored before is served
    assert e.run("d") == [1] * 10  # what "c" stored under the new epoch is served
    assert e.w.epoch == e.scheduler.connector.scheduler_side.epoch != ""
    assert e.scheduler.connector.scheduler_side.stats.totals()["weight_resets"] == 1
    # L1 holds only the new epoch's chunks; the old ones are on the posix tier for others
    assert e.w.storage.stats()["local_cpu"]["entries"] == 3
    hashes = e.scheduler.connector.scheduler_side.token_db.extend_hashes(P, [], 2)
    old = [e.w.key(h, epoch="") for h in hashes]
    assert [e.w.storage.contains(k) for k in old] == ["posix", "posix"]
    # another engine still on the old weights (its own worker, same store): it keeps its hits
    other = WorkerSide(ConnectorConfig(chunk_size=CHUNK, tiers=tiers(tmp_path)[1:]),
                       Identity("m", f"LBHNC-bs{BS}", 1, 0, "other-engine"))
    other.register_kv_caches(KVFixture("LBHNC", torch.bfloat16, L=2, B=64).caches)
    try:
        assert other._on_lookup(Lookup(1, "x", hashes))[0] == 32
        assert other._on_lookup(Lookup(2, "y", hashes, epoch=e.w.epoch))[0] == 32
        assert other._on_lookup(Lookup(3, "z", hashes, epoch="0123456789abcdef"))[0] == 0
    finally:
        other.close()


def test_a_finished_requests_last_save_across_a_reset_is_dropped(engine):
    """A request finished before the reset whose last save goes out after it: its KV is of the
    old weights, so nothing is stored under the new epoch, and vLLM still gets its blocks back."""
    e = engine
    with torch.inference_mode():
        # 41 + 4 tokens: at the end, the partial chunk [32, 44) of prompt + answer is left
        e.scheduler.add_request(make_request("a", P, max_tokens=4))
        end = time.monotonic() + HANG_S
        while not e.scheduler.connector.scheduler_side._finishing and time.monotonic() < end:
            e._step()  # (the first steps may wait for the lookup's answer)
        assert [r.save.end for r in e.scheduler.connector.scheduler_side._finishing] == [44]
        e.version = 1
        assert e.scheduler.reset_prefix_cache(reset_connector=True) is False  # vLLM still holds blocks
        while e.scheduler.requests and time.monotonic() < end:
            e._step()
    assert e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63  # nothing leaked
    assert e.w.epoch != ""
    # the answer's chunk [32, 44) (old weights' KV) is stored under no epoch
    token_db, tokens = e.scheduler.connector.scheduler_side.token_db, [*P, 5, 5, 5, 5]  # the harness samples token 5
    tail = token_db.partial_hash(tokens, 44, token_db.extend_hashes(tokens, [], 2))
    assert e.w.storage.flush(10)
    assert [e.w.storage.contains(e.w.key(tail, ep)) for ep in ("", e.w.epoch)] == [None, None]


def test_sleep_drains_copies_and_wake_checks_the_kv_tensors(tmp_path):
    """vLLM 0.33's sleep hooks on a worker with asynchronous saves: ``unregister_kv_caches``
    returns only once no copy reads the KV memory (a save queued behind a gated put is copied
    at once), ``restore_kv_caches`` accepts the same tensors and refuses moved ones."""
    import hashlib

    from kvplug.connector.protocol.metadata import KVPlugMetadata, ReqMeta, SaveSpec

    gate = tmp_path / "gate"
    gate.mkdir()
    cfg = ConnectorConfig(chunk_size=CHUNK, async_save=True, log_every_load=False,
                          tiers=[{"backend": "tests.support.tiers_for_tests:GatedPutTier",
                                  "options": {"gate": str(gate)}}])
    fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=16)
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, "sleep-test"))
    w.register_kv_caches(fx.caches)
    try:
        hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
        for i, h in enumerate(hashes):  # the first put blocks the save thread: the rest queue
            w.wait_for_save(KVPlugMetadata(CHUNK, BS, [ReqMeta(f"r{i}", [1 + 4 * i + j for j
                                                               in range(4)],
                                                               save=SaveSpec(0, 16, 0, [h]))]))
        deadline = time.monotonic() + HANG_S
        while not list(gate.glob("put-*")) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert w._saves.in_flight() >= 1  # not vacuous: copies still queued
        w.suspend()  # vLLM 0.33: unregister_kv_caches
        assert w._saves.in_flight() == 0
        w.resume()  # the same tensors: fine
        w.suspend()
        w._kv_caches = {k: v.clone() for k, v in w._kv_caches.items()}  # memory that moved
        with pytest.raises(RuntimeError, match="the KV cache changed across sleep"):
            w.resume()
    finally:
        (gate / "open").touch()
        w.close()
