"""Disaggregated prefill on real engines: a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer``), two processes sharing a posix directory and a redis-server, the decode request
sent the moment the prefill's answer arrives with the prefill's ``kv_transfer_params`` (what
vLLM's P/D proxies do), no pause.

One pair of engines serves every case, in order (the engines start once: the suite's budget):

* posix: the producer stores these prompts on posix only (their tenant's resp quota is 0): the
  consumer loads every token the producer's hand-off names, from posix, outputs equal to its
  own cold run's (chunked at chunk boundaries: what a colocated engine's hit equals on CPU);
* resp: the same, on resp only (another tenant, its ``cache_salt``); for the last prompt the
  redis-server is paused (SIGSTOP) from before the prefill until half a second after its
  answer, so the producer's store lands after the decode request arrived (the consumer's first
  lookup waits for the server too, then finds less, or all);
* a deadline that passes: the producer's stores of this tenant land nowhere (quota 0 on both):
  the consumer waits its ``handoff_wait_s``, then computes the prompt, exact;
* the producer killed right after its answer, while it stores: the consumer loads what landed
  (a prefix of whole chunks) and computes the rest, exact; it serves on.

Each prompt's length leaves a hit of 2816 tokens (11 chunks; vLLM computes the last block).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.support.pd_engines import EngineProcess
from tests.support.redis_server import RedisServer
from tests.support.vllm_helpers import prompt, same_output, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
ENGINES_IN_PROCESS = True  # tests/conftest.py: _engine_layout
CHUNK, BLOCK = 256, 128
LENGTHS = [2818, 2900, 2944]  # (n - 1) // 128 * 128 == 2816 for each
HANDOFF = "kvplug_handoff"
TOKENS = 16  # the decode request's
WAIT_S = 3.0  # the consumer's handoff_wait_s (the deadline case waits it)
ENGINE = {"max_num_batched_tokens": CHUNK, "max_model_len": 4096}  # prefill cut at chunks


def tiers(root, url: str, quotas: bool) -> list[dict]:
    """L1, posix, resp; the producer's with the tenants that land on one lower tier or none."""
    posix = {"backend": "posix", "options": {"path": str(root), "capacity": "2GiB"}}
    resp = {"backend": "resp", "timeout_s": 10.0, "options": {"url": url}}
    if quotas:
        posix["quotas"] = {"tenants": {"resp-only": 0, "lost": 0}}
        resp["quotas"] = {"tenants": {"posix-only": 0, "lost": 0}}
    return [{"backend": "local_cpu", "options": {"capacity": "256MiB"}}, posix, resp]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    base = tmp_path_factory.mktemp("pd")
    model = str(make_model("tiny", root=tmp_path_factory.getbasetemp() / "models"))
    srv = RedisServer(base / "redis")
    root = base / "chunks"
    producer = consumer = None
    t0 = time.monotonic()
    try:
        producer = EngineProcess("prefill", model, transfer_config(
            "kvplug", {"tiers": tiers(root, srv.url, True)}, role="kv_producer"), ENGINE, base)
        consumer = EngineProcess("decode", model, transfer_config(
            "kvplug", {"tiers": tiers(root, srv.url, False), "handoff_wait_s": WAIT_S},
            role="kv_consumer"), ENGINE, base)
        # each engine's own first steps (as an operator's warm-up request): the figures of the
        # first P/D round below are then kvplug's first store and first load
        off = {"kvplug_load": False, "kvplug_save": False}
        producer.ask(prompt(2900, 699), 1, off)
        consumer.ask(prompt(2900, 699), TOKENS, off)
        yield producer, consumer, srv
    finally:
        for e in (producer, consumer):
            if e is not None:
                e.close()
        srv.stop()
        print(f"PD-ENGINES wall {time.monotonic() - t0:.1f} s")


def pd(producer, consumer, p: list[int], *, cache_salt: str | None = None,
       before_prefill=None, before_decode=None) -> tuple[dict, dict]:
    """A proxy's round: the prefill (max_tokens=1), then at once the decode with the prefill's
    kv_transfer_params."""
    if before_prefill is not None:
        before_prefill()
    pre = producer.ask(p, 1, {"do_remote_decode": True}, cache_salt)
    if before_decode is not None:
        before_decode()
    dec = consumer.ask(p, TOKENS, pre["params"], cache_salt)
    return pre, dec


def test_decode_gets_every_named_token_at_once_and_computes_past_a_deadline(engines):
    producer, consumer, srv = engines
    runs = {"posix": ([prompt(n, 700 + i) for i, n in enumerate(LENGTHS)], {"cache_salt":
                                                                             "posix-only"}),
            "resp": ([prompt(n, 710 + i) for i, n in enumerate(LENGTHS)], {"cache_salt":
                                                                             "resp-only"})}
    figures: dict = {}
    results: dict = {}
    resume = threading.Timer(0.5, srv.resume)  # the resp run's last prompt: a late store
    for tier, (prompts, how) in runs.items():
        for p in prompts:
            late = tier == "resp" and p is prompts[-1]
            pre, dec = pd(producer, consumer, p, **how,
                          before_prefill=srv.pause if late else None,
                          before_decode=resume.start if late else None)
            named = pre["params"][HANDOFF]["tokens"]
            got = dec["params"]["kvplug"]
            figures.setdefault(tier, []).append(
                {"named": named, "loaded": got["loaded_tokens"], "tiers": got["tiers"],
                 "waited_ms": got["handoff"]["waited_ms"], "misses": got["handoff"]["misses"],
                 "load_ms": got["load_ms"], "prefill_s": round(pre["seconds"], 3),
                 "decode_s": round(dec["seconds"], 3)})
            results.setdefault(tier, []).append(dec)
            assert named == (len(p) - 1) // BLOCK * BLOCK == 2816
            assert got["handoff"]["outcome"] == "ready", got
            assert got["loaded_tokens"] == named and got["tiers"] == {tier: named}, (tier, got)
            assert got["failed_blocks"] == 0 and len(dec["tokens"]) == TOKENS
    # the deadline: the producer's stores of tenant "lost" land nowhere
    lost = prompt(2900, 720)
    resume.join()
    pre, late = pd(producer, consumer, lost, cache_salt="lost")
    got = late["params"]["kvplug"]
    assert pre["params"][HANDOFF]["tokens"] == 2816
    assert got["handoff"]["outcome"] == "expired" and got["loaded_tokens"] == 0, got
    assert got["handoff"]["waited_ms"] >= WAIT_S * 1000
    figures["deadline"] = {"waited_ms": got["handoff"]["waited_ms"],
                           "decode_s": round(late["seconds"], 3)}
    # every output equals the consumer's own cold run of the prompt (no load)
    off = {"kvplug_load": False}
    for tier, (prompts, how) in runs.items():
        for p, dec in zip(prompts, results[tier], strict=True):
            ref = consumer.ask(p, TOKENS, off, how["cache_salt"])
            assert same_output(dec, ref), (tier, dec, ref)
    assert same_output(late, consumer.ask(lost, TOKENS, off, "lost"))
    # the producer killed while it stores: what landed is loaded, the rest computed, exact
    killed = prompt(2944, 730)
    ref = consumer.ask(killed, TOKENS, off)
    pre, dec = pd(producer, consumer, killed, before_decode=producer.kill)
    got = dec["params"]["kvplug"]
    assert same_output(dec, ref), (dec, ref)
    assert got["loaded_tokens"] in (*range(0, 2816, CHUNK), 2816), got
    assert got["failed_blocks"] == 0
    figures["killed"] = {"loaded": got["loaded_tokens"], "outcome": got["handoff"]["outcome"]}
    again = consumer.ask(prompt(900, 731), 4, off)  # the consumer serves on
    assert len(again["tokens"]) == 4
    print("PD-FIGURES " + json.dumps(figures))
