"""The worker's warm-up when vLLM registers its KV cache (``Transfers.warm_up``): the threads the
first store and the first load need exist before any request, and the copy paths it runs on
block 0 leave every byte of the KV cache as it was. (What it saves in time is measured, not
tested: benchmarks/bench_first_request.py.)"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from tests.support.gpu_kv_fixture import KVFixture, snapshot_of

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402
from kvplug.storage_manager import READERS  # noqa: E402
from kvplug.tier_calls import TIER_THREADS  # noqa: E402


def threads_named(prefix: str, besides: set[threading.Thread] = frozenset()) -> int:
    """Live threads named ``prefix``... that are not in ``besides`` (those that were there
    before: an earlier test's threads may still be exiting, so a difference of counts lies)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix) and t not in besides)


def test_first_store_and_load_threads_start_with_the_engine_and_no_byte_changes(tmp_path):
    tag = uuid.uuid4().hex[:6]
    fx = KVFixture("LBHNC", torch.bfloat16, L=3, B=8, seed=5)
    before = snapshot_of(fx)
    cfg = ConnectorConfig(chunk_size=8, log_every_load=False, async_save=True, tiers=[
        {"backend": "local_cpu", "options": {"capacity": "8MiB"}},
        {"backend": "posix", "name": f"disk{tag}",
         "options": {"path": str(tmp_path / "c"), "io_threads": 3}}])
    w = WorkerSide(cfg, Identity("m", "LBHNC-bs4", 1, 0, f"w-{tag}"))
    before_start = set(threading.enumerate())
    w.register_kv_caches(fx.caches)
    try:
        # started by the registration, not by a first store or load
        assert threads_named("kvplug-save", before_start) == 1
        assert threads_named("kvplug-load", before_start) == 4
        assert threads_named("kvplug-read", before_start) == READERS
        # the tier's call threads and its 3 writers (both pools carry the tier's name)
        assert threads_named(f"kvplug-disk{tag}_") == TIER_THREADS + 3
        assert torch.equal(fx.buf, before.buf), "the warm-up changed the KV cache"
        assert w.storage.stats()["local_cpu"].get("entries", 0) == 0  # nothing was stored
    finally:
        w.close()
