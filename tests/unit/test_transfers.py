"""``kvplug.connector.worker.transfers.Transfers``: a worker's loads and stores in one shape.
Through its own calls (``expect``, ``submit``, ``finished``, the waits) on a real paged KV cache and
a real tier, synchronous and asynchronous saves: a store then a load move the exact bytes; a
finished request is reported sent once, after its copies; a step's store comes after its loads
and leaves out the request whose KV the step computed over a failed load (and only it)."""

from __future__ import annotations

import hashlib
import random
import uuid

import pytest
import torch

from tests.support.gpu_kv_fixture import POISON, KVFixture

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.lookup import Lookup  # noqa: E402
from kvplug.connector.protocol.metadata import (  # noqa: E402
    KVPlugMetadata,
    LoadSpec,
    ReqMeta,
    SaveSpec,
)
from kvplug.connector.worker.side import WorkerSide  # noqa: E402
from kvplug.connector.worker.transfers import Load, Store  # noqa: E402

BS, CHUNK = 4, 8  # tokens per block, per chunk: 2 blocks per chunk
HANG = 30.0  # seconds: a put that never ends (a hang, not a speed check)


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


@pytest.fixture(params=[False, True], ids=["sync-save", "async-save"])
def worker(request):
    """A worker over one L1 tier, its Transfers built by registering a random KV cache."""
    fx = KVFixture("LBHNC", torch.bfloat16, L=3, B=24, seed=random.Random().randrange(1 << 30))
    cfg = ConnectorConfig(chunk_size=CHUNK, log_every_load=False, async_save=request.param,
                          tiers=[{"backend": "local_cpu", "options": {"capacity": "16MiB"}}])
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(fx.caches)
    assert w.transfers is not None
    try:
        yield fx, w
    finally:
        w.close()


def step(w: WorkerSide, fx: KVFixture, metadata: KVPlugMetadata) -> None:
    """One engine step as vLLM drives it: bind, loads, every layer waited for, the store."""
    t = w.transfers
    t.expect(metadata)
    t.submit(Load(metadata))
    for name in fx.caches:
        t.wait_layer(name)
    t.submit(Store(metadata))


def held(w: WorkerSide, hs: list[bytes]) -> list[bool]:
    return [w.storage.contains(w.key(h)) is not None for h in hs]


def test_a_store_then_a_load_move_the_exact_bytes_and_report_once(worker):
    fx, w = worker
    t = w.transfers
    src, dst = [1, 2, 3, 4, 5, 6], [13, 14, 15, 16, 17, 18]
    hs = hashes("a", 3)
    want = fx.ref_obj(src).clone()
    fx.poison(dst)
    step(w, fx, KVPlugMetadata(CHUNK, BS, [ReqMeta("a", src, save=SaveSpec(0, 24, 0, hs),
                                                   finished=True)]))
    t.wait_idle()  # every copy has read its blocks
    assert t.wait_puts([w.key(h) for h in hs], timeout=HANG)
    assert held(w, hs) == [True] * 3
    done = t.finished({"a"})
    assert done.sending == {"a"} and done.recving == set()
    assert t.finished(set()).sending == set()  # reported once
    assert w._on_lookup(Lookup(1, "b", hs))[0] == 24
    step(w, fx, KVPlugMetadata(CHUNK, BS, [ReqMeta("b", dst, load=LoadSpec(0, 24, 0, hs))]))
    assert torch.equal(fx.ref_obj(dst), want)
    assert w.take_load_errors() == set()
    assert w.take_report().loaded == {"b": {"local_cpu": 24}}
    other = [7, 8]  # the negative control: blocks no load touched keep the poison they had
    fx.poison(other)
    assert bool((fx.ref_obj(other) == POISON).all())


@pytest.mark.parametrize("fails", [True, False], ids=["failed-load", "control"])
def test_a_step_stores_after_its_loads_and_skips_what_it_computed_over_a_failed_one(worker,
                                                                                    fails):
    fx, w = worker
    t = w.transfers
    stored = hashes("p", 3)
    step(w, fx, KVPlugMetadata(CHUNK, BS, [ReqMeta("p", [1, 2, 3, 4, 5, 6],
                                                   save=SaveSpec(0, 24, 0, stored))]))
    assert t.wait_puts([w.key(h) for h in stored], timeout=HANG)
    # "b" loads three chunks; with ``fails`` the third was never stored (a chunk gone between
    # lookup and load: the lookup pins two), and the step stores b's next chunk and c's
    prompt = stored[:2] + (hashes("gone", 1) if fails else stored[2:])
    assert w._on_lookup(Lookup(2, "b", prompt))[0] == (16 if fails else 24)
    b_blocks, c_blocks = [9, 10, 11, 12, 13, 14, 15, 16], [17, 18]
    b_next, c_chunk = hashes("b-next", 1), hashes("c", 1)
    step(w, fx, KVPlugMetadata(CHUNK, BS, [
        ReqMeta("b", b_blocks, load=LoadSpec(0, 24, 0, prompt),
                save=SaveSpec(24, 32, 3, b_next)),
        ReqMeta("c", c_blocks, save=SaveSpec(0, 8, 0, c_chunk))]))
    assert t.wait_puts([w.key(h) for h in b_next + c_chunk], timeout=HANG)
    assert held(w, c_chunk) == [True]  # another request's store is not held back
    assert held(w, b_next) == [not fails]
    assert w.take_load_errors() == ({13, 14} if fails else set())


def test_waiting_for_puts_of_chunks_never_stored_is_true_at_once(worker):
    _, w = worker
    assert w.transfers.wait_puts([w.key(h) for h in hashes("never", 2)], timeout=HANG)
    w.transfers.wait_freed(["nobody"])  # returns: nothing reads a block of theirs
