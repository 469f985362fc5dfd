"""Discovery through real distributions on sys.path declaring kvplug.backends entry points."""

from __future__ import annotations

import textwrap
import warnings

import pytest
from kvplug.errors import (
    BackendConflictError,
    BackendContractWarning,
    BackendLoadError,
    BackendNotFoundError,
    BackendValidationError,
)
from kvplug.plugins import discover_backends, load_backend_class
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

GOOD = '''
from kvplug.hookspecs import hookimpl

class {cls}:
    def __init__(self, ctx):
        self.ctx, self.items = ctx, {{}}

    @hookimpl
    def batched_submit_put(self, keys, objs):
        for k, o in zip(keys, objs):
            self.items[k] = o.ref_up()

    @hookimpl
    def {get_signature}:
        obj = self.items.get(key)
        return None if obj is None else obj.ref_up()

    @hookimpl
    def contains(self, keys, pin):
        return [k in self.items for k in keys]

    @hookimpl
    def evict(self, keys, nbytes):
        return 0

    @hookimpl
    def close(self):
        for o in self.items.values():
            o.ref_down()
'''


def make_dist(site, dist: str, module: str, entry: str, body: str, version: str = "1.2.3") -> None:
    """Write an installed distribution (module + dist-info with entry points) into ``site``."""
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kvplug.backends]\n{entry}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_reference_backends_are_declared_like_third_party_ones():
    found = discover_backends()
    assert {"local_cpu", "posix", "gds", "fsspec"} <= set(found)
    assert found["local_cpu"].package == "kvplug"


@pytest.mark.filterwarnings("ignore::kvplug.errors.BackendContractWarning")  # ignores pin
def test_third_party_backend_is_discovered_validated_and_used(site):
    make_dist(site, "kvplug-good", "kvplug_good", "goodtier = kvplug_good:Good",
              GOOD.format(cls="Good", get_signature="get(self, key)"))
    info = discover_backends()["goodtier"]
    assert (info.package, info.version, info.target) == ("kvplug-good", "1.2.3", "kvplug_good:Good")
    mgr = StorageManager({"tiers": [{"backend": "goodtier"}]})
    obj = fill_random(mgr)
    mgr.batched_put([make_key(0)], [obj])
    got = mgr.get(make_key(0))
    assert got is obj
    got.ref_down()
    obj.ref_down()
    mgr.close()


def test_wrongly_named_hook_argument_is_rejected_with_names(site):
    make_dist(site, "kvplug-typo", "kvplug_typo", "typotier = kvplug_typo:Typo",
              GOOD.format(cls="Typo", get_signature="get(self, keyy)"))
    with pytest.raises(BackendValidationError) as err:
        load_backend_class("typotier")
    msg = str(err.value)
    assert "'typotier'" in msg and "kvplug-typo" in msg and "keyy" in msg


def test_missing_required_hook_is_rejected(site):
    make_dist(site, "kvplug-lazy", "kvplug_lazy", "lazytier = kvplug_lazy:Lazy",
              "class Lazy:\n    def __init__(self, ctx):\n        pass\n")
    with pytest.raises(BackendValidationError, match="'lazytier' from package kvplug-lazy.*get"):
        load_backend_class("lazytier")


def test_required_hooks_are_derived_from_the_marker_at_each_declaration():
    """Every hook says required or optional at its spec; ``REQUIRED_HOOKS`` (kept for callers
    that import it) and the hooks a tier is called through are read from those markers, and a
    spec hook declared neither way fails loudly."""
    from kvplug.hookspecs import PROJECT, REQUIRED_HOOKS, BackendSpec, hook_needs, hookspec, required_hooks
    from kvplug.tier_setup import HOOKS

    needs = hook_needs(BackendSpec)
    declared = [n for n in vars(BackendSpec) if hasattr(getattr(BackendSpec, n), f"{PROJECT}_spec")]
    assert list(needs) == declared and len(declared) == 18
    assert REQUIRED_HOOKS == required_hooks(BackendSpec) == (
        "batched_submit_put", "get", "contains", "evict")
    assert needs["unpin"].when == ("contains", "pin") and not needs["allocate"].always
    assert HOOKS == tuple(declared)

    class Unsaid:
        @hookspec(firstresult=True)
        def lookup(self, key):
            """Declared without saying whether a plugin needs it."""

    with pytest.raises(TypeError, match="Unsaid.lookup is declared neither"):
        hook_needs(Unsaid)


def test_a_pinning_contains_without_unpin_loads_with_a_warning_naming_the_class_and_fix(site):
    """``contains`` taking ``pin`` asks for ``unpin`` (else a pin is never released); such a class
    still loads (one that ignores ``pin`` works), with a warning that says what to do. A class
    that leaves ``pin`` out, or implements ``unpin``, loads without one."""
    make_dist(site, "kvplug-pins", "kvplug_pins", "pinstier = kvplug_pins:Pins",
              GOOD.format(cls="Pins", get_signature="get(self, key)"))
    with pytest.warns(BackendContractWarning) as caught:
        load_backend_class("pinstier")
    msg = str(caught[0].message)
    assert "'pinstier'" in msg and "kvplug_pins.Pins" in msg
    assert "contains takes 'pin' but it implements no unpin" in msg
    assert "add an @hookimpl unpin, or drop 'pin' from contains's arguments" in msg

    no_pin = GOOD.format(cls="NoPin", get_signature="get(self, key)").replace(
        "def contains(self, keys, pin):", "def contains(self, keys):")
    unpins = GOOD.format(cls="Unpins", get_signature="get(self, key)") + (
        "\n    @hookimpl\n    def unpin(self, keys):\n        pass\n")
    make_dist(site, "kvplug-nopin", "kvplug_nopin", "nopintier = kvplug_nopin:NoPin", no_pin)
    make_dist(site, "kvplug-unpins", "kvplug_unpins", "unpinstier = kvplug_unpins:Unpins", unpins)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendContractWarning)
        assert load_backend_class("nopintier")[0].__name__ == "NoPin"
        assert load_backend_class("unpinstier")[0].__name__ == "Unpins"


@pytest.mark.filterwarnings("ignore::kvplug.errors.BackendContractWarning")  # ignores pin
def test_a_hook_set_to_none_is_not_implemented_and_a_required_one_is_refused(site):
    """The opt-out by name (``get_layers = None`` in mooncake): the hook is then implemented
    nowhere (loader, StorageManager, conformance kit); a required hook cannot be turned off."""
    from kvplug.testing.conformance import implements

    body = GOOD.format(cls="Base", get_signature="get(self, key)") + textwrap.dedent("""
        class Quiet(Base):
            close = None

        class NoGet(Base):
            get = None
        """)
    make_dist(site, "kvplug-optout", "kvplug_optout", "quiettier = kvplug_optout:Quiet", body)
    with StorageManager({"tiers": [{"backend": "quiettier"}]}) as mgr:
        assert not mgr.implements("quiettier", "close") and not implements(mgr.backend(0), "close")
        assert mgr.implements("quiettier", "evict") and implements(mgr.backend(0), "evict")
    with pytest.raises(BackendValidationError,
                       match="'kvplug_optout:NoGet'.*get = None turns off a required hook"):
        load_backend_class("kvplug_optout:NoGet")


def test_unknown_hook_is_rejected(site):
    body = GOOD.format(cls="Extra", get_signature="get(self, key)") + (
        "\n    @hookimpl\n    def gett(self, key):\n        return None\n"
    )
    make_dist(site, "kvplug-extra", "kvplug_extra", "extratier = kvplug_extra:Extra", body)
    with pytest.raises(BackendValidationError, match="unknown hook 'gett'"):
        load_backend_class("extratier")


def test_import_failure_names_backend_and_package(site):
    make_dist(site, "kvplug-broken", "kvplug_broken", "brokentier = kvplug_broken:Broken",
              "import not_a_real_module_xyz\n")
    with pytest.raises(BackendLoadError, match="'brokentier' from package kvplug-broken.*not_a_real"):
        StorageManager({"tiers": [{"backend": "brokentier"}]})


def test_unknown_and_duplicate_names(site):
    with pytest.raises(BackendNotFoundError, match="'nosuch' is not installed; installed backends:.*local_cpu"):
        load_backend_class("nosuch")
    make_dist(site, "kvplug-dup-a", "dup_a", "duptier = dup_a:A", GOOD.format(cls="A", get_signature="get(self, key)"))
    make_dist(site, "kvplug-dup-b", "dup_b", "duptier = dup_b:B", GOOD.format(cls="B", get_signature="get(self, key)"))
    with pytest.raises(BackendConflictError, match="'duptier' is declared by two packages"):
        discover_backends()


def test_allow_list_environment_variable(site, monkeypatch):
    monkeypatch.setenv("KVPLUG_LOAD_BACKENDS", "local_cpu")
    assert set(discover_backends()) == {"local_cpu"}
