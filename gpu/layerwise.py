"""Layer-wise page transfer: one layer per step, overlapping the engine's forward pass.

Both functions validate every job when called and return a generator that yields exactly
``kv.num_layers`` times (the layer index). The jobs are the same :class:`PageJob` s as for
``gather_many`` / ``scatter_many``, and the memory objects they fill or read are byte-identical to
the bulk ones. A load may fill its sources just in time: ``before(i)`` runs right before layer
``i``'s copies are queued (e.g. to read that layer from a tier) and names the jobs to leave out
from layer ``i`` on (their source failed). Every step moves one layer of every job with a fixed
number of torch calls (one :class:`~.copy_plan.CopyPlan` per call; a dropped job makes a plan
without it, so its blocks are never written from then on).

Synchronisation contract on CUDA (on CPU every step is a plain synchronous copy, so each point
below holds trivially):

Store (``layerwise_store``; the engine calls ``next()`` after layer ``i`` is computed):

* Step ``i`` makes the store stream wait for the engine's current stream (so layer ``i``'s
  freshly written KV is what is copied), queues the copies of layer ``i`` of every job into
  ``out[i]`` and records an event; it returns without waiting.
* The last step (``i = num_layers - 1``) returns only when every copy is complete: then ``out``
  may be read or handed to storage. With ``wait=False`` (asynchronous saves) it records an event
  instead (the generator's ``event``) and returns at once; ``out`` may be read once it completed.
* Until the last step has returned the engine must not overwrite the stored blocks (of any layer
  already stepped) on any stream, and the caller must not read ``out``. vLLM satisfies this: the
  blocks of a running request are only rewritten after the forward pass that stores them.
* Closing the generator early (``close()``, an exception, garbage collection) waits for the
  copies already queued, so ``out`` can then be freed safely.

Load (``layerwise_load``; the engine calls ``next()`` before layer ``i`` reads its KV):

* The call itself makes the load stream wait for the engine's current stream (earlier work on
  the destination blocks, e.g. zeroing, finishes first) and queues layers 0 and 1 (primed two
  layers ahead). Step ``i`` queues layer ``i + 2`` and makes the engine's current stream wait on
  layer ``i``'s event, then returns without blocking the host: every kernel the engine queues on
  its current stream after the ``i``-th ``next()`` sees layer ``i`` in place. Work on another
  stream must wait on the current stream itself.
* ``src`` must stay alive and unchanged until the generator is exhausted (the ``next()`` after
  the last yield raises ``StopIteration``) or closed; both wait for every queued copy. A
  generator that is never stepped must still be closed before ``src`` is reused.
* The destination blocks must not be read before their layer's step, nor written by the engine
  until the generator is exhausted or closed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator

import torch

from .copy_plan import CopyPlan, plan_copies
from .page_views import PagedKV
from .transfer import Jobs

__all__ = ["LayerSteps", "layerwise_load", "layerwise_store"]

#: How many layers a load keeps queued ahead of the one the engine waits for.
PRIME_AHEAD = 2


class LayerSteps(Generator[int, None, None]):
    """A generator of layer indices whose steps run ``step(i)`` and which always cleans up.

    Unlike a ``def``-generator it can do work at creation (validation, priming) and its
    ``close()`` runs ``finish`` even when it was never started.
    """

    def __init__(
        self, num_layers: int, step: Callable[[int], None], finish: Callable[[], None]
    ) -> None:
        self._num_layers = num_layers
        self._step = step
        self._finish = finish
        self._next = 0
        self._done = False
        #: ``layerwise_store(..., wait=False)``: completes with every copy (after the last step)
        self.event: torch.cuda.Event | None = None

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._finish()

    def send(self, value: None) -> int:
        """Run the next layer's step and return its index; StopIteration after the last."""
        if value is not None:
            raise TypeError("layer steps take no sent value")
        if self._done or self._next >= self._num_layers:
            self._close()
            raise StopIteration
        layer = self._next
        try:
            self._step(layer)
        except BaseException:
            self._close()
            raise
        self._next += 1
        return layer

    def throw(self, typ=None, val=None, tb=None):  # type: ignore[override]
        """Close (waiting for queued copies) and raise the given exception."""
        self._close()
        if val is None:
            val = typ() if isinstance(typ, type) else typ
        raise val.with_traceback(tb) if tb is not None else val

    def close(self) -> None:
        """Wait for every queued copy; the generator is then exhausted."""
        self._close()

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


#: ``before(layer)`` of a load: fill layer ``layer`` of the sources; returns the indices of jobs
#: to leave out from this layer on (empty or ``None`` when all is well).
BeforeLayer = Callable[[int], Collection[int] | None]


def layerwise_store(kv: PagedKV, jobs: Jobs, wait: bool = True) -> LayerSteps:
    """Steps that copy layer ``i`` of every ``(block_ids, out)`` job into ``out[i]``.

    Yields ``kv.num_layers`` times; the last ``next()`` returns once every copy is complete, or,
    with ``wait=False`` on CUDA, at once, leaving the generator's ``event`` to complete with them
    (no host synchronisation in the engine step).
    """
    plan = plan_copies(kv, jobs, to_engine=False)
    if kv.device.type != "cuda":
        return LayerSteps(kv.num_layers, plan.copy_layer, lambda: None)
    stream = kv.stream("store")
    copier = kv.stream("store-copy")  # staged jobs' PCIe copies, beside the next index kernel
    last = kv.num_layers - 1
    steps: LayerSteps

    def step(layer: int) -> None:
        stream.wait_stream(torch.cuda.current_stream(kv.device))
        with torch.cuda.stream(stream):
            plan.copy_layer(layer, copier)
        if layer != last:
            return
        stream.wait_stream(copier)  # the store's completion covers both streams
        if wait:
            stream.synchronize()
        else:
            steps.event = torch.cuda.Event()
            steps.event.record(stream)

    def finish() -> None:  # closed early (or never stepped): wait for what is queued
        if steps.event is None:
            copier.synchronize()
            stream.synchronize()

    steps = LayerSteps(kv.num_layers, step, finish)
    return steps


def layerwise_load(
    kv: PagedKV, jobs: Jobs, before: BeforeLayer | None = None
) -> Generator[int, None, None]:
    """Steps after whose ``i``-th ``next()`` layer ``i`` of every ``(block_ids, src)`` job is in
    place (on CUDA: for work the engine queues on its current stream afterwards).

    Yields ``kv.num_layers`` times. On CUDA, copies are queued from the call on, two layers ahead.
    """
    every = plan_copies(kv, jobs, to_engine=True)
    plan: CopyPlan = every
    dropped: set[int] = set()

    copier = kv.stream("load-copy") if kv.device.type == "cuda" else None

    def copy(layer: int) -> None:
        nonlocal plan
        if before is not None:
            failed = set(before(layer) or ()) - dropped
            if failed:  # a plan without them: their blocks are never written from here on
                dropped.update(failed)
                plan = every.without(dropped)
        plan.copy_layer(layer, copier)

    if kv.device.type != "cuda":
        return LayerSteps(kv.num_layers, copy, lambda: None)

    stream = kv.stream("load")
    events: list[torch.cuda.Event] = []

    def submit(layer: int) -> None:
        with torch.cuda.stream(stream):
            copy(layer)
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)

    stream.wait_stream(torch.cuda.current_stream(kv.device))
    for layer in range(min(PRIME_AHEAD, kv.num_layers)):
        submit(layer)

    def step(layer: int) -> None:
        if layer + PRIME_AHEAD < kv.num_layers:
            submit(layer + PRIME_AHEAD)
        torch.cuda.current_stream(kv.device).wait_event(events[layer])

    def finish() -> None:
        copier.synchronize()
        stream.synchronize()

    return LayerSteps(kv.num_layers, step, finish)
