"""The policy contract: pluggy hook specifications for eviction and admission policies.

What is stored where is a plugin, as backends are. A *policy* is a class. kvplug finds it through
the ``kvplug.policies`` entry-point group (or a ``"module:Class"`` path in the config), checks it
against the specs below with pluggy when it loads (a wrong argument name fails at startup with
the policy's name in the error), and builds **one instance per tier that names it**:

.. code-block:: yaml

    tiers:
      - backend: local_cpu
        options: {capacity: 4GiB}
        eviction: {policy: s3fifo}
      - backend: posix
        options: {path: /var/cache/kvplug, capacity: 200GiB}
        eviction: {policy: s3fifo, small_fraction: 0.1}
        admission: {policy: tinylfu, min_count: 2}

A policy class says which kind it is with a class attribute ``kind = "eviction"`` or ``kind =
"admission"``, may declare ``Options`` (a pydantic model derived from
``kvplug.config.BaseOptions``: every key of its config mapping but ``policy``, validated, unknown
keys an error naming them), and is constructed as ``Policy(ctx)`` with a :class:`PolicyContext`.
Its ``@hookimpl`` methods are then called directly on the instance (not through a hook relay:
an eviction policy sits on L1's hot path, a dict operation per hit). A third-party policy
package declares::

    [project.entry-points."kvplug.policies"]
    my_lru_k = "my_pkg.policies:LRUK"

and kvplug's own reference policies (``lru``, ``s3fifo``, ``always``, ``tinylfu``) are declared
exactly so in kvplug's pyproject.toml. ``kvplug.testing.PolicyConformance`` is the kit a policy
runs against itself (docs/conformance.md).

Each hook below says at its declaration whether a policy of its kind must implement it
(``@required`` or ``@optional``, the markers of :mod:`kvplug.hookspecs`); the loader reads them.

Rules for every policy:

* **Eviction policies are owned by one tier** (``ctx.eviction`` of a backend whose class sets
  ``eviction_policy = True``: ``local_cpu``, ``posix``, ``gds``) and called under that tier's
  lock: they need no lock of their own and must never block or do I/O. They order entries; the
  tier keeps the bytes, the pins and the capacity. Keys are opaque hashables the tier chooses (a
  ``CacheKey`` in L1, a packed file name in posix).
* **Admission policies are called by the StorageManager** (every tier may have one; without one a
  tier admits everything, as before policies existed), from any thread: guard your own state.
  They decide *whether* a chunk is written to a tier, never which bytes; a chunk refused by every
  tier is simply recomputed when it is needed again.
* **Never raise.** An exception from a policy is a bug in it, counted as a fault of its tier and
  logged once: from an eviction policy, the tier hook that called it fails (a miss, a dropped
  store); from an admission policy, the store goes on as it would without a policy.
* **Deterministic.** Given the same calls, a policy answers the same (hash keys with a stable
  hash, never Python's ``hash()`` of a string, which changes per process): the deterministic
  simulation (tests/sim) replays a seed in another process and compares every step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from .hookspecs import PROJECT, optional, required, required_hooks

policyspec = pluggy.HookspecMarker(PROJECT)
#: The same marker backends use; kept under a name that reads well in a policy module.
policyimpl = pluggy.HookimplMarker(PROJECT)



@dataclass
class PolicyContext:
    """What a policy's constructor receives.

    Attributes:
        tier: the name of the tier the policy serves (for its log lines and stats).
        options: the policy's config mapping without ``policy`` — an instance of the class's
            ``Options`` model when it has one (validated), else the raw dict.
        capacity: the tier's capacity in bytes when the tier has one (``None``: unbounded or
            not known) — what a policy may size its own bookkeeping by (a sketch's width).
        chunk_bytes: a typical chunk's size in bytes when known (``None`` otherwise).
        extra: anything else the host passes.
    """

    tier: str
    options: Any
    capacity: int | None = None
    chunk_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class EvictionSpec:
    """Hooks of an eviction policy: it orders one tier's entries and picks its victims.

    The tier tells the policy about every entry that comes and goes (:meth:`insert`,
    :meth:`remove`) and every use (:meth:`access`); when it needs room it asks :meth:`victims`
    and drops what it gets. The policy's view and the tier's stay equal: a key the policy
    returned as a victim is gone from it, whether or not the tier then drops it (a tier that
    keeps one inserts it again).
    """

    @required
    @policyspec
    def insert(self, key: Hashable, nbytes: int) -> None:
        """A new entry of ``nbytes`` bytes is stored under ``key`` (an entry already known is
        refreshed: its size replaced, its use counted as an :meth:`access`)."""

    @required
    @policyspec
    def access(self, key: Hashable) -> None:
        """``key`` was used (read, found by a lookup that pins it, stored again). Unknown keys
        are ignored."""

    @required
    @policyspec
    def remove(self, key: Hashable) -> None:
        """``key`` left the tier for a reason of its own (an explicit evict, a corrupt or vanished
        file, another process's eviction): forget it. Unknown keys are ignored."""

    @required
    @policyspec
    def victims(self, nbytes: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        """Entries to evict, in order, whose sizes sum to at least ``nbytes`` — or every entry
        the policy can give when that is not enough. ``evictable(key)`` is False for an entry
        the tier must keep now (pinned by a lookup, held by a reader): never return one. Each
        key returned is forgotten (as by :meth:`remove`); the tier drops it. Must end: a policy
        that reorders entries while it looks (S3-FIFO's second chances) bounds its passes."""

    @optional
    @policyspec
    def stats(self) -> dict[str, float]:
        """Counters for logs and metrics (``entries``, ``promotions``...)."""


class AdmissionSpec:
    """Hooks of an admission policy: whether a chunk is written to one tier.

    The StorageManager reports every *use* of a chunk — stored after a prefill computed it, or
    loaded for a request — through :meth:`record_use`, then asks :meth:`admit` before each store
    into the tier. A chunk the tier turned down reaches a store again only when it is computed
    again (no tier held it); a policy that also wants chunks whose later uses are served by
    another tier implements :meth:`admit_loaded`.
    """

    @required
    @policyspec
    def record_use(self, keys: Sequence[Hashable]) -> None:
        """Each of ``keys`` was used once more by a request (computed and offered for storage,
        or loaded). A key may appear in one call once."""

    @required
    @policyspec
    def admit(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> list[bool]:
        """For each key (of ``sizes[i]`` bytes), whether to store it in the tier now: one bool
        per key, same order. Cheap; no I/O."""

    @optional
    @policyspec
    def admit_loaded(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> list[bool]:
        """``keys`` this tier refused earlier were just loaded from another tier (a
        faster one held them): whether to store them here now, from the loaded bytes. Without
        this hook they are not (the StorageManager then remembers no refusals for the tier).
        Measured on the chat trace (benchmarks/bench_policies.py): writing on such loads keeps
        ~1% more hit tokens for ~20 points less of the write savings."""

    @optional
    @policyspec
    def stats(self) -> dict[str, float]:
        """Counters for logs and metrics (``admitted``, ``rejected``, ``agings``...)."""


#: The spec class of each kind.
SPECS: dict[str, type] = {"eviction": EvictionSpec, "admission": AdmissionSpec}
#: The hooks each kind must implement (derived from the ``@required`` markers; kept for callers
#: that imported it).
REQUIRED_HOOKS: dict[str, tuple[str, ...]] = {kind: required_hooks(spec)
                                              for kind, spec in SPECS.items()}
