"""``kvplug.policies.gate.AdmissionGate``: one tier's admission policy as the StorageManager calls
it. Which keys it lets through, what it counts, which refusals it remembers (only for a policy
with ``admit_loaded``, oldest forgotten first), and that a policy answering the wrong shape is an
error naming the tier. Real policies (``always``, ``tinylfu``) where one exists."""

from __future__ import annotations

import random

import pytest
from kvplug.policies import gate
from kvplug.policies.admission import AlwaysAdmit, TinyLFUAdmission
from kvplug.policies.gate import AdmissionGate
from kvplug.policyspecs import PolicyContext


def tinylfu(min_count: int = 2, on_load: bool = True) -> TinyLFUAdmission:
    return TinyLFUAdmission(PolicyContext("disk", {"min_count": min_count, "on_load": on_load,
                                                   "sample_size": 1 << 16}))


def random_keys(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(n)]


def test_admits_what_the_policy_admits_and_counts_each_answer():
    rng = random.Random(1)
    keys = random_keys(rng, 40)
    sizes = [rng.randrange(1, 1 << 20) for _ in keys]
    g = AdmissionGate(tinylfu(min_count=2), "disk")
    seen_twice = set(rng.sample(range(40), 15))
    g.record_use([keys[i] for i in range(40)])
    g.record_use([keys[i] for i in sorted(seen_twice)])
    answer = g.admit(keys, sizes)
    assert answer == [i in seen_twice for i in range(40)]
    assert all(type(a) is bool for a in answer)
    refused_bytes = sum(s for i, s in enumerate(sizes) if i not in seen_twice)
    stats = g.stats()
    assert (stats["admission_admitted"], stats["admission_rejected"],
            stats["admission_rejected_bytes"]) == (15, 25, refused_bytes)
    assert stats["admission_agings"] == 0  # the policy's own counters, prefixed


def test_refusals_are_remembered_until_admitted_for_a_policy_that_admits_loaded_chunks():
    rng = random.Random(2)
    keys = random_keys(rng, 10)
    g = AdmissionGate(tinylfu(min_count=2), "disk")
    assert g.on_load
    g.record_use(keys)
    assert g.admit(keys, [100] * 10) == [False] * 10
    assert g.refused(keys) == [True] * 10
    assert g.refused(random_keys(rng, 3)) == [False] * 3  # never offered: not a refusal
    g.record_use(keys[:4])  # a later use: four now have two uses
    assert g.admit_loaded(keys, [100] * 10) == [True] * 4 + [False] * 6
    assert g.refused(keys) == [False] * 4 + [True] * 6
    assert g.stats()["admission_late"] == 4
    g.record_use(keys[4:6])
    assert g.admit(keys[4:6], [100, 100]) == [True, True]  # admitted at store: forgotten too
    assert g.refused(keys) == [False] * 6 + [True] * 4


def test_a_policy_without_admit_loaded_remembers_no_refusal():
    """The negative control of the test above: the same refusals, nothing remembered."""
    rng = random.Random(3)
    keys = random_keys(rng, 8)
    g = AdmissionGate(tinylfu(min_count=2, on_load=False), "disk")
    assert g.on_load  # tinylfu has the hook (off by option: it answers all False)
    assert g.admit_loaded(keys, [1] * 8) == [False] * 8

    class RefuseAll:  # a third party's policy without the optional hook
        kind = "admission"

        def record_use(self, keys):
            pass

        def admit(self, keys, sizes):
            return [False] * len(keys)

    plain = AdmissionGate(RefuseAll(), "disk")
    assert not plain.on_load
    assert plain.admit(keys, [1] * 8) == [False] * 8
    assert plain.refused(keys) == [False] * 8
    assert plain.stats()["admission_rejected"] == 8


def test_the_oldest_refusal_is_forgotten_first(monkeypatch):
    monkeypatch.setattr(gate, "REMEMBERED", 5)
    rng = random.Random(4)
    keys = random_keys(rng, 8)
    g = AdmissionGate(tinylfu(min_count=15), "disk")
    for k in keys:  # refused one at a time, in order
        assert g.admit([k], [1]) == [False]
    assert g.refused(keys) == [False] * 3 + [True] * 5
    assert g.admit([keys[3]], [1]) == [False]  # refused again: the most recent now
    g.admit([keys[0]], [1])
    # keys[4] went (the oldest), not keys[3] (refused again since)
    assert g.refused(keys) == [True, False, False, True, False, True, True, True]


@pytest.mark.parametrize("answer", [[True], "yes", None, [True, False, True]])
def test_a_policy_answering_the_wrong_shape_is_an_error_naming_the_tier(answer):
    class Wrong:
        kind = "admission"

        def record_use(self, keys):
            pass

        def admit(self, keys, sizes):
            return answer

        def admit_loaded(self, keys, sizes):
            return answer

    g = AdmissionGate(Wrong(), "ssd-7")
    with pytest.raises(TypeError, match=r"tier 'ssd-7'.*2 keys; one bool per key"):
        g.admit([b"a", b"b"], [1, 2])
    with pytest.raises(TypeError, match=r"tier 'ssd-7'.*2 keys in admit_loaded"):
        g.admit_loaded([b"a", b"b"], [1, 2])
    assert g.stats()["admission_admitted"] == g.stats()["admission_rejected"] == 0


def test_an_always_policy_admits_everything_and_truthy_answers_become_bools():
    g = AdmissionGate(AlwaysAdmit(PolicyContext("ram", {})), "ram")
    keys = random_keys(random.Random(5), 6)
    assert g.admit(keys, [3] * 6) == [True] * 6
    assert g.stats() == {"admission_admitted": 6, "admission_rejected": 0,
                         "admission_rejected_bytes": 0, "admission_late": 0}

    class Ones:
        kind = "admission"

        def record_use(self, keys):
            pass

        def admit(self, keys, sizes):
            return [1, 0] * (len(keys) // 2)

    answer = AdmissionGate(Ones(), "ram").admit(keys, [3] * 6)
    assert answer == [True, False] * 3 and all(type(a) is bool for a in answer)
