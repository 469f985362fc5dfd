"""Two vLLM engine processes share one Mooncake master through the mooncake tier (their only
tier); the master is then killed mid-workload and restarted. Runs only inside a private network
namespace (``tests/test_mooncake_engine.py`` starts it under ``unshare -n``, loopback only).

Each engine's client lends the store a segment of its own memory (as in production), so an
object lives in the process that lent the memory it was placed in: engine A (the writer) stays
alive until engine B (the reader) is done. The engines and this test meet through files in a
``sync`` folder.

* A serves some prompts (its loads off) and waits until its tier has written every chunk.
* B computes its own references for every prompt (loading and saving off), then serves A's
  prompts: every full chunk is loaded from the store (read from A's segment over TCP after the
  P2P handshake), outputs bit-identical to B's references and to A's outputs; a prompt nobody
  stored gets no hit (the negative control).
* B serves more requests (loads of stored prompts, a fresh prompt to store) and the master is
  killed while they run; then B serves with the master down (misses, dropped stores, the breaker trips).
* The master restarts (empty): B serves one prompt until it hits again (the breaker recovers,
  the segments are mounted again), then A's prompts, lost with the restart: misses, no errors.

Every output of B, whatever the store did, equals B's reference; every request completes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from mooncake_store import MooncakeMaster
from vllm_helpers import REPO, prompt, run_script, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(800)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout

MODEL_ENV = "TEST_MOONCAKE_ENGINE_MODEL"  # not KVPLUG_*: conftest clears those for each test
CHUNK = 256  # tokens per scheduler step (chunked prefill) and per stored chunk
BLOCK = 128  # vLLM's block size for this engine: hits are whole blocks
SHARED = [prompt(600 + 50 * i, 900 + i) for i in range(3)]  # A serves these
FRESH = prompt(520, 950)  # nobody stores it before B looks it up
IN_FLIGHT = prompt(700, 951)  # stored by the requests the master is killed under
DOWN = prompt(560, 952)  # served while the master is down: its store is dropped
AFTER = prompt(540, 953)  # served after the restart until it hits
OFF = {"kvplug_load": False, "kvplug_save": False}
WAIT_S = 400.0  # how long an engine waits for the other side (a hang, not a speed check)
RECOVER_S = 120.0  # how long B serves AFTER before it must hit again


def tier_state(_worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.storage.stats()["mooncake"]


def flush(_worker) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.storage.flush(timeout=30)


def await_file(path: Path, limit: float = WAIT_S, alive: threading.Thread | None = None) -> bool:
    """Wait until ``path`` exists (True), ``alive`` ended (False), or fail after ``limit``."""
    deadline = time.monotonic() + limit
    while not path.exists():
        if alive is not None and not alive.is_alive():
            return False
        assert time.monotonic() < deadline, f"waited {limit} s for {path.name}"
        time.sleep(0.05)
    return True


def _writer(llm, h, sync: Path, keys: int) -> dict:
    served = [h.generate_full(llm, [p], params=[{"kvplug_load": False}])[0] for p in SHARED]
    deadline = time.monotonic() + WAIT_S  # saves finish in the worker after the outputs
    while llm.collective_rpc(tier_state)[0]["written"] < keys:
        assert time.monotonic() < deadline, llm.collective_rpc(tier_state)[0]
        time.sleep(0.05)
    (sync / "a-stored").touch()
    await_file(sync / "b-done")  # B reads from this process's segment: stay until it is done
    return {"served": served, "state": llm.collective_rpc(tier_state)[0]}


def _reader(llm, h, sync: Path) -> dict:
    def gen(p: list[int], params: dict | None = None) -> dict:
        return h.generate_full(llm, [p], params=[params])[0]

    def state() -> dict:
        return llm.collective_rpc(tier_state)[0]

    out: dict = {"refs": [gen(p, OFF) for p in [*SHARED, FRESH, IN_FLIGHT, DOWN, AFTER]]}
    await_file(sync / "a-stored")
    out["shared"] = [gen(p) for p in [*SHARED, FRESH]]
    out["before_kill"] = state()
    (sync / "kill").touch()  # the test kills the master as soon as it sees this
    out["in_flight"] = [gen(p) for p in (*SHARED[1:], IN_FLIGHT)]  # one at a time: a batch's
    # numerics on CPU depend on its composition, which a load changes (no exact reference)
    await_file(sync / "killed")
    out["down"] = [gen(p) for p in (SHARED[0], DOWN)]
    out["flushed_down"] = llm.collective_rpc(flush)[0]
    out["down_state"] = state()
    (sync / "restart").touch()
    await_file(sync / "restarted")
    out["recover"] = []
    deadline = time.monotonic() + RECOVER_S
    while not out["recover"] or not out["recover"][-1]["kvplug"]["tiers"].get("mooncake"):
        assert time.monotonic() < deadline, ("no hit after the restart", out["recover"], state())
        out["recover"].append(gen(AFTER))
    out["lost"] = [gen(p) for p in SHARED]
    out["state"] = state()
    return out


def _engine(spec: dict) -> dict:
    import vllm_helpers as h

    llm = h.make_llm(spec["model"], spec["kv"], max_num_batched_tokens=CHUNK, max_model_len=2048,
                     num_gpu_blocks_override=32)
    sync = Path(spec["sync"])
    if spec["role"] == "writer":
        return _writer(llm, h, sync, spec["keys"])
    return _reader(llm, h, sync)


def _run(spec: dict) -> dict:
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO / 'tests')!r}); "
            "import vllm_helpers as h; from mooncake_netns_engine import _engine; "
            f"print(h.RESULT + json.dumps(_engine(json.loads({json.dumps(spec)!r}))), flush=True)")
    return run_script(code, timeout=WAIT_S + 200)


def test_two_engines_share_one_master_killed_and_restarted(tmp_path):
    master = MooncakeMaster(tmp_path / "mooncake")
    sync = tmp_path / "sync"
    sync.mkdir()
    options = {"master": master.address, "global_segment_size": "64MiB",
               "local_buffer_size": "32MiB", "timeout_s": 2.0, "negative_cache_s": 0,
               "breaker_backoff_s": 0.2, "breaker_max_backoff_s": 0.5}
    kv = transfer_config("kvplug", {"tiers": [{"backend": "mooncake", "timeout_s": 10.0,
                                               "options": options}]})
    full = [len(p) // BLOCK * BLOCK for p in SHARED]  # hits cover every full block
    keys = sum(-(-n // CHUNK) for n in full)  # stores are chunks of CHUNK tokens, the last partial
    spec = {"model": os.environ[MODEL_ENV], "kv": kv, "sync": str(sync), "keys": keys}
    results: dict = {}

    def run(role: str) -> None:
        try:
            results[role] = _run({**spec, "role": role})
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[role] = exc

    a = threading.Thread(target=run, args=("writer",))
    b = threading.Thread(target=run, args=("reader",))
    a.start()
    b.start()
    t0 = time.monotonic()
    try:
        if await_file(sync / "kill", alive=b):
            master.kill()
            (sync / "killed").touch()
        if await_file(sync / "restart", alive=b):
            master.restart()  # empty: a restart loses every object
            (sync / "restarted").touch()
        b.join(WAIT_S + 300)
    finally:
        (sync / "b-done").touch()
        a.join(WAIT_S + 300)
        master.stop()
    for role in ("writer", "reader"):
        if isinstance(results.get(role), BaseException):
            raise results[role]
    wa, rb = results["writer"], results["reader"]
    wall = time.monotonic() - t0

    same = lambda x, y: (x["tokens"], x["logprobs"]) == (y["tokens"], y["logprobs"])  # noqa: E731
    refs = rb["refs"]
    ref_of = {tuple(p): r for p, r in zip([*SHARED, FRESH, IN_FLIGHT, DOWN, AFTER], refs)}
    # A computed what B computed without the cache; every output of B, whatever the store did,
    # is exact, and every request completed (8 tokens each)
    assert all(same(x, y) for x, y in zip(wa["served"], refs[: len(SHARED)], strict=True))
    served = [(SHARED + [FRESH])[i] for i in range(len(SHARED) + 1)]
    for name, prompts in (("shared", served), ("in_flight", [*SHARED[1:], IN_FLIGHT]),
                          ("down", [SHARED[0], DOWN]), ("recover", [AFTER] * len(rb["recover"])),
                          ("lost", SHARED)):
        outs = rb[name]
        assert len(outs) == len(prompts)
        for p, o in zip(prompts, outs):
            assert same(o, ref_of[tuple(p)]) and len(o["tokens"]) == 8, (name, o, ref_of[tuple(p)])
    shared = [x["kvplug"] for x in rb["shared"]]
    # every full chunk of A's prompts was loaded from the store (A's segment); A loaded nothing
    assert [r["tiers"].get("mooncake", 0) for r in shared[: len(SHARED)]] == full, shared
    assert all(r["loaded_tokens"] == n > 0 for r, n in zip(shared, full)), shared
    assert all(x["kvplug"]["loaded_tokens"] == 0 for x in wa["served"])
    assert shared[-1]["lookup_hit_tokens"] == 0, shared[-1]  # the negative control
    assert all(r["failed_blocks"] == 0 for r in shared), shared
    assert rb["before_kill"]["breaker_trips"] == 0, rb["before_kill"]
    # the master down: lookups miss, the breaker trips, stores are dropped
    down = rb["down_state"]
    assert all(x["kvplug"]["lookup_hit_tokens"] == 0 for x in rb["down"]), rb["down"]
    assert down["breaker_trips"] >= 1 and down["remote_errors"] + down["socket_timeouts"] >= 1, down
    assert down["dropped_down"] + down["put_errors"] >= 1, down
    # after the restart: hits again, the breaker closed; what the store held before is lost
    assert rb["recover"][-1]["kvplug"]["tiers"]["mooncake"] > 0, rb["recover"]
    assert all(x["kvplug"]["lookup_hit_tokens"] == 0 for x in rb["lost"]), rb["lost"]
    assert all(x["kvplug"]["failed_blocks"] == 0 for x in rb["lost"] + rb["recover"][-1:])
    st = rb["state"]
    assert st["breaker_open"] == 0.0 and st["breaker_trips"] >= 1, st
    for s in (st, wa["state"]):
        assert s["corrupt"] == 0 and s["pinned"] == 0 and s["faults"] == 0, s
    assert wa["state"]["written"] >= keys, wa["state"]
    print("MOONCAKE-ENGINE " + json.dumps({
        "wall_s": round(wall, 1), "loaded": [r["tiers"] for r in shared],
        "in_flight": [x["kvplug"] for x in rb["in_flight"]],
        "down": [x["kvplug"] for x in rb["down"]], "recover_rounds": len(rb["recover"]),
        "lost": [x["kvplug"]["lookup_hit_tokens"] for x in rb["lost"]],
        "down_state": {k: down[k] for k in ("breaker_trips", "breaker_refused", "remote_errors",
                                             "socket_timeouts", "dropped_down", "put_errors")},
        "final": {k: st[k] for k in ("breaker_trips", "breaker_open", "written", "corrupt",
                                     "dropped_down", "dropped_full", "put_errors")},
        "a_written": wa["state"]["written"]}))
