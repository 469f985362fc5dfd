"""What the remote-tier benchmarks share: each store's server started on loopback, the tier's
options over it, a raw client of the same server, and random chunks.

Used by ``bench_remote_reads.py``, ``bench_remote_tiers.py``, ``bench_tiers_cli.py`` (which
hands the options to ``kvplug bench``) and ``bench_fsspec.py``. The servers come from the tests'
helpers (``tests.support``: ``redis_server``, ``mooncake_store``, ``s3_server``; run the
benchmarks as ``python -m benchmarks.NAME`` from the repository root). Mooncake's clients listen
on every interface, so a script measuring mooncake calls :func:`private_network_for` first: it
re-runs itself in a private network namespace (``unshare -n``, loopback only; root).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvplug.memory import MemoryObj, heap_memory_obj

MiB = 1 << 20
STORES = ("resp", "mooncake", "fsspec")


def chunk(mib: float, seed: int) -> MemoryObj:
    """A heap chunk of ``mib`` MiB (32 layers x 2 x pages, 256 tokens) of seeded random bytes."""
    pages = max(1, int(mib * MiB) // (32 * 2))
    obj = heap_memory_obj((32, 2, pages), num_tokens=256)
    gen = torch.Generator().manual_seed(seed)
    obj.byte_view.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


@dataclass
class Raw:
    """A store's raw client: read many values in one batch (``batch``) or one (``one``), write
    one (``put``), look many up (``lookup``: truthy per name), delete many, close."""

    batch: Callable[[list[str]], list]
    one: Callable[[str], Any]
    put: Callable[[str, bytes], Any]
    lookup: Callable[[list[str]], list]
    delete: Callable[[list[str]], Any]
    close: Callable[[], Any] = field(default=lambda: None)


def raw_redis(url: str) -> Raw:
    """redis-py (hiredis): a pipeline of ``GET``/``EXISTS`` for a batch."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=60)

    def pipelined(op: str) -> Callable[[list[str]], list]:
        def run(names: list[str]) -> list:
            pipe = client.pipeline(transaction=False)
            for n in names:
                getattr(pipe, op)(n)
            return pipe.execute()

        return run

    return Raw(pipelined("get"), client.get, client.set, pipelined("exists"),
               lambda names: client.delete(*names), client.close)


def raw_mooncake(master: str) -> Raw:
    """A second ``MooncakeDistributedStore`` client of the same master (``get_batch`` for a
    batch, ``upsert`` for a put)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 512 << 20, "tcp", "", master) == 0

    def put(name: str, data: bytes) -> None:
        assert store.upsert(name, data) == 0

    return Raw(store.get_batch, store.get, put,
               lambda names: [c == 1 for c in store.batch_is_exist(names)], store.batch_remove,
               store.close)


def raw_fsspec(url: str, storage_options: dict) -> Raw:
    """The filesystem of ``url`` (s3fs on moto): ``cat`` of many paths at once for a batch."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url, **storage_options)

    def batch(paths: list[str]) -> list:
        got = fs.cat(paths)  # concurrent requests
        return [got[p] for p in paths]

    return Raw(batch, fs.cat_file, fs.pipe_file, lambda paths: [fs.exists(p) for p in paths],
               fs.rm)


@dataclass
class Store:
    """A started store: the tier's ``backend`` and ``options`` over it, and how to make a raw
    client of the same server."""

    backend: str
    options: dict[str, Any]
    client: str  # the raw client, in words
    make_raw: Callable[[], Raw]

    def tier(self, timeout_s: float = 60.0, **options: Any) -> dict[str, Any]:
        """The tier's config (the manager's bound ``timeout_s``; ``options`` added)."""
        return {"backend": self.backend, "timeout_s": timeout_s,
                "options": {**self.options, **options}}


def private_network_for(stores: list[str], module: str) -> None:
    """Re-run ``python -m module`` in a private network namespace when mooncake is measured."""
    if "mooncake" in stores:
        from tests.support.mooncake_store import rerun_module_in_private_netns

        rerun_module_in_private_netns(module)


@contextmanager
def started(name: str, workdir: Path, *, maxmemory: str = "3gb", segment: str = "1GiB",
            buffer: str = "512MiB", timeout_s: float = 15.0) -> Iterator[Store]:
    """Start store ``name`` (resp: ``redis-server``; mooncake: ``mooncake_master``; fsspec:
    moto's S3 server and a bucket) under ``workdir``; stopped on exit. The tier's own
    ``timeout_s`` (each call to the store) is ``timeout_s``."""
    if name == "resp":
        import redis

        from tests.support.redis_server import RedisServer

        srv = RedisServer(workdir / "redis", maxmemory=maxmemory)
        version = redis.Redis.from_url(srv.url).info("server")["redis_version"]
        try:
            yield Store("resp", {"url": srv.url, "timeout_s": timeout_s},
                        f"redis-py {redis.__version__} (hiredis) on redis-server {version}",
                        lambda: raw_redis(srv.url))
        finally:
            srv.stop()
    elif name == "mooncake":
        from tests.support.mooncake_store import MooncakeMaster

        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        master = MooncakeMaster(workdir / "mooncake")
        try:
            yield Store("mooncake", {"master": master.address, "timeout_s": timeout_s,
                                     "global_segment_size": segment, "local_buffer_size": buffer},
                        "Mooncake's MooncakeDistributedStore (tcp, a second client of the master)",
                        lambda: raw_mooncake(master.address))
        finally:
            master.stop()
    elif name == "fsspec":
        import s3fs

        from tests.support.s3_server import CREDENTIALS, MotoServer

        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1")
        moto = MotoServer()
        try:
            storage_options = {"endpoint_url": moto.endpoint, **CREDENTIALS}
            s3fs.S3FileSystem(skip_instance_cache=True, **storage_options).mkdir("bench")
            yield Store("fsspec", {"url": "s3://bench/kv", "timeout_s": timeout_s,
                                   "storage_options": storage_options},
                        f"s3fs {s3fs.__version__} on moto's S3 server",
                        lambda: raw_fsspec("s3://bench/kv", storage_options))
        finally:
            moto.stop()
    else:
        raise ValueError(f"unknown store {name!r}; one of {', '.join(STORES)}")
