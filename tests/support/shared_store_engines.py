"""Two vLLM engine processes share one store through a remote tier (their only tier), and the
store is killed under their requests and restarted: the scenario of tests/engine/test_resp_engine.py
(a redis-server) and tests/engine/test_mooncake_engine_netns.py (a Mooncake master), whatever the tier.

Both engines run at once (a Mooncake object lives in the memory of the engine that lent it, so
engine A stays alive until engine B is done); they and the test meet through files in a ``sync``
folder, and the test kills and restarts the server when B asks.

* A serves some prompts (its loads off) and waits until its tier has written every chunk.
* B computes its own references for every prompt (loading and saving off), then serves A's
  prompts: every full chunk is loaded from the store, outputs bit-identical to B's references and
  to A's outputs; a prompt nobody stored gets no hit (the negative control).
* B serves more requests (loads of stored prompts, a fresh prompt to store) and the server is
  killed while they run; then B serves with the server down (misses, dropped stores, the breaker
  trips).
* The server restarts (empty): B serves one prompt until it hits again (the breaker recovers),
  then A's prompts, lost with the restart: misses, no load errors.

Every output of B, whatever the store did, equals B's reference; every request completes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.vllm_helpers import REPO, prompt, run_script

CHUNK = 256  # tokens per scheduler step (chunked prefill) and per stored chunk
BLOCK = 128  # vLLM's block size for this engine: hits are whole blocks
SHARED = [prompt(600 + 50 * i, 900 + i) for i in range(3)]  # A serves these
FRESH = prompt(520, 950)  # nobody stores it before B looks it up
IN_FLIGHT = prompt(700, 951)  # stored by the requests the server is killed under
DOWN = prompt(560, 952)  # served while the server is down: its store is dropped
AFTER = prompt(540, 953)  # served after the restart until it hits
PROMPTS = [*SHARED, FRESH, IN_FLIGHT, DOWN, AFTER]
OFF = {"kvplug_load": False, "kvplug_save": False}
WAIT_S = 400.0  # how long an engine waits for the other side (a hang, not a speed check)
RECOVER_S = 120.0  # how long B serves AFTER before it must hit again
TOKENS = 8  # generated per request


def tier_state(_worker, tier: str) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.storage.stats()[tier]


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


def _writer(llm: Any, h: Any, spec: dict) -> dict:
    sync, tier = Path(spec["sync"]), spec["tier"]
    served = [h.generate_full(llm, [p], params=[{"kvplug_load": False}])[0] for p in SHARED]
    deadline = time.monotonic() + WAIT_S  # saves finish in the worker after the outputs
    while (st := llm.collective_rpc(tier_state, args=(tier,))[0])["written"] < spec["keys"]:
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    (sync / "a-stored").touch()
    await_file(sync / "b-done")  # B may read from this process's memory: stay until it is done
    return {"served": served, "state": llm.collective_rpc(tier_state, args=(tier,))[0]}


def _reader(llm: Any, h: Any, spec: dict) -> dict:
    sync, tier = Path(spec["sync"]), spec["tier"]

    def gen(p: list[int], params: dict | None = None) -> dict:
        return h.generate_full(llm, [p], params=[params])[0]

    def state() -> dict:
        return llm.collective_rpc(tier_state, args=(tier,))[0]

    out: dict = {"refs": [gen(p, OFF) for p in PROMPTS]}
    await_file(sync / "a-stored")
    out["shared"] = [gen(p) for p in [*SHARED, FRESH]]
    out["before_kill"] = state()
    (sync / "kill").touch()  # the test kills the server as soon as it sees this
    # one request at a time: a batch's numerics on CPU depend on its composition, which a load
    # changes (no exact reference)
    out["in_flight"] = [gen(p) for p in (*SHARED[1:], IN_FLIGHT)]
    await_file(sync / "killed")
    out["down"] = [gen(p) for p in (SHARED[0], DOWN)]
    out["flushed_down"] = llm.collective_rpc(flush)[0]
    out["down_state"] = state()
    (sync / "restart").touch()
    await_file(sync / "restarted")
    out["recover"] = []
    deadline = time.monotonic() + RECOVER_S
    while not out["recover"] or not out["recover"][-1]["kvplug"]["tiers"].get(tier):
        assert time.monotonic() < deadline, ("no hit after the restart", out["recover"], state())
        out["recover"].append(gen(AFTER))
    out["lost"] = [gen(p) for p in SHARED]
    out["state"] = state()
    return out


def _engine(spec: dict) -> dict:
    from tests.support import vllm_helpers as h

    llm = h.make_llm(spec["model"], spec["kv"], max_num_batched_tokens=CHUNK, max_model_len=2048,
                     num_gpu_blocks_override=32)
    return (_writer if spec["role"] == "writer" else _reader)(llm, h, spec)


def _run(spec: dict) -> dict:
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO)!r}); "
            "from tests.support import vllm_helpers as h; from tests.support.shared_store_engines import _engine; "
            f"print(h.RESULT + json.dumps(_engine(json.loads({json.dumps(spec)!r}))), flush=True)")
    return run_script(code, timeout=WAIT_S + 200)


def full_blocks() -> list[int]:
    """Tokens of each of A's prompts that a hit covers (every full block)."""
    return [len(p) // BLOCK * BLOCK for p in SHARED]


def run_engines(model: str, kv: dict, tier: str, sync: Path, kill: Callable[[], None],
                restart: Callable[[], None],
                stored: Callable[[], int] | None = None) -> tuple[dict, dict, dict]:
    """Run engine A (writer) and B (reader) at once; ``kill`` and ``restart`` the server when B
    asks. ``stored``: how many values the store holds (read when A has stored, before B stores
    anything). Returns A's and B's results and what the test saw."""
    keys = sum(-(-n // CHUNK) for n in full_blocks())  # chunks of CHUNK tokens, the last partial
    spec = {"model": model, "kv": kv, "sync": str(sync), "keys": keys, "tier": tier}
    sync.mkdir(parents=True, exist_ok=True)
    results: dict = {}

    def run(role: str) -> None:
        try:
            results[role] = _run({**spec, "role": role})
        except BaseException as exc:  # noqa: BLE001 - raised below
            results[role] = exc

    a = threading.Thread(target=run, args=("writer",))
    b = threading.Thread(target=run, args=("reader",))
    seen: dict = {"keys": keys}
    t0 = time.monotonic()
    a.start()
    b.start()
    try:
        if stored is not None and await_file(sync / "a-stored", alive=a):
            seen["stored"] = stored()
        if await_file(sync / "kill", alive=b):
            kill()
            (sync / "killed").touch()
        if await_file(sync / "restart", alive=b):
            restart()  # empty: a restart loses every value
            (sync / "restarted").touch()
        b.join(WAIT_S + 300)
    finally:
        (sync / "b-done").touch()
        a.join(WAIT_S + 300)
    seen["wall_s"] = round(time.monotonic() - t0, 1)
    for role in ("writer", "reader"):
        if isinstance(results.get(role), BaseException):
            raise results[role]
    return results["writer"], results["reader"], seen


def check(tier: str, wa: dict, rb: dict, seen: dict) -> dict:
    """The scenario's assertions; a summary of what happened (for the test's output)."""
    same = lambda x, y: (x["tokens"], x["logprobs"]) == (y["tokens"], y["logprobs"])  # noqa: E731
    ref_of = {tuple(p): r for p, r in zip(PROMPTS, rb["refs"], strict=True)}
    # A computed what B computed without the cache; every output of B, whatever the store did,
    # is exact, and every request completed
    assert all(same(x, ref_of[tuple(p)]) for x, p in zip(wa["served"], SHARED, strict=True))
    for name, prompts in (("shared", [*SHARED, FRESH]), ("in_flight", [*SHARED[1:], IN_FLIGHT]),
                          ("down", [SHARED[0], DOWN]), ("recover", [AFTER] * len(rb["recover"])),
                          ("lost", SHARED)):
        assert len(rb[name]) == len(prompts), name
        for p, o in zip(prompts, rb[name]):
            ref = ref_of[tuple(p)]
            assert same(o, ref) and len(o["tokens"]) == TOKENS, (name, o, ref)
    shared = [x["kvplug"] for x in rb["shared"]]
    full = full_blocks()
    # every full chunk of A's prompts was loaded from the store; A loaded nothing
    assert [r["tiers"].get(tier, 0) for r in shared[: len(SHARED)]] == full, shared
    assert all(r["loaded_tokens"] == n > 0 for r, n in zip(shared, full)), shared
    assert all(x["kvplug"]["loaded_tokens"] == 0 for x in wa["served"])
    assert shared[-1]["lookup_hit_tokens"] == 0, shared[-1]  # the negative control
    assert all(r["failed_blocks"] == 0 for r in shared), shared
    assert rb["before_kill"]["breaker_trips"] == 0, rb["before_kill"]
    if "stored" in seen:  # the store's own count: A's chunks, each once
        assert seen["stored"] == seen["keys"], seen
    # the server down: lookups miss, the breaker trips, stores are dropped
    down = rb["down_state"]
    assert all(x["kvplug"]["lookup_hit_tokens"] == 0 for x in rb["down"]), rb["down"]
    assert down["breaker_trips"] >= 1 and down["remote_errors"] + down["socket_timeouts"] >= 1, down
    assert down["dropped_down"] + down["put_errors"] >= 1, down
    # after the restart: hits again, the breaker closed; what the store held before is lost
    assert rb["recover"][-1]["kvplug"]["tiers"][tier] > 0, rb["recover"]
    assert all(x["kvplug"]["lookup_hit_tokens"] == 0 for x in rb["lost"]), rb["lost"]
    assert all(x["kvplug"]["failed_blocks"] == 0 for x in rb["lost"] + rb["recover"][-1:])
    st = rb["state"]
    assert st["breaker_open"] == 0.0 and st["breaker_trips"] >= 1, st
    for s in (st, wa["state"]):
        assert s["corrupt"] == 0 and s["pinned"] == 0 and s["faults"] == 0, s
    assert wa["state"]["written"] >= seen["keys"], wa["state"]
    pick = lambda s, names: {k: s[k] for k in names}  # noqa: E731
    return {
        **seen, "loaded": [r["tiers"] for r in shared],
        "in_flight_hits": [x["kvplug"]["tiers"].get(tier, 0) for x in rb["in_flight"]],
        "in_flight_failed_blocks": [x["kvplug"]["failed_blocks"] for x in rb["in_flight"]],
        "recover_rounds": len(rb["recover"]),
        "lost_hits": [x["kvplug"]["lookup_hit_tokens"] for x in rb["lost"]],
        "down_state": pick(down, ("breaker_trips", "breaker_refused", "remote_errors",
                                  "socket_timeouts", "dropped_down", "put_errors")),
        "final": pick(st, ("breaker_trips", "breaker_open", "written", "corrupt", "dropped_down",
                           "dropped_full", "put_errors")),
        "a_written": wa["state"]["written"]}
