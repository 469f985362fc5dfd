"""Random schedules, running one seed, and shrinking a failing schedule.

A seed fixes a :class:`.world.SimConfig` and a list of events; the world applies them one by one
and checks the invariants after each, then runs to quiescence. A failing schedule is shrunk
(events removed while the same invariant still fails) to a short reproduction.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field, replace

from .controls import injected
from .engine import PRODUCTION_GEOMETRY, RANKS, SimConfig, Violation
from .manage import with_manage_events
from .world import World


def config_for(seed: int, faults: frozenset[str] = frozenset(),
               tier: tuple[str, str] = ()) -> SimConfig:
    """Seed ``seed``'s configuration (``tier``: the backend under test behind L1)."""
    rng = random.Random(seed * 7919 + 1)
    hybrid = rng.random() < 0.6
    more = random.Random(seed * 7919 + 2)  # a stream of its own: what it draws leaves rng's unchanged
    lower = "values" if more.random() < 0.35 and not tier else "posix"
    codec = "lossless" if more.random() < 0.15 and _has_lossless() else ""
    cfg = SimConfig(hybrid=hybrid, window=rng.choice((5, 6, 9)),
                    num_blocks=rng.choice((18, 22, 28) if hybrid else (13, 16, 20)),
                    max_batched=rng.choice((8, 16, 32)),
                    prefix_caching=rng.random() < 0.3,
                    async_save=rng.random() < 0.8,
                    layerwise=(not hybrid) and rng.random() < 0.3,
                    order=rng.choice(("0.32", "0.33")), faults=faults,
                    lower=lower, codec=codec, late=more.random() < 0.4, tier=tier)
    # policies and small tiers in half the seeds, drawn apart so every other
    # seed (REGRESSION_SEEDS among them) keeps the schedule and configuration it had
    pol = random.Random(seed * 104729 + 11)
    if pol.random() < 0.5:
        cfg = replace(cfg, eviction=pol.choice(policy_choices("eviction")),
                      admission=pol.choice(policy_choices("admission")),
                      small_tiers=pol.random() < 0.6,
                      tenants=pol.random() < 0.5)
    # engine variants, drawn apart too: engines that zero new blocks (and which
    # model runner: V2 zeroes before handle_preemptions), TP 1 and 4
    eng = random.Random(seed * 7919 + 4)
    if eng.random() < 0.3:
        cfg = replace(cfg, zeroing=eng.choice(("v1", "v2", "v2")))
    if eng.random() < 0.25:
        cfg = replace(cfg, async_scheduling=True)
    x = eng.random()
    if x < 0.3:
        tp = 1 if x < 0.15 else 4
        cfg = replace(cfg, tp=tp, rank_offset=eng.randrange(tp))
    if cfg.lower == "posix" and not tier:
        x = eng.random()
        cfg = replace(cfg, shared_dir=x < 0.3, neighbour=0.15 < x < 0.45)
    # disk hits loaded inside the step within a per-step budget, drawn apart too
    inline = random.Random(seed * 7919 + 36).random()
    if inline < 0.4:
        cfg = replace(cfg, inline_chunks=0 if inline < 0.15 else 1)
    # speculative decoding's last-block drop (an EAGLE/MTP drafter), drawn apart too
    more33 = random.Random(seed * 7919 + 33)
    if more33.random() < 0.25:
        cfg = replace(cfg, drop_last_block=True)
    if more33.random() < 0.35:  # the real lookup client and services, answers when scheduled
        cfg = replace(cfg, remote_lookup=True)
    return _engine_kinds(seed, cfg)


#: the policies a seed drew before the draw read the registry, in that order, a name as often
#: as its weight: while only these are installed, every seed draws what it drew then
KNOWN_POLICIES = {"eviction": ("lru", "s3fifo", "s3fifo"), "admission": ("always", "tinylfu")}


@functools.cache
def policy_choices(kind: str) -> tuple[str, ...]:
    """The ``kind`` policies (``eviction``, ``admission``) a seed draws from: every one the
    policy registry has installed (entry-point group ``kvplug.policies``); those of
    :data:`KNOWN_POLICIES` first, in their order and weights, so the seeds keep their
    schedules, then the others by name. Read once per process (``cache_clear`` to read again:
    discovery costs more than a seed's configuration)."""
    from kvplug.policies.registry import policies_of_kind

    installed = policies_of_kind(kind)
    known = KNOWN_POLICIES[kind]
    return (*(n for n in known if n in installed),
            *(n for n in installed if n not in known))


def _engine_kinds(seed: int, cfg: SimConfig) -> SimConfig:
    """The engines drawn last, from a stream of their own (the other draws are unchanged):
    pipeline parallelism's batch queue, three tiers with a remote store, production geometry,
    priority scheduling, the ``fail`` policy, speculative decoding, KV events, the workers
    through ``KVPlugConnector``."""
    rng = random.Random(seed * 7919 + 44)
    x = rng.random()
    if x < 0.12 and not cfg.async_scheduling:  # the plain Scheduler behind a batch queue
        cfg = replace(cfg, batch_queue=2 if x < 0.08 else 4)
    x = rng.random()
    if x < 0.18 and cfg.lower == "posix" and not cfg.tier:
        cfg = replace(cfg, remote=("slow", "slow", "hung", "gone")[int(x / 0.045)])
    if rng.random() < 0.06 and not cfg.shared_dir and not cfg.neighbour:  # 16/256: costly
        block_size, chunk_size = PRODUCTION_GEOMETRY
        cfg = replace(cfg, block_size=block_size, chunk_size=chunk_size, window=cfg.window * 8,
                      num_blocks=rng.choice((64, 80, 96) if cfg.hybrid else (40, 56, 80)),
                      max_batched=rng.choice((96, 160, 256)))
    if rng.random() < 0.15:
        cfg = replace(cfg, priority=True)
    if rng.random() < 0.15:
        cfg = replace(cfg, load_failure_policy="fail")
    x = rng.random()
    if x < 0.12 and not cfg.async_scheduling and cfg.batch_queue == 1 \
            and cfg.block_size < PRODUCTION_GEOMETRY[0]:  # (vLLM: none with PP)
        cfg = replace(cfg, spec_tokens=1 + int(x / 0.04))
    if rng.random() < 0.2 and cfg.batch_queue == 1:  # a PP stage's workers are not simulated
        cfg = replace(cfg, kv_events=True)
    if rng.random() < 0.3:
        cfg = replace(cfg, via_connector=True)
    return cfg


def _has_lossless() -> bool:
    import importlib.util

    return importlib.util.find_spec("blosc2") is not None


def events_for(seed: int, n: int = 40) -> list[tuple]:
    """Seed ``seed``'s events: the base kinds, then the later ones inserted from a stream of
    their own (mid-step aborts; the value store's outages and partial batches)."""
    cfg = config_for(seed)
    evs = _base_events(seed, n, cfg.block_size, cfg.chunk_size)
    more = random.Random(seed * 7919 + 3)
    out: list[tuple] = []
    for ev in evs:
        out.append(ev)
        x = more.random()
        if x < 0.05:
            out.append(("step", ("abort", more.randrange(8))))
        elif x < 0.08:
            out.append(("outage", more.randrange(RANKS), more.random() < 0.6))
        elif x < 0.10:
            out.append(("partial", more.randrange(RANKS)))
    if cfg.remote == "slow":  # a remote tier's slow spells (its calls time out), a stream
        spells = random.Random(seed * 7919 + 45)  # of their own
        slow: list[tuple] = []
        for ev in out:
            slow.append(ev)
            if spells.random() < 0.1:
                slow.append(("remote", spells.randrange(RANKS), spells.random() < 0.6))
        out = slow
    if _loads_disk_hits_in_step(cfg):
        out = _with_hangs(seed, out)
    if cfg.neighbour:  # another process on rank 0's directory (SimConfig)
        neighbour_rng = random.Random(seed * 7919 + 5)
        with_neighbour: list[tuple] = []
        for ev in out:
            with_neighbour.append(ev)
            if neighbour_rng.random() < 0.12:
                with_neighbour.append(("neighbour", neighbour_rng.choice(("store", "store", "evict")),
                                       neighbour_rng.randrange(32)))
        out = with_neighbour
    return with_manage_events(seed, out)  # an operator's clears and pins (a stream of their own)


def _loads_disk_hits_in_step(cfg: SimConfig) -> bool:
    """Whether ``cfg``'s engine loads disk hits inside the step: posix behind L1, one KV cache
    group, no batch queue, an inline budget."""
    return (not cfg.hybrid and not cfg.async_scheduling and cfg.batch_queue == 1
            and cfg.lower == "posix" and not cfg.tier and cfg.inline_chunks != 0)


def _with_hangs(seed: int, events: list[tuple]) -> list[tuple]:
    """In half the engines that load disk hits inside the step (a stream of its own, whose
    first draw leaves the suite's regression seeds out), after some steps: a rank's L1 emptied
    and a request for the last prefix seen (that rank's hits come from disk, inside the step),
    and that rank's disk hanging for the step, between the lookups and the loads (an in-step
    read of a hung medium)."""
    rng = random.Random(seed * 7919 + 47)
    if rng.random() >= 0.5:
        return events
    out: list[tuple] = []
    prefix: tuple[int, ...] = ()
    for ev in events:
        out.append(ev)
        if ev[0] == "arrive":
            prefix = ev[1]
        if ev[0] == "step" and prefix and rng.random() < 0.4:
            rank = rng.randrange(RANKS)
            out += [("evict", rank, "local_cpu", None),
                    ("arrive", prefix, (rng.randrange(3, 1000),), 2),
                    ("step", ("gate", rank, True)), ("gate", rank, False)]
    return out


def _base_events(seed: int, n: int, block_size: int, chunk_size: int) -> list[tuple]:
    rng = random.Random(seed)
    # production geometry's prompts: a chunk, a chunk and some blocks, two chunks but two blocks
    # (within the model's 512 tokens)
    sizes = (chunk_size, 2 * chunk_size, 3 * chunk_size, 5) if chunk_size < PRODUCTION_GEOMETRY[1] else \
        (chunk_size, chunk_size + 5 * block_size + 3, 2 * chunk_size - 2 * block_size, 5)
    prefixes = [tuple(rng.randrange(3, 1000) for _ in range(rng.choice(sizes)))
                for _ in range(3)]
    evs: list[tuple] = []
    for _ in range(n):
        x = rng.random()
        if x < 0.2:
            suffix = tuple(rng.randrange(3, 1000) for _ in range(rng.choice((0, 1, 3, 4, 8, 11))))
            evs.append(("arrive", rng.choice(prefixes), suffix, rng.choice((1, 2, 5, 9))))
        elif x < 0.5:
            y = rng.random()
            if y < 0.12:
                mid: tuple | None = ("lose", rng.randrange(RANKS), rng.randrange(16))
            elif y < 0.2:
                mid = ("task", rng.randrange(8))
            elif y < 0.25:
                mid = ("evict", rng.randrange(RANKS), "local_cpu", rng.randrange(16))
            else:
                mid = None
            evs.append(("step", mid) if mid else ("step",))
        elif x < 0.65:
            evs.append(("task", rng.randrange(8)))
        elif x < 0.72:
            evs.append(("abort", rng.randrange(8)))
        elif x < 0.84:
            evs.append(("evict", rng.randrange(RANKS),
                        rng.choice(("local_cpu", "local_cpu", "all")), rng.randrange(16)))
        elif x < 0.9:
            evs.append((rng.choice(("corrupt", "lose")), rng.randrange(RANKS), rng.randrange(16)))
        elif x < 0.96:
            evs.append(("gate", rng.randrange(RANKS), rng.random() < 0.6))
        elif x < 0.98:
            evs.append(("settle", rng.random() < 0.5))
        else:
            evs.append(("reset",))
    return evs


@dataclass
class Outcome:
    seed: int
    events: int
    violation: Violation | None = None
    at: int = -1  # index of the event that failed (len(events): at quiescence)
    schedule: list[tuple] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # what it exercised (World.counts)
    trace: list[str] = field(default_factory=list)  # a digest after every event (World.trace)

    @property
    def digest(self) -> str:
        """The whole run in one digest (the trace's last, which folds in every event, the end,
        the violation and every count): what a replay of the seed must give again."""
        return self.trace[-1] if self.trace else ""


def run(cfg: SimConfig, events: list[tuple]) -> Outcome:
    """Apply ``events`` then quiesce; the first violation (or crash) ends the run."""
    with injected(cfg.faults):
        return _run(cfg, events)


def _run(cfg: SimConfig, events: list[tuple]) -> Outcome:
    w = World(cfg)
    out = Outcome(-1, 0, schedule=list(events))
    try:
        for i, ev in enumerate(events):
            out.at = i
            w.apply(ev)
            out.events += 1
        out.at = len(events)
        w.quiesce()
        out.at = -1
    except Violation as v:
        out.violation = v
    finally:
        out.events = w.n_events
        w.close()
        out.counts = dict(w.counts)
        out.counts.update(w.figures)
        w.note("end", out.at, str(out.violation), sorted(out.counts.items()))
        out.trace = w.trace
    return out


def run_seed(seed: int, faults: frozenset[str] = frozenset(), n: int = 40,
             tier: tuple[str, str] = ()) -> Outcome:
    out = run(config_for(seed, faults, tier), events_for(seed, n))
    out.seed = seed
    return out


def shrink(cfg: SimConfig, events: list[tuple], inv: str, budget: int = 300) -> list[tuple]:
    """A shorter schedule that still fails ``inv`` (greedy removal of runs, then of single
    events; at most ``budget`` runs)."""
    cur = list(events)
    tries = 0
    chunk = max(1, len(cur) // 2)
    while chunk >= 1 and tries < budget:
        i, changed = 0, False
        while i < len(cur) and tries < budget:
            cand = cur[:i] + cur[i + chunk:]
            tries += 1
            o = run(cfg, cand)
            if o.violation is not None and o.violation.inv == inv:
                cur, changed = cand, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return cur


def describe(seed: int, cfg: SimConfig, events: list[tuple], v: Violation | None) -> str:
    lines = [f"seed {seed}: {v}" if v else f"seed {seed}: ok", f"config {cfg}"]
    lines += [f"  {i:3d} {ev}" for i, ev in enumerate(events)]
    return "\n".join(lines)


def reproduce(seed: int, faults: frozenset[str] = frozenset(), budget: int = 300,
              tier: tuple[str, str] = ()) -> str:
    """Run ``seed``; if it fails, the shrunk schedule and its violation, printable."""
    cfg = config_for(seed, faults, tier)
    out = run(cfg, events_for(seed))
    if out.violation is None:
        return describe(seed, cfg, [], None)
    small = shrink(cfg, out.schedule, out.violation.inv, budget)
    again = run(cfg, small)
    return describe(seed, replace(cfg), small, again.violation)
