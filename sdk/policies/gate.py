"""The StorageManager's side of a tier's admission policy: uses reported, stores filtered, and
(for a policy with the optional ``admit_loaded`` hook) chunks refused earlier offered again when
a later use loads them from another tier.

A chunk a tier refused (seen once) and then used again from a faster tier never reaches the
StorageManager's ``batched_put`` again (the connector stores only what no tier holds), so for
such a policy the gate remembers recent refusals (:data:`REMEMBERED`, oldest forgotten first)
and the StorageManager asks ``admit_loaded`` when one is loaded, writing it from the loaded bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

#: Refused keys remembered per tier (a key is ~100 bytes here: ~6 MiB at most).
REMEMBERED = 65536


class AdmissionGate:
    """One tier's admission policy, as the StorageManager calls it (thread-safe)."""

    def __init__(self, policy: Any, name: str) -> None:
        self.policy = policy
        self.name = name
        self._refused: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()
        #: whether the policy writes refused chunks a later load brings (``admit_loaded``)
        self.on_load = callable(getattr(policy, "admit_loaded", None))
        self.counts = {"admission_admitted": 0, "admission_rejected": 0,
                       "admission_rejected_bytes": 0, "admission_late": 0}

    def record_use(self, keys: Sequence[Hashable]) -> None:
        self.policy.record_use(keys=list(keys))

    def admit(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> list[bool]:
        """Which of ``keys`` to store now; refusals are remembered (see the module docstring)."""
        answer = self.policy.admit(keys=list(keys), sizes=list(sizes))
        if not isinstance(answer, list) or len(answer) != len(keys):
            raise TypeError(f"admission policy of tier {self.name!r} answered {answer!r} for "
                            f"{len(keys)} keys; one bool per key is expected")
        with self._lock:
            for key, size, ok in zip(keys, sizes, answer):
                if ok:
                    self.counts["admission_admitted"] += 1
                    self._refused.pop(key, None)
                else:
                    self.counts["admission_rejected"] += 1
                    self.counts["admission_rejected_bytes"] += size
                    if self.on_load:
                        self._refused[key] = None
                        self._refused.move_to_end(key)
            while len(self._refused) > REMEMBERED:
                self._refused.popitem(last=False)
        return [bool(a) for a in answer]

    def refused(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether each key was refused by this tier and not admitted since (all False for a
        policy without ``admit_loaded``)."""
        with self._lock:
            return [k in self._refused for k in keys]

    def admit_loaded(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> list[bool]:
        """The policy's ``admit_loaded`` for refused ``keys`` just loaded elsewhere; those it
        admits are forgotten as refusals and counted as ``admission_late``."""
        answer = self.policy.admit_loaded(keys=list(keys), sizes=list(sizes))
        if not isinstance(answer, list) or len(answer) != len(keys):
            raise TypeError(f"admission policy of tier {self.name!r} answered {answer!r} for "
                            f"{len(keys)} keys in admit_loaded; one bool per key is expected")
        with self._lock:
            for key, ok in zip(keys, answer):
                if ok:
                    self._refused.pop(key, None)
                    self.counts["admission_late"] += 1
        return [bool(a) for a in answer]

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self.counts)
        extra = getattr(self.policy, "stats", None)
        if callable(extra):
            out.update({f"admission_{k}": v for k, v in (extra() or {}).items()
                        if f"admission_{k}" not in out})
        return out
