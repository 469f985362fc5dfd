"""A vLLM-free harness that does to kvplug.gpu what vLLM's forward pass does around a connector.

The KV cache is built as vLLM 0.32 allocates it (``gpu_kv_fixture.vllm_kv_views``: one int8
buffer, one standardized ``[B, H, N, C]`` view per layer, block size 16) in the physical orders
CUDA attention backends use. :meth:`PipelineHarness.run` then plays one forward pass, layer by
layer, on a *compute stream*:

* ``next(load)`` before layer ``i`` (kvplug's ``layerwise_load``: layers ``i+1``, ``i+2`` are
  being filled on the load stream meanwhile), then the compute side reads layer ``i`` of the
  loaded blocks, exactly as attention would;
* stand-in compute (``torch.cuda._sleep``), then the compute side writes layer ``i`` of the
  running prefill's blocks (seeded random bytes through the 4-D view, as the attention kernel
  writes new KV);
* ``next(store)`` after layer ``i`` (``layerwise_store``: layer ``i`` is copied out on the store
  stream while the compute side goes on with layer ``i+1``).

On CUDA the compute stream is a real separate stream, and the ordering rests only on what
kvplug's API promises (the store stream waits for the current stream; the load makes the current
stream wait on its per-layer event). On CPU the same loop runs with plain synchronous copies.

Afterwards every byte is compared with an independent model kept on the CPU (page offsets from
the layout alone, never kvplug's views): the loaded pages against the originals that sat in
other blocks, what the compute side read, the stored memory object, and every other page of the
cache (destinations are poisoned first, so a page that was not written shows).

``chunk=``: the store and the load are split into jobs of that many blocks, slices of one
memory object each, as the connector builds one job per chunk (one copy plan for all of them).

Negative control (``drop=``): at one layer, the harness drops one wait. On CUDA, the ``next()``
of that layer runs with a *bystander* stream current, so kvplug orders that stream instead of the
compute stream: the real race, made certain by sleeping long at that layer (the compute side
before its write, the load stream before its copy; both sleeps are there in the ordinary run
too, where the waits make them harmless). On CPU the race's outcome is emulated
deterministically: the store copies layer ``k`` before the compute side has written it, or the
compute side reads layer ``k`` before the load has filled it. Either way the comparison fails at
exactly that layer.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import NamedTuple

import torch
from kvplug.gpu import PagedKV, layerwise_load, layerwise_store

from tests.support.gpu_kv_fixture import CROSS_LAYER, KVFixture, poisoned, vllm_kv_views

#: the physical orders of CUDA backends: FlashAttention, FlashInfer, MLA, and a cross-layer one
HARNESS_LAYOUTS = ["LBNHC", "LBHNC", "MLA", "BLNHC"]
#: KV dtypes as vLLM allocates them; fp8 (e4m3 and e5m2 alike) is a uint8 tensor
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
BLOCK_SIZE = 16
PATTERNS = ["contiguous", "runs", "random"]
DROPS = ("store", "load")
#: stand-in compute per layer, and the long sleep at the race layer (GPU clock cycles; the long
#: one is ~100x every copy the harness makes, so a dropped wait loses the race for certain)
COMPUTE_CYCLES = 200_000
RACE_CYCLES = 50_000_000


class Scenario(NamedTuple):
    """Three disjoint block sets (block 0, vLLM's null block, in none of them)."""

    store_ids: list[int]  # the running prefill: written by the compute side, stored layer-wise
    src_ids: list[int]  # blocks whose original pages make the load's source memory object
    dst_ids: list[int]  # where the layer-wise load puts them (poisoned before)


class Mismatch(NamedTuple):
    what: str  # "stored" (memory object), "read" (what compute saw), "kv" (the cache afterwards)
    layer: int
    block: int


def scenarios(num_blocks: int, n: int, seed: int = 0) -> dict[str, Scenario]:
    """Block ids for contiguous, runs-of-4 (shuffled) and random patterns, ``n`` blocks each."""
    if 3 * n >= num_blocks - 3 or n % 4:
        raise ValueError(f"need n % 4 == 0 and 3 * n < num_blocks - 3, got n={n}, B={num_blocks}")
    rng = random.Random(seed)
    groups = [list(range(g, g + 4)) for g in range(4, num_blocks - 3, 4)]
    rng.shuffle(groups)
    runs = [b for g in groups[: 3 * n // 4] for b in g]
    rand = rng.sample(range(1, num_blocks), 3 * n)
    cont = list(range(1, 3 * n + 1))
    out = {}
    for name, ids in (("contiguous", cont), ("runs", runs), ("random", rand)):
        store, dst, src = ids[:n], ids[n : 2 * n], ids[2 * n :]
        out[name] = Scenario(store, src, dst)
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A KV view ``[B, H, N, C]`` as bytes ``[B, H, N, C * itemsize]`` (same memory)."""
    return t.view(torch.uint8)


def page_rows(buf: torch.Tensor, layout: str, L: int, B: int) -> torch.Tensor:
    """The whole buffer as ``[layers, blocks, page bytes]``, from the layout's offsets alone."""
    flat = buf.view(torch.uint8)
    if layout in CROSS_LAYER:
        return flat.view(B, L, -1).transpose(0, 1)
    return flat.view(L, B, -1)


def _jobs(ids: list[int], obj: torch.Tensor, chunk: int | None) -> list[tuple[list[int], torch.Tensor]]:
    """One job for ``ids`` and ``obj``, or one per ``chunk`` blocks (slices of ``obj``)."""
    if not chunk:
        return [(ids, obj)]
    return [(ids[a: a + chunk], obj[:, a: a + chunk]) for a in range(0, len(ids), chunk)]


class PipelineHarness:
    """One vLLM-shaped KV cache on ``device`` and the layer loop of :meth:`run` over it."""

    def __init__(
        self,
        layout: str,
        dtype: torch.dtype,
        device: str = "cpu",
        *,
        layers: int = 4,
        blocks: int = 48,
        heads: int = 2,
        head_size: int = 8,
        seed: int = 0,
    ) -> None:
        self.layout, self.dtype, self.seed = layout, dtype, seed
        self.L, self.B = layers, blocks
        self.H = 1 if layout == "MLA" else heads
        self.C = 2 * head_size  # K and V side by side (MLA: latent + rope, any width)
        self.fx = KVFixture(layout, dtype, L=layers, B=blocks, H=self.H, N=BLOCK_SIZE, C=self.C,
                            device=device, seed=seed)
        self.kv = PagedKV.from_kv_caches(self.fx.caches)
        self.cuda = self.kv.device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.Stream(self.kv.device)
            self.bystander = torch.cuda.Stream(self.kv.device)

    # ---------------------------------------------------------------- the compute side

    @contextlib.contextmanager
    def _engine(self, bystander: bool = False) -> Iterator[None]:
        """The compute stream current (the bystander one when a wait is dropped); CPU: nothing."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.bystander if bystander else self.compute):
            yield

    def _sleep(self, cycles: int) -> None:
        if self.cuda:
            torch.cuda._sleep(cycles)

    def _writes(self, n: int) -> list[torch.Tensor]:
        """Layer i's new KV bytes for ``n`` blocks in the logical byte shape, seeded."""
        g = torch.Generator().manual_seed(self.seed + 1)
        shape = (n, *byte_view(self.fx.tensors[0]).shape[1:])
        return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for _ in range(self.L)]

    # ---------------------------------------------------------------- the run

    def run(self, sc: Scenario, drop: str | None = None, race_layer: int | None = None,
            chunk: int | None = None) -> list[Mismatch]:
        """Play one forward pass (see the module docstring); return every byte-level mismatch.

        ``drop`` ("store" or "load") removes that wait at ``race_layer`` (default: the middle
        layer); ``chunk``: jobs of that many blocks instead of one job per direction; an empty
        list means everything is byte exact.
        """
        if drop not in (None, *DROPS):
            raise ValueError(f"drop must be one of {DROPS} or None, got {drop!r}")
        k = self.L // 2 if race_layer is None else race_layer
        if not 1 <= k < self.L:
            raise ValueError(f"race_layer must be in [1, {self.L}), got {k}")
        fx, dev = self.fx, self.kv.device
        n_store = len(sc.store_ids)

        # the independent model: the cache's bytes on the CPU, changed as the run should change it
        model = fx.buf.cpu().clone()
        mviews = vllm_kv_views(model, self.layout, self.dtype, L=self.L, B=self.B, H=self.H,
                               N=BLOCK_SIZE, C=self.C)
        mtensors = list(mviews.values())
        ids = {name: torch.tensor(getattr(sc, name)) for name in sc._fields}
        want_read = [byte_view(t).index_select(0, ids["src_ids"]) for t in mtensors]
        src = fx.ref_obj(sc.src_ids)  # from the layout's offsets, not kvplug's views
        writes = self._writes(n_store)
        for layer, t in enumerate(mtensors):
            byte_view(t).index_copy_(0, ids["dst_ids"], want_read[layer])
            byte_view(t).index_copy_(0, ids["store_ids"], writes[layer])
        want = page_rows(model, self.layout, self.L, self.B)

        fx.poison(sc.dst_ids)
        out = poisoned((self.L, n_store, fx.page), pin=self.cuda)
        if self.cuda:
            src = src.pin_memory()
            writes = [w.to(dev) for w in writes]
        store_idx, dst_idx = ids["store_ids"].to(dev), ids["dst_ids"].to(dev)
        if self.cuda:  # the set-up above ran on the default stream
            self.compute.wait_stream(torch.cuda.current_stream(dev))

        def before(layer: int) -> None:  # on CUDA it runs with the load stream current
            if layer == k:
                self._sleep(RACE_CYCLES)

        seen: list[torch.Tensor] = []
        emulate = None if self.cuda else drop  # CPU: reorder instead of racing
        with self._engine():
            store = layerwise_store(self.kv, _jobs(sc.store_ids, out, chunk))
            load = layerwise_load(self.kv, _jobs(sc.dst_ids, src, chunk), before)
            for i in range(self.L):
                racy = i == k
                if racy and emulate == "load":
                    seen.append(byte_view(fx.tensors[i]).index_select(0, dst_idx))  # read before it is loaded
                with self._engine(bystander=racy and drop == "load"):
                    next(load)
                if not (racy and emulate == "load"):
                    seen.append(byte_view(fx.tensors[i]).index_select(0, dst_idx))  # attention reads layer i
                self._sleep(RACE_CYCLES if racy else COMPUTE_CYCLES)
                if racy and emulate == "store":
                    next(store)  # copied before the compute side has written the layer
                byte_view(fx.tensors[i]).index_copy_(0, store_idx, writes[i])  # the new KV of layer i
                if not (racy and emulate == "store"):
                    with self._engine(bystander=racy and drop == "store"):
                        next(store)
            load.close()
        if self.cuda:
            torch.cuda.synchronize(dev)
        return self._compare(sc, want, want_read, seen, out)

    def _compare(self, sc: Scenario, want: torch.Tensor, want_read: list[torch.Tensor],
                 seen: list[torch.Tensor], out: torch.Tensor) -> list[Mismatch]:
        bad: list[Mismatch] = []
        got = page_rows(self.fx.buf.cpu(), self.layout, self.L, self.B)
        for layer, block in (got != want).any(-1).nonzero().tolist():
            bad.append(Mismatch("kv", layer, block))
        stored = want[:, sc.store_ids]
        for layer, j in (out.cpu() != stored).any(-1).nonzero().tolist():
            bad.append(Mismatch("stored", layer, sc.store_ids[j]))
        for layer, (s, w) in enumerate(zip(seen, want_read, strict=True)):
            diff = (s.cpu() != w).flatten(1).any(-1).nonzero().flatten().tolist()
            bad.extend(Mismatch("read", layer, sc.dst_ids[j]) for j in diff)
        return bad
