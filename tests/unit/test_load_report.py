"""``kvplug.connector.worker.load_report.LoadReports``: what a finished load's outcome tells vLLM,
the scheduler and the step's store. The failed blocks (or, with several KV cache groups, the
failed requests), the per-request result (tokens per tier, the first failed token), what the
step's store leaves out, the counters and the latency by the farthest tier read from; each taken
once."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.support.gpu_kv_fixture import KVFixture

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.groups import FULL, GroupInfo, GroupLayout  # noqa: E402
from kvplug.connector.protocol.metadata import LoadSpec, ReqMeta  # noqa: E402
from kvplug.connector.protocol.stats import (  # noqa: E402
    LATENCY_PREFIX,
    LOAD_BYTES_PREFIX,
    TIER_PREFIX,
    StatsRecorder,
)
from kvplug.connector.worker.load import ChunkLoad, RequestLoad  # noqa: E402
from kvplug.connector.worker.load_report import LoadReports  # noqa: E402
from kvplug.connector.worker.recovery import MISSING, LoadOutcome, UnwrittenRead  # noqa: E402
from kvplug.gpu import PagedKV  # noqa: E402
from kvplug.testing import make_key  # noqa: E402

BS, CHUNK = 4, 8  # tokens per block, per chunk
TIERS = ["ram", "disk"]  # fastest first


KV = PagedKV.from_kv_caches(KVFixture("LBHNC", torch.bfloat16, L=3, B=16).caches)


@pytest.fixture(scope="module")
def kv() -> PagedKV:
    return KV


def reports(multi: bool = False, rank: int = 0, log_every_load: bool = False):
    layout = GroupLayout([GroupInfo(0, FULL, "a"), GroupInfo(1, FULL, "b")]) if multi \
        else GroupLayout()
    stats = StatsRecorder()
    cfg = ConnectorConfig(chunk_size=CHUNK, log_every_load=log_every_load,
                          tiers=[{"backend": "local_cpu"}])
    return LoadReports(cfg, rank, layout, stats), stats


def a_load(req_id: str, blocks: list[int], tiers: list[str], fail_at: int | None = None,
           start: int = 4, seconds: float = 0.25, background: bool = False) -> LoadOutcome:
    """The outcome of a load of ``len(tiers)`` chunks of ``blocks``' request from token ``start``
    (vLLM holds what is before), chunk ``i`` read from ``tiers[i]``."""
    end = CHUNK * len(tiers)
    spec = LoadSpec(start, end, 0, [make_key(i).chunk_hash for i in range(len(tiers))],
                    background=background)
    load = RequestLoad(ReqMeta(req_id, blocks, load=spec), spec, BS, seconds=seconds)
    for i, tier in enumerate(tiers):
        s, e = i * CHUNK, (i + 1) * CHUNK
        first = max(s, start)
        load.chunks.append(ChunkLoad(make_key(i), s, e, CHUNK // BS, slice((first - s) // BS, 2),
                                     blocks[first // BS:e // BS], tier))
    if fail_at is not None:
        load.fail(fail_at, MISSING)
    return load.outcome(KV.num_layers * KV.page_bytes)


def test_a_failed_load_reports_its_blocks_result_and_counters_once(kv, caplog):
    rng = random.Random(1)
    blocks = rng.sample(range(1, 16), 6)
    r, stats = reports()
    load = a_load("a", blocks, ["ram", "disk", "disk"], fail_at=16)
    with caplog.at_level(logging.WARNING, logger="kvplug.connector"):
        r.record(load, TIERS)
    assert r.take_load_errors() == set(blocks[4:6])  # tokens 16-24: vLLM recomputes them
    assert r.take_load_errors() == set()  # taken once
    assert r.take_failed() == set()  # one KV cache group: by block, not by request
    report = r.take_report()
    assert report.loaded == {"a": {"ram": 4, "disk": 8}}  # tokens 4-8 and 8-16
    assert report.num_failed_blocks == {"a": 2} and report.failed_from == {"a": 16}
    assert report.load_ms == {"a": 250.0}
    assert r.take_report() is None
    page = kv.num_layers * kv.page_bytes
    data = stats.take().data
    assert {k: data[k] for k in ("loads", "load_tokens", "load_bytes", "load_failures",
                                 "failed_blocks")} == {
        "loads": 1, "load_tokens": 12, "load_bytes": 3 * page, "load_failures": 1,
        "failed_blocks": 2}
    assert (data[TIER_PREFIX + "ram"], data[TIER_PREFIX + "disk"]) == (4, 8)
    assert (data[LOAD_BYTES_PREFIX + "ram"], data[LOAD_BYTES_PREFIX + "disk"]) == (page,
                                                                                   2 * page)
    assert data[LATENCY_PREFIX + "disk"] == [0.25]  # by the farthest tier it read from
    assert LATENCY_PREFIX + "ram" not in data
    # its own logger's only: a thread an earlier test left (a tier's breaker) may log meanwhile
    (line,) = [m.getMessage() for m in caplog.records if m.name == "kvplug.connector"]
    assert "request a" in line and "token 16" in line and "2 blocks (tokens 16-24)" in line


def test_a_whole_load_reports_no_error_and_latency_follows_the_tier_order(kv):
    blocks = random.Random(2).sample(range(1, 16), 4)
    r, stats = reports()
    r.record(a_load("b", blocks, ["disk", "ram"], start=0, seconds=0.5), ["disk", "ram"])
    assert r.take_load_errors() == set()
    report = r.take_report()
    assert report.loaded == {"b": {"disk": 8, "ram": 8}}
    assert report.num_failed_blocks == {} and report.failed_from == {}
    data = stats.take().data
    assert data.get("load_failures", 0) == 0 and data["loads"] == 1
    assert data[LATENCY_PREFIX + "ram"] == [0.5] and LATENCY_PREFIX + "disk" not in data


def test_the_first_failed_token_of_a_request_is_the_smallest_over_its_loads(kv):
    r, _ = reports()
    blocks = list(range(1, 7))
    r.record(a_load("c", blocks, ["disk"] * 3, fail_at=16), TIERS)
    r.record(a_load("c", blocks, ["disk"] * 3, fail_at=8), TIERS)
    r.record(a_load("d", blocks, ["disk"] * 3, fail_at=0), TIERS)  # before vLLM's hit
    report = r.take_report()
    assert report.failed_from == {"c": 8, "d": 4}  # d: from vLLM's own hit on
    assert report.num_failed_blocks == {"c": 4, "d": 5}  # the latest load's count
    assert r.take_load_errors() == set(blocks[1:6])


def test_with_several_kv_cache_groups_a_failure_is_by_request(kv):
    r, _ = reports(multi=True)
    blocks = list(range(1, 7))
    r.record(a_load("e", blocks, ["ram"] * 3, fail_at=8), TIERS)
    r.record(a_load("f", blocks, ["ram"] * 3), TIERS)  # the negative control: no failure
    assert r.take_failed() == {"e"}
    assert r.take_failed() == set()
    assert r.take_load_errors() == set()  # vLLM maps block ids to requests only with one group
    assert r.take_report().num_failed_blocks == {"e": 4}


def test_unwritten_blocks_are_load_errors_and_move_the_first_failed_token(kv, caplog):
    r, stats = reports()
    r.record(a_load("g", list(range(1, 7)), ["ram"] * 3, fail_at=16), TIERS)
    with caplog.at_level(logging.WARNING, logger="kvplug.connector"):
        r.record(UnwrittenRead((9, 3), {"g": 12, "h": 20}))
    assert r.take_load_errors() == {5, 6, 9, 3}
    assert r.take_report().failed_from == {"g": 12, "h": 20}
    assert stats.take().data["unwritten_reads"] == 2
    assert "[9, 3]" in [m for m in caplog.records if m.name == "kvplug.connector"][-1].getMessage()


@pytest.mark.parametrize("rank, logged", [(0, 1), (1, 0)])
def test_every_load_is_logged_on_rank_0_when_asked(kv, caplog, rank, logged):
    r, _ = reports(rank=rank, log_every_load=True)
    with caplog.at_level(logging.INFO, logger="kvplug.connector"):
        r.record(a_load("i", list(range(1, 7)), ["ram", "disk", "disk"]), TIERS)
    lines = [m.getMessage() for m in caplog.records if "loaded" in m.getMessage()]
    assert len(lines) == logged
    if logged:
        assert "request i loaded 20 tokens (4 from ram, 16 from disk)" in lines[0]


def md_of(*reqs: tuple[str, list[int]]):
    from kvplug.connector.protocol.metadata import KVPlugMetadata

    return KVPlugMetadata(CHUNK, BS, [ReqMeta(req_id, blocks) for req_id, blocks in reqs])


def test_the_step_store_leaves_out_what_its_forward_computed_over_a_failure_once(kv):
    r, _ = reports()
    r.record(a_load("j", [1, 2, 3, 4, 5, 6], ["ram"] * 3, fail_at=16), TIERS)  # blocks 5, 6
    r.record(a_load("bg", [7, 8, 9, 10, 11, 12], ["ram"] * 3, fail_at=8, background=True), TIERS)
    step = md_of(("j", [1, 2, 3, 4, 5, 6]), ("k", [5, 13]), ("bg", [7, 8, 9, 10, 11, 12]),
                 ("m", [14, 15]))
    # j failed in the step, k holds one of its blocks; a background load's request waits, and
    # m (the negative control) touches nothing that failed
    assert r.tainted(step) == {"j", "k"}
    assert r.tainted(step) == set()  # the step's failures are forgotten once its store asks
    r.record(UnwrittenRead((13,), {"k": 4}))
    assert r.tainted(step) == {"k"}  # a block read unwritten taints who holds it
    assert r.tainted(None) == set()
