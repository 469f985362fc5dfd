"""The conformance kit itself: it fails broken backends, and its documentation lists its tests.

The broken backends are small dict stores, each with one defect a real backend has had or could
have; the kit runs against each of them in a child pytest (its own process, as a backend
package's would be; one run, a test class per store) and a test per store asserts exactly which
kit tests fail. A correct store of the same shape passes them all, so a
failure is the defect's, not the harness's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from kvplug.errors import BackendValidationError
from kvplug.hookspecs import class_contract_problems
from kvplug.plugins import load_backend_class
from kvplug.testing import BackendConformance

pytestmark = pytest.mark.timeout(600)

DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"

#: A bounded dict store that honours the contract, and two broken variants of it.
STORES = '''
import threading
from collections import OrderedDict

from kvplug.hookspecs import hookimpl


class GoodStore:
    """Keeps its own copy of each chunk; LRU by bytes; pins honoured everywhere."""

    def __init__(self, ctx):
        self.allocate = ctx.allocate
        self.capacity = int(ctx.options.get("capacity", 1 << 30))
        self.entries = OrderedDict()  # key -> (bytes copy, meta)
        self.pins = {}
        self.used = 0
        self.lock = threading.Lock()

    def lookup(self, key):
        return self.entries.get(key)

    def evictable(self, key):
        return not self.pins.get(key)

    def drop(self, key):
        data, _ = self.entries.pop(key)
        self.used -= data.numel()
        return data.numel()

    @hookimpl
    def batched_submit_put(self, keys, objs):
        for key, obj in zip(keys, objs):
            data = obj.byte_view.clone()
            with self.lock:
                if key in self.entries:
                    continue
                for old in [k for k in self.entries if self.evictable(k)]:
                    if self.used + data.numel() <= self.capacity:
                        break
                    self.drop(old)
                if self.used + data.numel() <= self.capacity:
                    self.entries[key] = (data, obj.meta)
                    self.used += data.numel()

    @hookimpl
    def get(self, key):
        with self.lock:
            found = self.lookup(key)
        if found is None:
            return None
        data, meta = found
        obj = self.allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
        if obj is not None:
            obj.byte_view.copy_(data)
        return obj

    @hookimpl
    def get_layers(self, key, first_layer, num_layers):
        with self.lock:
            found = self.lookup(key)
        if found is None:
            return None
        data, meta = found
        rows = data.view(meta.shape[0], -1)[first_layer:first_layer + num_layers]
        obj = self.allocate((num_layers, *meta.shape[1:]), meta.dtype, meta.fmt, meta.num_tokens)
        if obj is not None:
            obj.byte_view.copy_(rows.reshape(-1))
        return obj

    @hookimpl
    def contains(self, keys, pin):
        with self.lock:
            found = [k in self.entries for k in keys]
            if pin:
                for k, hit in zip(keys, found):
                    if hit:
                        self.pins[k] = self.pins.get(k, 0) + 1
            return found

    @hookimpl
    def unpin(self, keys):
        with self.lock:
            for k in keys:
                if self.pins.get(k, 0) > 1:
                    self.pins[k] -= 1
                else:
                    self.pins.pop(k, None)

    @hookimpl
    def evict(self, keys, nbytes):
        freed = 0
        with self.lock:
            if keys is not None:
                for k in keys:
                    if k in self.entries and not self.pins.get(k):
                        freed += self.drop(k)
                return freed
            for k in [k for k in self.entries if self.evictable(k)]:
                if freed >= nbytes:
                    break
                freed += self.drop(k)
        return freed

    @hookimpl
    def stats(self):
        with self.lock:
            return {"entries": len(self.entries), "bytes": self.used}


class RaisesOnMissingKey(GoodStore):
    """``get`` indexes its dict: a key it never stored raises ``KeyError`` instead of ``None``."""

    def lookup(self, key):
        return self.entries[key]


class NoByteCount(GoodStore):
    """Bounded, but ``stats()`` reports no ``bytes``: nothing can check the bound."""

    @hookimpl
    def stats(self):
        return {"entries": len(self.entries)}


class DeclaredUnbounded(NoByteCount):
    """The same, declared unbounded (as a store that bounds itself would be)."""

    unbounded = True


class WrongLayers(GoodStore):
    """``get_layers`` is off by one layer (reads from ``first_layer + 1``)."""

    @hookimpl
    def get_layers(self, key, first_layer, num_layers):
        return super().get_layers(key, first_layer + 1, num_layers)


class NoUnpin(GoodStore):
    """Pins what ``contains(pin=True)`` finds, but has no ``unpin`` hook: a pin is forever."""

    unpin = None


class PinsDoNotCount(GoodStore):
    """A second pin of a key replaces the first, so one ``unpin`` releases both."""

    @hookimpl
    def contains(self, keys, pin):
        with self.lock:
            found = [k in self.entries for k in keys]
            if pin:
                self.pins.update((k, 1) for k, hit in zip(keys, found) if hit)
            return found


class IgnoresPinsForRoom(GoodStore):
    """Honours pins when asked to drop named keys, but evicts pinned entries to make room."""

    def evictable(self, key):
        return True
'''

#: The stores the tests below run the kit against (classes of ``STORES``).
KIT_STORES = ["GoodStore", "RaisesOnMissingKey", "NoByteCount", "DeclaredUnbounded", "WrongLayers",
              "IgnoresPinsForRoom", "NoUnpin", "PinsDoNotCount"]

KIT = '''
import pytest
from kvplug.testing import BackendConformance


def kit_for(store):
    class Kit(BackendConformance):
        @pytest.fixture
        def make_tiers(self):
            return lambda capacity: [
                {"backend": "kit_stores:" + store, "options": {"capacity": capacity}}]

    return Kit


for _store in %r:
    globals()["TestKit_" + _store] = kit_for(_store)
'''


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> dict[str, dict[str, str]]:
    """The kit run once against every store of ``KIT_STORES`` in one child pytest (its own
    process, as a backend package's would be; a test class per store): ``{store: {test name:
    outcome}}``."""
    tmp_path = tmp_path_factory.mktemp("kit")
    (tmp_path / "kit_stores.py").write_text(textwrap.dedent(STORES))
    (tmp_path / "test_kit.py").write_text(textwrap.dedent(KIT) % (KIT_STORES,))
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), f"--junitxml={report}", str(tmp_path / "test_kit.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert report.exists(), proc.stdout + proc.stderr
    outcomes: dict[str, dict[str, str]] = {store: {} for store in KIT_STORES}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else
                   "skipped" if "skipped" in kinds else "passed")
        store = case.get("classname").rpartition(".TestKit_")[2]
        outcomes[store][case.get("name")] = outcome
    assert all(outcomes.values()), proc.stdout + proc.stderr
    return outcomes


def failed(outcomes: dict[str, str]) -> set[str]:
    return {name for name, outcome in outcomes.items() if outcome == "failed"}


#: Fails wherever a tier's get_layers is wrong, when python-blosc2 is installed (else skipped).
CODEC = "test_encoded_chunks_round_trip_through_a_codec"


def test_a_correct_store_passes_the_kit(kit):
    outcomes = kit["GoodStore"]
    assert not failed(outcomes), outcomes
    assert outcomes["test_get_layers_gives_each_range"] == "passed"


def test_a_get_that_raises_on_a_missing_key_fails_the_kit(kit):
    """The StorageManager turns the ``KeyError`` into a miss; the kit sees it anyway."""
    assert failed(kit["RaisesOnMissingKey"]) - {CODEC} == {
        "test_missing_key_is_none", "test_keys_never_collide", "test_batched_get_answers_like_get",
        "test_get_layers_gives_each_range"}


def test_stats_without_bytes_fails_the_capacity_test(kit):
    assert failed(kit["NoByteCount"]) == {"test_capacity_is_respected"}


def test_a_tier_declared_unbounded_needs_no_byte_count(kit):
    assert not failed(kit["DeclaredUnbounded"])


def test_a_wrong_layer_range_fails_the_kit_without_extras(kit):
    assert failed(kit["WrongLayers"]) - {CODEC} == {"test_get_layers_gives_each_range"}


def test_a_store_that_evicts_pinned_entries_for_room_fails_the_kit(kit):
    assert failed(kit["IgnoresPinsForRoom"]) == {"test_pins_hold_under_pressure"}


def test_a_store_without_unpin_fails_the_kit(kit):
    assert failed(kit["NoUnpin"]) == {
        "test_contains_prefix_and_pins", "test_pins_hold_under_pressure"}


def test_pins_that_do_not_count_fail_the_kit(kit):
    assert failed(kit["PinsDoNotCount"]) == {"test_contains_prefix_and_pins"}


def test_the_doc_lists_exactly_the_kit_tests():
    """docs/conformance.md's table of tests names every test of the kit, and no other."""
    documented = re.findall(r"^\| `(test_\w+)` \|", DOC.read_text(), flags=re.M)
    assert len(documented) == len(set(documented)), "a test is listed twice"
    kit = {name for name in dir(BackendConformance) if name.startswith("test_")}
    assert set(documented) == kit, (
        f"undocumented: {sorted(kit - set(documented))}; "
        f"documented but not in the kit: {sorted(set(documented) - kit)}")


INIT = "    def __init__(self, ctx):\n        pass\n"
BAD_CLASSES = {
    "options": ("    Options = dict\n" + INIT, "Options is <class 'dict'>, not a pydantic model"),
    "never_blocks": ("    never_blocks = 'yes'\n" + INIT, "never_blocks is 'yes'; set it to True"),
    "unbounded": ("    unbounded = 1\n" + INIT, "unbounded is 1; set it to True or False"),
    "local_medium": ("    local_medium = 'disk'\n" + INIT,
                     "local_medium is 'disk'; set it to True or False"),
    "init": ("    def __init__(self, ctx, store):\n        pass\n",
             "__init__(ctx, store) cannot be called as Backend(ctx)"),
    "no_init": ("    pass\n", "__init__() cannot be called as Backend(ctx)"),
}


@pytest.mark.parametrize("case", BAD_CLASSES)
def test_the_class_contract_is_checked_when_a_backend_loads(tmp_path, monkeypatch, case):
    """A class-level mistake fails at load, naming the backend, instead of being ignored."""
    body, message = BAD_CLASSES[case]
    hooks = "".join(f"    @hookimpl\n    def {h}(self):\n        pass\n"
                    for h in ("batched_submit_put", "get", "contains", "evict"))
    module = f"bad_class_{case}"
    (tmp_path / f"{module}.py").write_text(
        f"from kvplug.hookspecs import hookimpl\n\n\nclass Bad:\n{body}{hooks}")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendValidationError) as err:
        load_backend_class(f"{module}:Bad")
    assert f"backend '{module}:Bad'" in str(err.value)
    assert message in str(err.value)


def test_reference_backends_honour_the_class_contract():
    for name in ("local_cpu", "posix", "fsspec", "resp", "mooncake", "gds"):
        cls, _ = load_backend_class(name)
        assert class_contract_problems(cls) == [], name
