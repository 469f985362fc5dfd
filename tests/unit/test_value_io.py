"""What a key-value store's ValueIO must implement, said at each primitive's declaration and
checked when it is constructed (and, for ranged reads, when its tier is)."""

from __future__ import annotations

import pytest
from kvplug.backends.common.breaker import CircuitBreaker
from kvplug.backends.common.value_io import ValueIO
from kvplug.backends.common.value_tier import ValueStoreOptions, ValueStoreTier
from kvplug.hookspecs import TierContext
from kvplug.redact import Redactor


class WholeValues(ValueIO):
    """A store of whole values: every abstract primitive, nothing a flag asks for."""

    def __init__(self, name: str = "t", breaker: CircuitBreaker | None = None) -> None:
        super().__init__(name, breaker or CircuitBreaker(name), Redactor("", {}))
        self.values: dict[str, bytes] = {}

    def _exists(self, names):
        return [n in self.values for n in names]

    def _get(self, name):
        return self.values.get(name)

    def _set_many(self, items):
        self.values.update(items)
        return [None] * len(items)

    def _delete(self, names):
        for n in names:
            self.values.pop(n, None)


def test_a_store_without_a_required_primitive_cannot_be_constructed():
    class NoDelete(ValueIO):
        _exists, _get, _set_many = WholeValues._exists, WholeValues._get, WholeValues._set_many

    with pytest.raises(TypeError, match="NoDelete.*_delete"):
        NoDelete("t", CircuitBreaker("t"), Redactor("", {}))
    assert WholeValues().exists(["a"]) == [False]  # the control: all four given, it works


def test_a_flag_without_the_primitives_it_needs_fails_at_construction_naming_them():
    class Sized(WholeValues):
        sized_reads = True

    class ReadsInto(WholeValues):
        def __init__(self) -> None:
            super().__init__()
            self.reads_into = True  # set per instance, as resp does (standalone servers only)

    with pytest.raises(TypeError, match=r"Sized does not implement _get_sized \(needed with "
                                        r"sized_reads\), _head \(needed with sized_reads\), "
                                        r"_get_range \(needed with sized_reads\)"):
        Sized()
    with pytest.raises(TypeError, match=r"ReadsInto does not implement _get_into_many \(needed "
                                        r"with reads_into\), scratch \(needed with reads_into\)"):
        ReadsInto()
    assert WholeValues().missing_primitives() == []


class WholeTier(ValueStoreTier):
    """A value tier over :class:`WholeValues` (no byte ranges)."""

    def open_io(self, ctx, breaker):
        return WholeValues(ctx.name, breaker), "memory://"


def _ctx() -> TierContext:
    return TierContext(name="whole", options=ValueStoreOptions(), allocate=lambda *a, **k: None)


def test_a_tier_whose_store_reads_no_ranges_must_turn_off_get_layers():
    with pytest.raises(TypeError, match="WholeTier implements get_layers but WholeValues reads no "
                                        "byte ranges.*set get_layers = None on WholeTier"):
        WholeTier(_ctx())

    class WholeChunks(WholeTier):
        get_layers = None

    class Ranged(WholeValues):
        def _get_range(self, name, start, end):
            return self.values.get(name, b"")[start:end] or None

    class RangedTier(WholeTier):
        def open_io(self, ctx, breaker):
            return Ranged(ctx.name, breaker), "memory://"

    for cls in (WholeChunks, RangedTier):
        tier = cls(_ctx())
        assert tier.io.ranged_reads is (cls is RangedTier)
        tier.close()
