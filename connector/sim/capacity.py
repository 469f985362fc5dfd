"""Invariants **I6** and **I7**, the tiers' capacities, quotas and pins whatever their policies,
as a part of :class:`.world.World` (connector/sim/README.md).

* **I6**: no tier holds more than its capacity (L1's bytes; posix's indexed bytes plus those
  reserved by writes in flight), no tenant more than its quota there; checked after every event.
  A posix directory other processes write too (``SimConfig.shared_dir``, ``neighbour``): their
  files in this view are counted as a figure, not a violation, unless ``strict_shared_i6``; the
  directory itself (its files, counted on disk) holds at most its capacity plus, per process
  writing it, the bytes it has reserved for writes in flight and one chunk (two views may pick
  the same victim: one delete frees it, the other looks again at its next write).
* **I7**: no chunk a lookup or an operator pinned is evicted for room: checked where L1 drops
  an entry and where posix unlinks victims, whatever policy chose them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvplug.chunkfile import FILE_SUFFIX

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
        indexed and reserved by writes in flight), no tenant more than its quota; a shared
        directory no more than its capacity plus its writers' slack."""
        w = self.world
        cfg = w.cfg
        if (cfg.shared_dir or cfg.neighbour) and cfg.lower == "posix" and not cfg.tier:
            self.check_shared_directory()
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

    def check_shared_directory(self) -> None:
        """I6 on the directory rank 0 shares (with every rank, ``shared_dir``, or with the
        neighbour process): the chunk files on disk, counted here and not from any view, within
        the capacity plus, per process writing it, its reserved bytes and one chunk file."""
        w = self.world
        ranks = w.workers if w.cfg.shared_dir else w.workers[:1]
        writers = [r.storage.backend("posix") for r in ranks
                   if r.storage is not None and "posix" in r.storage.tier_names]
        if w.neighbour is not None:
            writers.append(w.neighbour.backend("posix"))
        if not writers:
            return
        sizes = _chunk_file_sizes(writers[0].directory.root)
        slack = 0
        for disk in writers:
            with disk.directory.lock:
                slack += disk.directory.index.reserved
        slack += len(writers) * max(sizes, default=0)
        capacity = writers[0].capacity
        held = sum(sizes)
        if held > capacity + slack:
            raise Violation("I6", f"the shared posix directory holds {held} B in {len(sizes)} "
                                  f"files: over its capacity {capacity} plus {slack} B of its "
                                  f"{len(writers)} writers' slack")
        w.counts["shared directory capacity checks"] += 1
        if held > capacity:
            w.figures["shared directory over capacity, within its writers' slack"] += 1


def _chunk_file_sizes(root: Any) -> list[int]:
    """The sizes of the chunk files under ``root`` (one level of subdirectories), on disk."""
    sizes = []
    with os.scandir(root) as top:
        for sub in top:
            if not sub.is_dir(follow_symlinks=False):
                continue
            with os.scandir(sub.path) as files:
                sizes += [f.stat(follow_symlinks=False).st_size for f in files
                          if f.name.endswith(FILE_SUFFIX)]
    return sizes
