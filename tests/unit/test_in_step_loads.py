"""In-step loads read only the tier their lookup pinned, under one allowance per step.

A worker with the production stack (L1, a posix disk, a remote Valkey/Redis tier on a real
``redis-server``), without an engine. A load vLLM runs inside the engine step (``start_load_kv``)
must never wait on the remote tier: a chunk its lookup pinned on the disk whose file is damaged,
or a chunk this rank never pinned (with TP > 1 the hit is the minimum over ranks), is a load
error, not a read from wherever it is; and a hung disk costs the step its read allowance
(``in_step_load_deadline_s``) once, not a timeout per group of reads. Calls to a tier are counted
by a wrapper hook on it; durations are never asserted.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.support.gpu_kv_fixture import KVFixture
from tests.support.redis_server import redis_server  # noqa: F401 (fixture)

pytest.importorskip("vllm")

from kvplug.connector.protocol.config import ConnectorConfig  # noqa: E402
from kvplug.connector.protocol.identity import Identity  # noqa: E402
from kvplug.connector.protocol.lookup import Lookup  # noqa: E402
from kvplug.connector.protocol.metadata import KVPlugMetadata, LoadSpec, ReqMeta, SaveSpec  # noqa: E402
from kvplug.connector.worker.side import WorkerSide  # noqa: E402
from kvplug.hookspecs import hookimpl  # noqa: E402

BS, CHUNK = 4, 8  # tokens per block, per chunk: 2 pages per chunk


class Calls:
    """A wrapper on one tier: every read or lookup call it gets, in order."""

    def __init__(self, block: threading.Event | None = None) -> None:
        self.calls: list[str] = []
        self.block = block  # while set-able and not set: each read waits (a hung medium)

    def _hang(self) -> None:
        if self.block is not None:
            self.block.wait(60)

    @hookimpl(wrapper=True)
    def get(self, key):
        self.calls.append("get")
        self._hang()
        return (yield)

    @hookimpl(wrapper=True)
    def batched_get(self, keys):
        self.calls.append("batched_get")
        self._hang()
        return (yield)

    @hookimpl(wrapper=True)
    def batched_get_nowait(self, keys):
        """A hung medium serves nothing without waiting (its reads would wait: the tier says
        so at once, and the bounded calls above hang)."""
        self.calls.append("batched_get_nowait")
        got = yield
        if self.block is None:
            return got
        for obj in got or ():
            if obj is not None:
                obj.ref_down()
        return [None] * len(keys)

    @hookimpl(wrapper=True)
    def contains(self, keys, pin):
        self.calls.append("contains")
        return (yield)

    @hookimpl(wrapper=True)
    def get_layers(self, key, first_layer, num_layers):
        self.calls.append("get_layers")
        return (yield)


class Stack:
    """One worker over L1 -> posix -> resp holding ``n`` chunks of random KV (blocks ``src``)."""

    def __init__(self, tmp: Path, url: str, n: int, deadline_s: float = 0.5,
                 disk_timeout_s: float = 5.0) -> None:
        self.fx = KVFixture("LBHNC", torch.bfloat16, L=2, B=4 * n + 4)
        gen = torch.Generator().manual_seed(n)
        raw = self.fx.buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        self.hashes = [hashlib.sha256(f"{uuid.uuid4()}".encode()).digest() for _ in range(n)]
        self.src = list(range(1, 2 * n + 1))
        self.dst = list(range(2 * n + 1, 4 * n + 1))
        tiers = [{"backend": "local_cpu", "options": {"capacity": "8MiB"}},
                 {"backend": "posix", "timeout_s": disk_timeout_s,
                  "options": {"path": str(tmp / "disk")}},
                 {"backend": "resp", "name": "remote", "options": {"url": url}}]
        cfg = ConnectorConfig(chunk_size=CHUNK, log_every_load=False, async_save=False,
                              in_step_load_deadline_s=deadline_s, tiers=tiers)
        self.w = WorkerSide(cfg, Identity("m", f"LBHNC-bs{BS}", 1, 0, f"t-{uuid.uuid4().hex[:8]}"))
        self.w.register_kv_caches(self.fx.caches)
        self.w.wait_for_save(KVPlugMetadata(CHUNK, BS, [ReqMeta(
            "a", self.src, save=SaveSpec(0, n * CHUNK, 0, self.hashes))]))
        assert self.w.storage.flush(30)
        self.want = self.fx.ref_obj(self.src)
        self.fx.poison(self.dst)

    def storage(self):
        return self.w.storage

    def watch(self, tier: str, block: threading.Event | None = None) -> Calls:
        calls = Calls(block)
        self.w.storage.add_wrapper(calls, tiers=[tier])
        return calls

    def load(self, background: bool = False) -> set[int]:
        """One in-step (or background) load of every chunk into ``dst``; the load errors."""
        n = len(self.hashes)
        metadata = KVPlugMetadata(CHUNK, BS, [ReqMeta("b", self.dst, load=LoadSpec(
            0, n * CHUNK, 0, self.hashes, background=background))])
        self.w.start_load_kv(metadata)
        self.w.wait_for_save(metadata)
        if background:
            deadline = time.monotonic() + 60
            while "b" not in self.w.get_finished(set())[1]:
                assert time.monotonic() < deadline, "the background load never ended"
                time.sleep(0.01)
        return self.w.take_load_errors()

    def loaded(self, chunk: int) -> bool:
        """Whether chunk ``chunk``'s blocks hold exactly the stored bytes."""
        got = self.fx.ref_obj(self.dst[2 * chunk:2 * chunk + 2])
        return torch.equal(got, self.want[:, 2 * chunk:2 * chunk + 2])

    def close(self) -> None:
        self.w.close()


@pytest.fixture
def stack(tmp_path, redis_server):  # noqa: F811
    made: list[Stack] = []

    def make(n: int, **kw) -> Stack:
        s = Stack(tmp_path / f"s{len(made)}", redis_server.url, n, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _damage_disk_file(root: Path, index: int) -> None:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert files, "no chunk file on disk"
    f = files[index]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated: no longer a chunk


def test_a_disk_hit_that_fails_in_the_step_is_a_load_error_never_a_remote_read(stack, tmp_path):
    """The lookup pinned every chunk on the disk (a local medium: loaded in the step); one file
    is damaged before the load. Its blocks and the later ones are load errors, the earlier ones
    are loaded, and the remote tier (which holds every chunk) is never asked. Before: the read
    fell through to the remote tier on the engine thread (1.5 s with a slow remote)."""
    s = stack(3)
    s.storage().evict(nbytes=1 << 40, tiers=["local_cpu"])
    tokens, slow, local = s.w._on_lookup(Lookup(1, "b", s.hashes))
    assert (tokens, slow, local) == (3 * CHUNK, [], [0, 1, 2])  # found on the disk, pinned there
    names = sorted(p.name for p in (tmp_path / "s0" / "disk").rglob("*") if p.is_file()
                   and not p.name.startswith("."))
    order = [next(i for i, name in enumerate(names) if h.hex()[:16] in name) for h in s.hashes]
    _damage_disk_file(tmp_path / "s0" / "disk", order[1])
    remote = s.watch("remote")
    errors = s.load()
    assert remote.calls == []
    assert errors == set(s.dst[2:])  # the damaged chunk and the one after it
    assert s.loaded(0) and not s.loaded(1)


def test_the_same_chunk_loaded_in_the_background_is_read_from_the_remote_tier(stack, tmp_path):
    """The negative control: the remote tier does hold the chunk the disk lost, and a background
    load (off the step) reads it from there; every block gets the stored bytes."""
    s = stack(3)
    s.storage().evict(nbytes=1 << 40, tiers=["local_cpu"])
    s.w._on_lookup(Lookup(1, "b", s.hashes))
    for i in range(3):
        _damage_disk_file(tmp_path / "s0" / "disk", i)
    remote = s.watch("remote")
    assert s.load(background=True) == set()
    assert "batched_get" in remote.calls
    assert all(s.loaded(i) for i in range(3))


def test_a_chunk_no_lookup_of_this_rank_pinned_is_read_only_from_ram(stack):
    """TP > 1: the hit is the minimum over ranks, so a rank can be sent a key it never pinned.
    In the step it is read from RAM if RAM holds it, else it is a load error: the remote tier is
    never asked where it is or for its bytes. Before: ``contains`` over every tier, then a read
    from the remote tier, on the engine thread."""
    s = stack(2)
    s.storage().evict(nbytes=1 << 40, tiers=["local_cpu", "posix"])  # only remote holds them
    remote = s.watch("remote")
    assert s.load() == set(s.dst)  # no lookup here: nothing pinned
    assert remote.calls == []
    in_ram = stack(2)  # the same in RAM: loaded although unpinned
    assert in_ram.load() == set()
    assert in_ram.loaded(0) and in_ram.loaded(1)


def test_a_hung_disk_costs_the_step_one_allowance_not_a_timeout_per_group(stack):
    """48 chunks pinned on a disk that hangs (its reads block; a mock of a fault that cannot be
    caused here): the step's reads share one allowance, so once the first group of 16 has waited
    it out, the other two groups are misses without a call. Before: each group waited the tier's
    timeout_s, one after another (3 x 5 s here; 20 s with the defaults)."""
    s = stack(48, deadline_s=0.3, disk_timeout_s=5.0)
    s.storage().evict(nbytes=1 << 40, tiers=["local_cpu"])
    tokens, slow, local = s.w._on_lookup(Lookup(1, "b", s.hashes))
    assert tokens == 48 * CHUNK and not slow and len(local) == 48
    hang = threading.Event()
    disk = s.watch("posix", block=hang)
    remote = s.watch("remote")
    try:
        t0 = time.monotonic()
        errors = s.load()
        waited = time.monotonic() - t0
    finally:
        hang.set()
    # nothing read without waiting, then the first group of 16; the rest never called
    assert disk.calls == ["batched_get_nowait", "batched_get"]
    assert errors == set(s.dst)
    assert remote.calls == []
    stats = s.storage().stats()["posix"]
    assert stats["deadline_misses"] == 3 and stats["timeouts"] == 0
    assert waited < 4.5, f"the step waited {waited:.1f}s on a hung disk"  # a hang, not a speed
