"""Protocol defect 5: a save enqueued after the save thread closed releases its objects only
after its copy is done (on CUDA the copy is asynchronous: its event is waited for first). The
other five defects are in tests/unit/test_protocol_defects.py."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.support.gpu_kv_fixture import CUDA, KVFixture

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.metadata import KVPlugMetadata, ReqMeta, SaveSpec  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402
from kvplug.gpu import PageJob  # noqa: E402

BS, CHUNK = 4, 16
L1 = {"backend": "local_cpu", "options": {"capacity": "16MiB"}}


class StandInEvent:
    """A CUDA event's one use here: ``synchronize``. Records what the pool still held then."""

    def __init__(self, pool_used) -> None:
        self.pool_used = pool_used
        self.held_at_wait: int | None = None

    def synchronize(self) -> None:
        self.held_at_wait = self.pool_used()


class QueuedLayers:
    """A layer-wise store whose layers are all queued (``layerwise_store(wait=False)``)."""

    def __init__(self, event) -> None:
        self.event = event

    def __iter__(self):
        return self

    def __next__(self):
        raise StopIteration


def test_5_a_save_after_close_releases_its_objects_only_after_the_copy(tmp_path):
    """The CUDA path with a stand-in event (no GPU here; the real one is the test below): the
    objects a queued copy writes are released only once its event was waited for."""
    fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=16)
    cfg = ConnectorConfig(chunk_size=CHUNK, async_save=True, log_every_load=False, tiers=[L1])
    w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(fx.caches)
    try:
        saves = w._saves
        saves.close()
        saves.on_cuda = True  # the branch under test; the stand-in event replaces the stream

        def pool_used() -> int:
            return w.storage.stats()["local_cpu"]["pool_used"]

        ev = StandInEvent(pool_used)
        obj = w.storage.allocate((2, 4, fx.page), num_tokens=16)
        metadata = KVPlugMetadata(CHUNK, BS, [ReqMeta("r", [1, 2, 3, 4],
                                                      save=SaveSpec(0, 16, 0, [b"\x01" * 32]))])
        saves.enqueue(metadata, [w.key(b"\x01" * 32)], [obj], [PageJob([1, 2, 3, 4], obj.tensor)], 16,
                      QueuedLayers(ev))
        assert ev.held_at_wait is not None, "released without waiting for the copy's event"
        assert ev.held_at_wait > 0  # the objects were still held while the copy could run
        assert pool_used() == 0  # and released after
    finally:
        w.close()


@CUDA
@pytest.mark.cuda
def test_5_cuda_a_save_after_close_waits_for_its_copy(tmp_path):
    fx = KVFixture("LBNHC", torch.bfloat16, L=3, B=32, device="cuda")
    cfg = ConnectorConfig(chunk_size=CHUNK, layerwise=True, log_every_load=False, tiers=[L1])
    w = WorkerSide(cfg, Identity("m", f"LBNHC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
    w.register_kv_caches(fx.caches)
    try:
        w._saves.close()
        ids = list(range(3, 3 + 4))
        metadata = KVPlugMetadata(CHUNK, BS, [ReqMeta("r", ids, save=SaveSpec(0, 16, 0, [b"\x02" * 32]))])
        for name in w.kv.layer_names:
            w.save_kv_layer(name, metadata)
        w.wait_for_save(metadata)  # after close: dropped, its objects released after the copy
        assert w.kv.stream("store").query()  # nothing still writes the released memory
        assert w.storage.stats()["local_cpu"]["pool_used"] == 0
    finally:
        w.close()
