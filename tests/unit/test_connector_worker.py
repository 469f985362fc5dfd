"""The worker side without an engine: a layer-wise load reads chunks layer by layer from a tier
that reads layer ranges (posix), writes exactly the stored pages, and turns a layer that fails
into load errors for that chunk and everything after it."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import torch

from tests.support.gpu_kv_fixture import POISON, KVFixture

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.lookup import Lookup  # noqa: E402
from kvplug.connector.protocol.metadata import KVPlugMetadata, LoadSpec, ReqMeta, SaveSpec  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402

BS, CHUNK = 4, 8  # tokens per block, per chunk: 2 pages per chunk
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
SRC, DST = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """A layer-wise worker over a posix tier holding 3 chunks of blocks SRC; get_layers counted."""
    fx = KVFixture("LBHNC", torch.bfloat16, L=3, B=16)
    cfg = ConnectorConfig(chunk_size=CHUNK, layerwise=True, log_every_load=False,
                          tiers=[{"backend": "posix", "options": {"path": str(tmp_path / "c")}}])
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(fx.caches)
    w.wait_for_save(KVPlugMetadata(CHUNK, BS, [ReqMeta("a", SRC, save=SaveSpec(0, 24, 0, HASHES))]))
    assert w.storage.flush(10)
    calls: list[tuple[bytes, int]] = []
    real = w.storage.get_layers

    def spy(key, first_layer, num_layers, tier=None, budget=None):
        calls.append((key.chunk_hash, first_layer))
        return real(key, first_layer, num_layers, tier=tier, budget=budget)

    monkeypatch.setattr(w.storage, "get_layers", spy)
    want = fx.ref_obj(SRC)
    fx.poison(DST)
    try:
        yield fx, w, calls, want
    finally:
        w.close()


def load(w, fx, on_layer=None):
    # posix may block but is a local medium: its hits load in the step within its budget
    assert w._on_lookup(Lookup(1, "b", HASHES)) == (24, [], [0, 1, 2])
    w.start_load_kv(KVPlugMetadata(CHUNK, BS, [ReqMeta("b", DST, load=LoadSpec(0, 24, 0, HASHES))]))
    for layer, name in enumerate(fx.caches):
        w.wait_for_layer_load(name)
        if on_layer:
            on_layer(layer)
    w.wait_for_save(None)  # the step ends: the load is finished and reported


def test_layerwise_load_reads_layer_by_layer(stored):
    fx, w, calls, want = stored

    def check(layer):  # layer i is in place once wait_for_layer_load(i) returns
        assert torch.equal(fx.ref_obj(DST)[layer], want[layer])

    load(w, fx, check)
    assert sorted(calls) == sorted((h, layer) for h in HASHES for layer in range(fx.L))
    assert torch.equal(fx.ref_obj(DST), want)
    assert w.take_load_errors() == set()
    assert w.take_report().loaded == {"b": {"posix": 24}}


def test_a_layer_that_fails_fails_its_chunk_and_the_rest(stored, monkeypatch):
    fx, w, calls, want = stored
    spy = w.storage.get_layers

    def broken(key, first_layer, num_layers, tier=None, budget=None):
        obj = spy(key, first_layer, num_layers, tier=tier, budget=budget)
        if key.chunk_hash == HASHES[1] and first_layer == 2:
            obj.ref_down()
            return None
        return obj

    monkeypatch.setattr(w.storage, "get_layers", broken)
    load(w, fx)
    assert w.take_load_errors() == set(DST[2:])  # chunk 1 (tokens 8-24) and chunk 2
    report = w.take_report()
    assert report.loaded == {"b": {"posix": 8}} and report.num_failed_blocks == {"b": 4}
    got = fx.ref_obj(DST)
    assert torch.equal(got[:, :2], want[:, :2])  # chunk 0 whole
    assert torch.equal(got[:2, 2:], want[:2, 2:])  # layers read before the failure
    assert bool((got[2, 2:] == POISON).all())  # nothing of the failed layer reached a block


def test_registration_refuses_a_kv_layout_that_is_not_block_first(tmp_path):
    """The worker compares the registered tensors with vLLM's ``KVCacheConfig`` (16 blocks): a
    ``[2, num_blocks, ...]`` tensor would otherwise be taken for a cache of 2 blocks."""
    from kvplug.connector.protocol.groups import layout_of
    from kvplug.gpu import KVLayoutError
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16)
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    cfg = ConnectorConfig(chunk_size=CHUNK, tiers=[{"backend": "local_cpu"}])
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"),
                   layout_of(kv_cache_config, BS))
    try:
        with pytest.raises(KVLayoutError, match=r"'l0'.*2 entries.*16 KV blocks"):
            w.register_kv_caches({"l0": torch.zeros(2, 16, BS, 2, 8, dtype=torch.float16)})
        w.register_kv_caches({"l0": torch.zeros(16, BS, 2, 8, dtype=torch.float16)})
        assert w.kv is not None and w.kv.num_blocks == 16
    finally:
        w.close()
