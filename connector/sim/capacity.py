"""Invariants **I6** and **I7**, the tiers' capacities, quotas and pins whatever their policies,
as a part of :class:`.world.World` (connector/sim/README.md).

* **I6**: no tier holds more than its capacity (L1's bytes; posix's indexed bytes plus those
  reserved by writes in flight), no tenant more than its quota there; checked after every event.
  A posix directory other processes write too (``SimConfig.shared_dir``, ``neighbour``): their
  files in this view are counted as a figure, not a violation, unless ``strict_shared_i6``.
* **I7**: no chunk a lookup or an operator pinned is evicted for room: checked where L1 drops
  an entry and where posix unlinks victims, whatever policy chose them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .engine import Violation

if TYPE_CHECKING:
    from .world import World


class CapacityCheck:
    """I6 and I7 (see the module docstring). Reads from the world: each rank's tiers (L1's
    bytes, pins and quotas; posix's index, pins and quotas), the config's policies, tenants and
    sharing; counts its checks, reports the shared views over capacity as figures. No state of
    its own: it reads the tiers' own books."""

    def __init__(self, world: World) -> None:
        self.world = world

    def watch(self, rank: int, storage: Any) -> None:
        """I7: wrap where each of ``storage``'s tiers drops an entry for room (L1's ``_drop``,
        posix's unlink of victims): a victim some lookup or operator has pinned is a violation
        (kept on the world: it is raised inside kvplug)."""
        world = self.world
        eviction = world.cfg.eviction
        l1 = storage.backend("local_cpu")
        disk = storage.backend("posix") if "posix" in storage.tier_names else None
        drop = l1._drop

        def checked_drop(key: Any) -> int:
            if key in l1._pins:
                raise world.keep(Violation(
                    "I7", f"rank {rank}: L1 ({eviction}) evicted a pinned chunk {key}"))
            return drop(key)

        l1._drop = checked_drop
        for name in ("unlink_victims", "unlink_now") if disk is not None else ():
            real = getattr(disk.directory, name)

            def checked(victims: list, real: Any = real) -> int:
                pinned = [rel for rel, _ in victims if rel in disk.directory.index.pins]
                if pinned:
                    raise world.keep(Violation(
                        "I7", f"rank {rank}: posix ({eviction}) evicted pinned "
                              f"chunk file(s) {pinned}"))
                return real(victims)

            setattr(disk.directory, name, checked)

    def check(self) -> None:
        """I6: no tier holds more than its capacity (L1: bytes and pool; posix: the bytes
        indexed and reserved by writes in flight), no tenant more than its quota."""
        w = self.world
        cfg = w.cfg
        for rank, worker in enumerate(w.workers):
            st = worker.storage
            if st is None:
                continue
            l1 = st.backend("local_cpu")
            if l1._bytes > l1.capacity:
                raise Violation("I6", f"rank {rank}: L1 holds {l1._bytes} B over its capacity "
                                      f"{l1.capacity} ({cfg.eviction})")
            if "posix" not in st.tier_names:  # the value store or a backend under test
                w.counts["tier capacity checks"] += 1
                continue
            disk = st.backend("posix")
            index = disk.directory.index
            with disk.directory.lock:  # the writer thread changes these together under it
                held = index.bytes + index.reserved
                tenants = dict(index.tenants or {})
                reserved = dict(index.tenant_reserved)
            shared = (cfg.shared_dir or cfg.neighbour) and not cfg.strict_shared_i6
            if held > disk.capacity:
                if shared:  # other processes' files in this view (SimConfig.strict_shared_i6)
                    w.figures["posix views over capacity (shared directory)"] += 1
                    continue
                raise Violation("I6", f"rank {rank}: posix holds {held} B over its capacity "
                                      f"{disk.capacity} ({cfg.eviction}/{cfg.admission})")
            w.counts["tier capacity checks"] += 1
            if not cfg.tenants:
                continue
            for name, quotas, usage in (
                    ("L1", l1._quotas, l1._tenant_bytes),
                    ("posix", disk.directory.quotas,
                     {t: n + reserved.get(t, 0) for t, n in tenants.items()})):
                for tenant, n in usage.items():
                    limit = quotas.limit(tenant)
                    if limit is not None and n > limit and shared and name == "posix":
                        w.figures["posix views over a quota (shared directory)"] += 1
                    elif limit is not None and n > limit:
                        raise Violation("I6", f"rank {rank}: tenant {tenant} holds {n} B on "
                                              f"{name}, over its quota {limit}")
                w.figures[f"{name} tenants held"] += len(usage)
