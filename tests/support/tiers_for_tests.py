"""Small real backends used as extra tiers in tests (loaded by 'tests.support.tiers_for_tests:Class' paths)."""

from __future__ import annotations

import threading
import time

import torch
from kvplug.hookspecs import TierContext, hookimpl


class DictTier:
    """A lower tier that keeps a private copy of the bytes and reads into ctx.allocate memory."""

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self.data: dict = {}
        self.lock = threading.Lock()

    @hookimpl
    def batched_submit_put(self, keys, objs):
        with self.lock:
            for k, o in zip(keys, objs):
                self.data[k] = (o.byte_view.clone(), o.meta)

    @hookimpl
    def get(self, key):
        with self.lock:
            item = self.data.get(key)
        if item is None:
            return None
        raw, meta = item
        obj = self.ctx.allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is None:
            return None
        obj.byte_view.copy_(raw)
        return obj

    @hookimpl
    def contains(self, keys):
        with self.lock:
            return [k in self.data for k in keys]

    @hookimpl
    def evict(self, keys, nbytes):
        freed = 0
        with self.lock:
            for k in list(self.data if keys is None else keys):
                item = self.data.pop(k, None)
                if item is not None:
                    freed += item[0].numel()
        return freed

    @hookimpl
    def stats(self):
        with self.lock:
            return {"entries": len(self.data), "bytes": sum(v[0].numel() for v in self.data.values())}


class PutRecordingTier(DictTier):
    """A DictTier that also keeps the keys of every ``batched_submit_put`` call, in order."""

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self.put_calls: list[list] = []

    @hookimpl
    def batched_submit_put(self, keys, objs):
        with self.lock:
            self.put_calls.append(list(keys))
        super().batched_submit_put(keys, objs)


class RaisingTier(DictTier):
    """Every call fails, as a tier whose device vanished would."""

    @hookimpl
    def batched_submit_put(self, keys, objs):
        raise OSError("disk went away")

    @hookimpl
    def get(self, key):
        raise OSError("disk went away")

    @hookimpl
    def contains(self, keys):
        raise OSError("disk went away")


class StallingTier(DictTier):
    """Reads and lookups hang (an NFS mount that stopped answering) until ``release`` is set, at
    most ``stall_s`` seconds; ``entered``/``left`` count the calls that began and ended, so a test
    can show its caller came back while the tier was still stalled (order, not a duration)."""

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self.release = threading.Event()
        self.entered = self.left = 0

    def _stall(self) -> None:
        with self.lock:
            self.entered += 1
        self.release.wait(self.ctx.options.get("stall_s", 30))
        with self.lock:
            self.left += 1

    @hookimpl
    def get(self, key):
        self._stall()
        return super().get(key)

    @hookimpl
    def contains(self, keys):
        self._stall()
        return super().contains(keys)


class GatedTier(DictTier):
    """A slow (may-block) tier whose ``get`` waits for a gate, controlled from any process through
    files in ``options["gate"]``: each ``get`` creates ``entered-<n>`` and waits until ``open``
    exists (at most ``max_wait_s``, so a broken test cannot hang forever)."""

    @hookimpl
    def get(self, key):
        from pathlib import Path

        gate = Path(self.ctx.options["gate"])
        with self.lock:
            n = len(list(gate.glob("entered-*")))
            (gate / f"entered-{n}").touch()
        end = time.monotonic() + self.ctx.options.get("max_wait_s", 120)
        while not (gate / "open").exists() and time.monotonic() < end:
            time.sleep(0.005)
        return super().get(key)


class GatedPutTier(DictTier):
    """A tier whose writes wait for a gate (``options["gate"]``, a folder): each
    ``batched_submit_put`` creates ``put-<n>`` there and waits until ``open`` exists (at most
    ``max_wait_s``). Holds a save's thread mid-put, so the saves behind it stay in flight."""

    @hookimpl
    def batched_submit_put(self, keys, objs):
        from pathlib import Path

        gate = Path(self.ctx.options["gate"])
        with self.lock:
            n = len(list(gate.glob("put-*")))
            (gate / f"put-{n}").touch()
        end = time.monotonic() + self.ctx.options.get("max_wait_s", 120)
        while not (gate / "open").exists() and time.monotonic() < end:
            time.sleep(0.005)
        super().batched_submit_put(keys, objs)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class LosingTier(DictTier):
    """An in-memory tier that never blocks (loads from it run in the step) and loses the
    chunks named on demand between lookup and load: its ``get`` answers None for every key whose
    chunk hash (hex) is in the class-level set :attr:`lost`."""

    never_blocks = True
    lost: set[str] = set()

    @hookimpl
    def get(self, key):
        if key.chunk_hash.hex() in LosingTier.lost:
            return None
        return super().get(key)


class BatchTier(DictTier):
    """A DictTier with a ``batched_get`` hook that records the keys of each call and the objects
    it returned; option ``short`` makes it answer one key too few (a wrong answer the manager
    must refuse, releasing what it got)."""

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self.calls: list[list] = []
        self.handed: list = []  # every object it returned

    @hookimpl
    def batched_get(self, keys):
        with self.lock:
            self.calls.append(list(keys))
        out = [self.get(k) for k in keys]
        if self.ctx.options.get("short") and out:
            if out[0] is not None:
                out[0].ref_down()
            out = out[1:]
        self.handed += [o for o in out if o is not None]
        return out
