"""KV events on a real vLLM engine, read by a real ZeroMQ subscriber on 127.0.0.1.

The subscriber binds a SUB socket on 127.0.0.1 (vLLM's publisher connects to a non-wildcard
endpoint) and decodes vLLM's wire messages with msgspec into vLLM's own ``KVEventBatch``. vLLM's
prefix cache is on, so vLLM publishes its own ``BlockStored`` (medium ``GPU``) for the same blocks:
the independent reference for the block hashes kvplug announces per tier.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.support.vllm_helpers import REPO, RESULT, kvplug_config, prompt, run_script, transfer_config

ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)
BLOCK = 128  # vLLM's CPU block size
CHUNK = 512  # 4 vLLM blocks per kvplug chunk
PROMPT = 1300  # 2 full chunks + a partial one of 2 blocks (up to 1280) = 10 blocks
FILLER = [5, 6, 7, 8, 9, 10, 11, 12]  # no full block: stores nothing, no GPU event
ROUNDS_LIMIT = 600  # a hang guard only


def _event(e: Any, phase: str) -> dict[str, Any]:
    def h(x: Any) -> Any:
        return x.hex() if isinstance(x, bytes) else x

    out = {"phase": phase, "type": type(e).__name__, "medium": getattr(e, "medium", None),
           "block_hashes": [h(x) for x in getattr(e, "block_hashes", [])]}
    if type(e).__name__ == "BlockStored":
        out.update(parent=h(e.parent_block_hash), token_ids=list(e.token_ids),
                   block_size=e.block_size)
    return out


def _drive(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: subscriber + engine, the prompts, filler until events arrive."""
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVEventBatch

    from tests.support import vllm_helpers as h

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    llm = h.make_llm(spec["model"], spec["kv"], enable_prefix_caching=True, **spec["engine"],
                     kv_events_config=KVEventsConfig(
                         enable_kv_cache_events=True, publisher="zmq", topic="kv",
                         endpoint=f"tcp://127.0.0.1:{port}"))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[dict[str, Any]] = []
    seqs: list[int] = []

    def receive(phase: str) -> None:
        while sub.poll(0):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            events.extend(_event(e, phase) for e in decoder.decode(payload).events)

    def blocks(medium: str, kind: str = "BlockStored", phase: str | None = None) -> int:
        return sum(len(e["block_hashes"]) for e in events if e["medium"] == medium
                   and e["type"] == kind and phase in (None, e["phase"]))

    def pump(phase: str, done: Any, rounds: int | None = None) -> int:
        """Filler requests (engine steps deliver the workers' news) until ``done()`` or for
        exactly ``rounds`` rounds; returns the rounds run."""
        n = 0
        while n < (rounds if rounds is not None else ROUNDS_LIMIT):
            receive(phase)
            if rounds is None and done():
                break
            h.generate(llm, [FILLER], max_tokens=1)
            time.sleep(0.2)
            n += 1
        receive(phase)
        return n

    # A PUB socket that connected learns the subscription only after its first sends: warm it up
    # with requests kvplug does not store until the subscriber hears vLLM's own events.
    out: dict[str, Any] = {"rounds": {"warm": 0}}
    while not events and out["rounds"]["warm"] < ROUNDS_LIMIT:
        h.generate(llm, [h.prompt(2 * BLOCK, 1000 + out["rounds"]["warm"])], max_tokens=1,
                   params=[{"kvplug_save": False}])
        time.sleep(0.2)
        receive("warm")
        out["rounds"]["warm"] += 1
    a, b = spec["prompts"]
    h.generate(llm, [a], max_tokens=8)
    if spec["events"]:
        out["rounds"]["a"] = pump("a", lambda: blocks("ram") >= 10 and blocks("disk") >= 10
                                  and blocks("GPU") >= 10)
        h.generate(llm, [b], max_tokens=8)
        out["rounds"]["b"] = pump("b", lambda: blocks("ram", phase="b") >= 10
                                  and blocks("disk", phase="b") >= 10
                                  and blocks("GPU", phase="b") >= 10
                                  and blocks("ram", "BlockRemoved") > 0)
    else:  # the control: vLLM's own events arrive, then as many rounds as spec["rounds"]
        out["rounds"]["a"] = pump("a", lambda: blocks("GPU") >= 10)
        out["rounds"]["after"] = pump("a", None, rounds=spec["rounds"])
    out["events"], out["seqs"] = events, seqs
    return out


def _run(tmp_path, events_on: bool, rounds: int = 0, tp: int = 1) -> dict[str, Any]:
    from kvplug.connector.demo.model import make_model

    model = make_model("tiny", root=tmp_path.parent / "models")  # built once per session
    cfg = kvplug_config(tmp_path / "store", chunk_size=CHUNK, kv_events=events_on)
    # room for 3 chunks (1 MiB each on one worker; each of TP workers holds 1/TP of the heads)
    cfg["tiers"][0].update(name="ram", options={"capacity": f"{3 * 1024 // tp}KiB"})
    cfg["tiers"][1]["name"] = "disk"
    engine = {"tensor_parallel_size": tp} if tp > 1 else {}
    spec = {"model": str(model), "kv": transfer_config("kvplug", cfg), "events": events_on,
            "rounds": rounds, "prompts": [prompt(PROMPT, 11), prompt(PROMPT, 12)],
            "engine": engine}
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); "
            "from tests.engine import test_kv_events_engine as t; "
            f"print({RESULT!r} + json.dumps(t._drive(json.loads({json.dumps(spec)!r}))), "
            "flush=True)")
    # TP: a core per worker (an explicit setting wins), as in test_parallel_engine.py
    env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "0|1"
           } if tp > 1 else None
    out = run_script(code, timeout=1200, env=env)
    out["prompts"] = spec["prompts"]
    return out


def _chain(events: list[dict], medium: str, phase: str) -> list[Any]:
    """Block hashes of one medium's BlockStored events of a phase, in order."""
    return [x for e in events if e["type"] == "BlockStored" and e["medium"] == medium
            and e["phase"] == phase for x in e["block_hashes"]]


def _check_blocks(events: list[dict], gpu: list[Any], tokens: list[int], medium: str,
                  phase: str) -> None:
    """kvplug's BlockStored events for ``medium`` describe exactly vLLM's blocks ``gpu`` of the
    prompt: same hashes, each event's parent and tokens where vLLM has them."""
    mine = [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium
            and e["phase"] == phase]
    assert sorted(x for e in mine for x in e["block_hashes"]) == sorted(gpu)
    for e in mine:
        at = gpu.index(e["block_hashes"][0])
        assert e["block_hashes"] == gpu[at:at + len(e["block_hashes"])]
        assert e["parent"] == (gpu[at - 1] if at else None)
        assert e["block_size"] == BLOCK
        assert e["token_ids"] == tokens[at * BLOCK:(at + len(e["block_hashes"])) * BLOCK]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_events_name_vllms_blocks_per_tier_and_follow_evictions(tmp_path, tp):
    """TP=2: two worker processes report every chunk; vLLM's aggregator concatenates their news
    and kvplug announces each block once (a double count would fail the exact block lists)."""
    out = _run(tmp_path, events_on=True, tp=tp)
    ev, (a, b) = out["events"], out["prompts"]
    assert out["seqs"] == sorted(out["seqs"])  # vLLM's publisher: in order
    assert {e["medium"] for e in ev if e["phase"] == "warm"} == {"GPU"}  # not stored: no news
    gpu_a, gpu_b = _chain(ev, "GPU", "a"), _chain(ev, "GPU", "b")
    assert len(gpu_a) == len(gpu_b) == 10 and not set(gpu_a) & set(gpu_b)
    for medium in ("ram", "disk"):
        _check_blocks(ev, gpu_a, a, medium, "a")
        _check_blocks(ev, gpu_b, b, medium, "b")
    # B's 2.5 MiB pushed A out of the 3 MiB RAM tier: removals there name A's blocks only, after
    # they were stored; the disk tier (64 chunks) lost nothing
    removed = [e for e in ev if e["type"] == "BlockRemoved"]
    assert removed and {e["medium"] for e in removed} == {"ram"}
    gone = [x for e in removed for x in e["block_hashes"]]
    assert set(gone) <= set(gpu_a) and len(gone) == len(set(gone))
    assert all(e["phase"] == "b" for e in removed)
    # what RAM holds now fits in it (3 MiB = 12 blocks of 256 KiB) and includes all of B
    held = set(_chain(ev, "ram", "a") + _chain(ev, "ram", "b")) - set(gone)
    assert set(gpu_b) <= held and len(held) <= 12
    print("filler rounds until the events arrived:", out["rounds"],
          [(e["phase"], e["type"], e["medium"], len(e["block_hashes"])) for e in ev])


def test_no_kvplug_events_when_its_switch_is_off(tmp_path):
    out = _run(tmp_path, events_on=False, rounds=20)
    ev = out["events"]
    print("filler rounds:", out["rounds"])
    assert len(_chain(ev, "GPU", "a")) == 10  # the subscriber hears vLLM's own events
    assert {e["medium"] for e in ev} == {"GPU"}  # ... and nothing from kvplug's tiers
    assert (tmp_path / "store" / "chunks").exists() and any(
        p.is_file() for p in (tmp_path / "store" / "chunks").rglob("*"))  # kvplug did store


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def test_kvplug_serve_publishes_tier_events(tmp_path):
    """The README's switch: ``kvplug serve ... --kv-events-config`` (tiers named with vLLM's
    vocabulary, CPU and STORAGE); a real server, requests over HTTP, a SUB socket on 127.0.0.1."""
    import msgspec
    import zmq
    from kvplug.connector.demo.model import make_model
    from vllm.distributed.kv_events import KVEventBatch

    from tests.support.server_helpers import TINY_SERVER_ARGS, free_port, kvplug_cli, running_server

    model = make_model("tiny", root=tmp_path.parent / "models")  # built once per session
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text("chunk_size: 256\ntiers:\n"
                   "  - {name: CPU, backend: local_cpu, options: {capacity: 64MiB}}\n"
                   f"  - {{name: STORAGE, backend: posix, options: {{path: {tmp_path / 'chunks'},"
                   " capacity: 1GiB}}\n")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    events_port = sub.bind_to_random_port("tcp://127.0.0.1")
    events_cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": f"tcp://127.0.0.1:{events_port}"})
    server_args = [a for a in TINY_SERVER_ARGS if a != "--no-enable-prefix-caching"]
    port = free_port()
    argv = kvplug_cli("serve", str(model), "--kvplug-config", str(cfg), "--port", str(port),
                      "--kv-events-config", events_cfg, *server_args)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got: list[dict[str, Any]] = []

    def receive(phase: str) -> None:
        while sub.poll(0):
            _, _, payload = sub.recv_multipart()
            got.extend(_event(e, phase) for e in decoder.decode(payload).events)

    def blocks(medium: str, phase: str) -> int:
        return len(_chain(got, medium, phase))

    try:
        with running_server(argv, tmp_path, port) as (url, _log):
            def complete(tokens: list[int], n: int = 1, save: bool = True) -> None:
                body = {"model": str(model), "prompt": tokens, "max_tokens": n,
                        "temperature": 0.0}
                if not save:
                    body["kv_transfer_params"] = {"kvplug_save": False}
                _post(url, body)

            rounds = 0
            while not got and rounds < ROUNDS_LIMIT:  # warm the publisher up (see _drive)
                complete(prompt(2 * BLOCK, 2000 + rounds), save=False)
                time.sleep(0.2)
                receive("warm")
                rounds += 1
            tokens = prompt(PROMPT, 21)
            complete(tokens, n=4)
            rounds = 0
            while rounds < ROUNDS_LIMIT:
                receive("a")
                if all(blocks(m, "a") >= 10 for m in ("GPU", "CPU", "STORAGE")):
                    break
                complete(FILLER)
                time.sleep(0.2)
                rounds += 1
    finally:
        sub.close(linger=0)
    assert {e["medium"] for e in got if e["phase"] == "warm"} == {"GPU"}
    gpu = _chain(got, "GPU", "a")
    assert len(gpu) == 10
    for medium in ("CPU", "STORAGE"):
        _check_blocks(got, gpu, tokens, medium, "a")
    assert not [e for e in got if e["type"] == "BlockRemoved"]
