"""Whether a seed replays alone: its outcome (:attr:`.schedule.Outcome.digest`: every event's
trace, the violation, every count) must not depend on the seeds run before it in the same
process, on ``PYTHONHASHSEED``, or on how fast the machine runs. A long search
(:mod:`.search`) records every seed's digest; :func:`replay_check` runs a sample of them again,
each alone, in fresh interpreters with other hash seeds, and names the seeds that differ.

"Alone" is a process forked, for that one seed, from a fresh interpreter that has imported the
simulation and built what every seed shares (vLLM's config, its block hasher) but run no seed:
what ``reproduce(seed)`` in a new interpreter does, without paying for the imports per seed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

#: a group of seeds for one fresh interpreter: (seeds, each alone?, its PYTHONHASHSEED)
Group = tuple[Sequence[int], bool, str]

_MAIN = "from kvplug.connector.sim.replay import _main; _main()"
_MARK = "kvplug-sim-digests "


def _quiet() -> None:
    """As every search process: one thread for torch, load failures not logged."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)


def prepare() -> None:
    """Import the simulation and build what every seed shares, running no seed (so processes
    forked from here run each seed as a fresh interpreter would, without its start-up cost)."""
    _quiet()
    from kvplug.backends import local_cpu, posix  # noqa: F401
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: F401
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

    from . import world  # noqa: F401
    from .engine import SimConfig, _block_hasher, _fast_discovery, _vllm_config

    _fast_discovery()
    _vllm_config(SimConfig())
    _block_hasher()


def _one(args: tuple[int, frozenset[str], int, tuple[str, str]]) -> tuple[int, str]:
    from .schedule import run_seed

    seed, faults, n, tier = args
    return seed, run_seed(seed, faults, n, tier).digest


def outcomes(seeds: Iterable[int], faults: frozenset[str] = frozenset(), n: int = 40,
             tier: tuple[str, str] = (), alone: bool = False, jobs: int = 1) -> dict[int, str]:
    """Each seed's :attr:`.schedule.Outcome.digest`: run one after another in this process, or
    ``alone``: each in a process of its own forked from this one (``jobs`` at a time), which
    should have run no seed itself (see :func:`prepare`)."""
    args = [(seed, faults, n, tier) for seed in seeds]
    if not alone:
        return dict(map(_one, args))
    ctx = mp.get_context("fork")
    got: dict[int, str] = {}
    running: list[tuple[int, Any, Any]] = []
    for i, a in enumerate(args):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_alone, args=(a, send), daemon=True)
        child.start()
        send.close()
        running.append((a[0], child, receive))
        while running and (len(running) >= jobs or i == len(args) - 1):
            seed, child, receive = running.pop(0)
            try:
                got.update([receive.recv()])
            except EOFError:
                raise RuntimeError(f"seed {seed}'s process died (exit status "
                                   f"{child.exitcode})") from None
            finally:
                child.join()
    return got


def _alone(args: tuple[int, frozenset[str], int, tuple[str, str]], send: Any) -> None:
    send.send(_one(args))
    send.close()


def elsewhere(groups: Sequence[Group], faults: frozenset[str] = frozenset(), n: int = 40,
              tier: tuple[str, str] = (), timeout_s: float = 3600.0) -> list[dict[int, str]]:
    """Each group's digests from a fresh interpreter of its own (all at once), its seeds run one
    after another or each alone, under the group's ``PYTHONHASHSEED``."""
    procs = []
    for seeds, alone, hash_seed in groups:
        arg = json.dumps({"seeds": list(seeds), "alone": alone, "faults": sorted(faults),
                          "n": n, "tier": list(tier)})
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _MAIN, arg], text=True, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": hash_seed}))
    out = []
    for p in procs:
        text = p.communicate(timeout=timeout_s)[0]
        lines = [x for x in text.splitlines() if x.startswith(_MARK)]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"a replay process failed (exit status {p.returncode})")
        out.append({int(s): d for s, d in json.loads(lines[-1][len(_MARK):]).items()})
    return out


def _main() -> None:
    args = json.loads(sys.argv[1])
    prepare()
    got = outcomes(args["seeds"], frozenset(args["faults"]), args["n"], tuple(args["tier"]),
                   alone=args["alone"])
    print(_MARK + json.dumps(got), flush=True)


def replay_check(digests: dict[int, str], sample: int, jobs: int = 2,
                 faults: frozenset[str] = frozenset(), n: int = 40,
                 tier: tuple[str, str] = ()) -> tuple[list[int], list[tuple[int, str, str]]]:
    """Run ``sample`` of the seeds whose ``digests`` a search recorded (drawn with a fixed seed)
    again, each alone, on ``jobs`` fresh interpreters (``PYTHONHASHSEED`` 1001, 1002...):
    ``(the seeds replayed, [(seed, recorded, replayed)] for each that differs)``."""
    seeds = sorted(random.Random(0).sample(sorted(digests), min(sample, len(digests))))
    groups = [(seeds[i::jobs], True, str(1001 + i)) for i in range(jobs) if seeds[i::jobs]]
    again: dict[int, str] = {}
    for got in elsewhere(groups, faults, n, tier):
        again.update(got)
    return seeds, [(s, digests[s], again.get(s, "")) for s in seeds if again.get(s) != digests[s]]
