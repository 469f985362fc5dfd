"""The policy conformance suite: pytest tests any eviction or admission policy runs against itself.

Subclass :class:`PolicyConformance` and name the policy (an installed ``kvplug.policies`` entry
point or ``"package.module:Class"``) and, optionally, its options::

    from kvplug.testing import PolicyConformance

    class TestMyPolicy(PolicyConformance):
        policy = "my_lru_k"
        options = {"k": 2}

The class is loaded and validated as a tier's config would load it (pluggy checks every hook
against :mod:`kvplug.policyspecs`), then driven directly, so an exception fails the test. Eviction
policies are checked for what every tier relies on (victims are known entries, never one the
tier keeps, enough bytes when there are enough, forgotten once returned; the loop ends when every
entry is kept; replays are deterministic); admission policies for their answers' shape and
determinism. Each test says in its docstring what it checks.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from kvplug.policies.registry import build_policy, load_policy_class


def _for(kind: str) -> Any:
    """Marks a test as one of ``kind`` (eviction or admission) policies'."""
    def mark(fn: Any) -> Any:
        fn._policy_kind = kind
        return fn
    return mark


class PolicyConformance:
    """Tests every policy must pass. Set ``policy`` (and ``options``) in a subclass."""

    policy: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return load_policy_class(self.policy)[0].kind

    def build(self) -> Any:
        from kvplug.config import PolicyConfig

        return build_policy(self.kind, PolicyConfig(policy=self.policy, **self.options),
                            "conformance", capacity=1 << 30)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass naming its policy collects only the tests of that policy's kind (an
        eviction policy has no admission tests to skip, and the reverse)."""
        super().__init_subclass__(**kwargs)
        if not cls.policy:
            return
        kind = load_policy_class(cls.policy)[0].kind
        for name in dir(cls):
            test_kind = getattr(getattr(cls, name), "_policy_kind", None)
            if test_kind is not None and test_kind != kind:
                setattr(cls, name, None)  # not collected

    @staticmethod
    def workload(seed: int, n: int = 2000, keys: int = 200) -> list[tuple[str, int, int]]:
        """A random mix of inserts, accesses, removals and evictions over ``keys`` keys."""
        rng = random.Random(seed)
        ops = ["insert", "insert", "access", "access", "access", "remove", "victims"]
        return [(rng.choice(ops), rng.randrange(keys), rng.randrange(1, 9) * 1024)
                for _ in range(n)]

    def drive(self, policy: Any, seed: int, pinned: set[int] | None = None) -> list[Any]:
        """Run :meth:`workload` against an eviction ``policy`` while keeping the tier's own view
        (entries and sizes), checking every victim list on the way; what it answered, in order."""
        held: dict[int, int] = {}
        pinned = pinned or set()
        answers: list[Any] = []
        for op, key, size in self.workload(seed):
            if op == "insert":
                policy.insert(key=key, nbytes=size)
                held[key] = size
            elif op == "access":
                policy.access(key=key)
            elif op == "remove":
                policy.remove(key=key)
                held.pop(key, None)
            else:
                need = size * 4
                out = policy.victims(nbytes=need, evictable=lambda k: k not in pinned)
                assert isinstance(out, list), f"victims() returned {type(out).__name__}"
                assert len(set(out)) == len(out), f"victims() named an entry twice: {out}"
                unknown = [k for k in out if k not in held]
                assert not unknown, f"victims() named entries the tier does not hold: {unknown}"
                kept = [k for k in out if k in pinned]
                assert not kept, f"victims() named entries the tier keeps (pinned): {kept}"
                freed = sum(held[k] for k in out)
                free_able = sum(s for k, s in held.items() if k not in pinned)
                assert freed >= min(need, free_able), (
                    f"victims({need}) freed {freed} bytes though {free_able} were evictable")
                for k in out:
                    del held[k]
                answers.append(out)
        return answers

    # -- eviction ---------------------------------------------------------------------------------
    @_for("eviction")
    def test_victims_are_held_unpinned_and_enough(self):
        """Victims are entries the tier holds, never a pinned one, each once, and they free the
        bytes asked for whenever enough unpinned bytes are held."""
        for seed in range(5):
            self.drive(self.build(), seed, pinned=set(range(0, 200, 7)))

    @_for("eviction")
    def test_returned_victims_are_forgotten(self):
        """A victim leaves the policy: asking again never names it, unless it is inserted again."""
        policy = self.build()
        for k in range(50):
            policy.insert(key=k, nbytes=100)
        first = policy.victims(nbytes=1000, evictable=lambda k: True)
        assert first, "victims() gave nothing though 50 unpinned entries are held"
        rest = policy.victims(nbytes=50 * 100, evictable=lambda k: True)
        assert not set(first) & set(rest), f"entries evicted twice: {set(first) & set(rest)}"
        assert sorted([*first, *rest]) == list(range(50)), "every entry should leave exactly once"
        assert policy.victims(nbytes=100, evictable=lambda k: True) == []

    @_for("eviction")
    def test_everything_pinned_ends_with_no_victims(self):
        """With every entry kept by the tier, victims() ends (no endless second chances) and
        names none; the entries are still there once the pins go."""
        policy = self.build()
        for k in range(100):
            policy.insert(key=k, nbytes=10)
            policy.access(key=k)
        assert policy.victims(nbytes=1000, evictable=lambda k: False) == []
        assert len(policy.victims(nbytes=1000, evictable=lambda k: True)) == 100

    @_for("eviction")
    def test_removed_and_unknown_keys_are_harmless(self):
        """remove() and access() of unknown keys are ignored; a removed key is never a victim."""
        policy = self.build()
        policy.access(key="never-seen")
        policy.remove(key="never-seen")
        for k in range(10):
            policy.insert(key=k, nbytes=1)
        for k in range(0, 10, 2):
            policy.remove(key=k)
        assert sorted(policy.victims(nbytes=100, evictable=lambda k: True)) == [1, 3, 5, 7, 9]

    @_for("eviction")
    def test_eviction_is_deterministic(self):
        """The same calls give the same victims (the simulation replays seeds across processes)."""
        assert self.drive(self.build(), 11) == self.drive(self.build(), 11)

    # -- admission --------------------------------------------------------------------------------
    @_for("admission")
    def test_admit_answers_one_bool_per_key(self):
        """admit() answers a list of bools, one per key, in order, for any batch."""
        policy = self.build()
        keys = [f"k{i}".encode() for i in range(37)]
        policy.record_use(keys=keys[:20])
        out = policy.admit(keys=keys, sizes=[4096] * len(keys))
        assert isinstance(out, list) and len(out) == len(keys)
        assert all(isinstance(x, bool) for x in out), out
        assert policy.admit(keys=[], sizes=[]) == []

    @_for("admission")
    def test_admission_is_deterministic(self):
        """The same uses give the same answers in two instances (no per-process hash)."""
        rng = random.Random(3)
        uses = [[f"k{rng.randrange(300)}".encode() for _ in range(8)] for _ in range(500)]
        answers = []
        for _ in range(2):
            policy = self.build()
            got = []
            for batch in uses:
                batch = list(dict.fromkeys(batch))
                policy.record_use(keys=batch)
                got.append(policy.admit(keys=batch, sizes=[1] * len(batch)))
            answers.append(got)
        assert answers[0] == answers[1]

    @_for("admission")
    def test_a_key_used_often_is_admitted(self):
        """A chunk every request uses is admitted after a few uses (a policy that never admits
        anything would turn a tier off; say so with a different kind of setting)."""
        policy = self.build()
        for _ in range(16):
            policy.record_use(keys=[b"hot"])
        assert policy.admit(keys=[b"hot"], sizes=[4096]) == [True]
