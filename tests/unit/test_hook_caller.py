"""TierHookCaller against pluggy's own call: the same results, exceptions and wrapper views.

Each scenario builds two identical plugin managers, calls one through pluggy's
``subset_hook_caller`` and the other through :class:`~kvplug.hook_caller.TierHookCaller`, and
compares what came back (a value, or an exception's type and message) and what every plugin saw,
in order.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import pluggy
import pytest
from kvplug.hook_caller import TierHookCaller
from kvplug.hookspecs import hookimpl
from kvplug.storage_manager import StorageManager
from kvplug.testing import make_key

PROJECT = "kvplug-hook-caller-test"
spec = pluggy.HookspecMarker(PROJECT)
impl = pluggy.HookimplMarker(PROJECT)


class Spec:
    @spec
    def collect(self, key, n):  # noqa: ANN001 - a test hook: every answer, as a list
        """Every implementation's answer."""

    @spec(firstresult=True)
    def first(self, key, n):  # noqa: ANN001
        """The first answer that is not None."""

    @spec(firstresult=True)
    def bare(self):
        """No arguments."""


def _answer(log: list, name: str, value: Any) -> Callable[..., Any]:
    """An implementation that logs its call and answers ``value`` (raises it if an exception)."""

    def run(*args: Any) -> Any:
        log.append((name, "called", args))
        if isinstance(value, BaseException):
            raise value
        return value

    return run


def _method(hook: str, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` as a method of hook ``hook``'s signature (no defaulted arguments: pluggy would
    pass them as keywords)."""
    if hook == "bare":
        def method(self) -> Any:  # noqa: ANN001
            return run()
    else:
        def method(self, key, n) -> Any:  # noqa: ANN001
            return run(key, n)
    method.__name__ = hook
    return method


def plugin(log: list, name: str, hooks: dict[str, Any], **opts: Any) -> object:
    """A plugin whose implementations of ``hooks`` (name -> answer) are plain ones."""
    methods = {h: impl(**opts)(_method(h, _answer(log, name, v))) for h, v in hooks.items()}
    return type(f"Plugin_{name.replace(' ', '_')}", (), methods)()


def wrapper(log: list, name: str, hooks: tuple[str, ...] = ("collect", "first"), *,
            replace: Any = None, swallow: bool = False, raise_after: BaseException | None = None,
            no_yield: bool = False, twice: bool = False, old_style: bool = False,
            **opts: Any) -> object:
    """A new-style wrapper (``old_style``: a ``hookwrapper=True`` one) that logs the arguments,
    the outcome it saw, and may replace the result, swallow an exception, raise after the call,
    not yield, or yield twice."""

    def new(key, n):  # noqa: ANN001
        log.append((name, "enter", (key, n)))
        if no_yield:
            return "never"
        try:
            got = yield
        except Exception as exc:
            log.append((name, "saw exception", repr(exc)))
            if swallow:
                return f"{name} swallowed"
            raise
        log.append((name, "saw result", got))
        if twice:
            yield
        if raise_after is not None:
            raise raise_after
        return got if replace is None else replace

    def old(key, n):  # noqa: ANN001
        log.append((name, "enter", (key, n)))
        result = yield
        log.append((name, "saw", repr(result.exception) if result.exception else
                    result.get_result()))
        if replace is not None:
            result.force_result(replace)

    body = old if old_style else new

    def method(self, key, n):  # noqa: ANN001
        return (yield from body(key, n))

    marker = impl(hookwrapper=True, **opts) if old_style else impl(wrapper=True, **opts)
    methods = {hook: marker(_method_copy(method, hook)) for hook in hooks}
    return type(f"Wrapper_{name.replace(' ', '_')}", (), methods)()


def _method_copy(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` under another name (one function object per hook: pluggy marks it)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__name__ = name
    return copy


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("value", the result)`` or ``("raised", (exception type, message))``."""
    try:
        return "value", call()
    except BaseException as exc:  # noqa: BLE001 - compared, type and message
        return "raised", (type(exc).__name__, str(exc))


def planned(caller: TierHookCaller) -> bool:
    """Whether the caller's last call ran its own plan (not pluggy's call)."""
    return caller._state[2] is not None  # noqa: SLF001 - which path the test took


def both(build: Callable[[list], tuple[list[object], list[object]]], hook: str,
         **kwargs: Any) -> tuple[tuple, tuple, TierHookCaller]:
    """``(pluggy's (outcome, log), the tier caller's (outcome, log), the tier caller)`` of one
    call of ``hook``: ``build(log)`` gives the plugins to register and those to leave out."""
    runs = []
    caller = None
    for kind in ("pluggy", "tier"):
        log: list = []
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(Spec)
        plugins, excluded = build(log)
        for p in plugins:
            pm.register(p)
        if kind == "pluggy":
            call = pm.subset_hook_caller(hook, excluded)
        else:
            call = caller = TierHookCaller(pm, hook, excluded)
        runs.append((outcome(lambda call=call: call(**kwargs)), log))
    assert caller is not None
    return runs[0], runs[1], caller


def same(build: Callable[[list], tuple[list[object], list[object]]], hook: str,
         **kwargs: Any) -> tuple:
    """Assert both calls agree, the tier caller's through its own plan; pluggy's
    ``(outcome, log)``."""
    theirs, ours, caller = both(build, hook, **kwargs)
    assert ours == theirs
    assert planned(caller)
    return theirs


def test_plain_implementations_in_pluggy_order_without_excluded_plugins():
    def build(log):
        other = plugin(log, "other tier", {"collect": "X"})
        return [plugin(log, "a", {"collect": 1}), plugin(log, "last", {"collect": 2}, trylast=True),
                plugin(log, "none", {"collect": None}), other,
                plugin(log, "first", {"collect": 3}, tryfirst=True),
                plugin(log, "b", {"collect": 4})], [other]

    (kind, value), log = same(build, "collect", key="k", n=7)
    assert (kind, value) == ("value", [3, 4, 1, 2])  # None answers left out, other tier's too
    assert ("none", "called", ("k", 7)) in log and not any(e[0] == "other tier" for e in log)


def test_firstresult_stops_at_the_first_answer():
    def build(log):
        return [plugin(log, "late", {"first": "late"}), plugin(log, "none", {"first": None}),
                plugin(log, "early", {"first": "early"}),
                plugin(log, "never", {"first": "never"}, trylast=True)], []

    (kind, value), log = same(build, "first", key="k", n=1)
    assert (kind, value) == ("value", "early")
    assert [e[0] for e in log] == ["early"]  # registered last: asked first, and answers

    def nobody(log):
        return [plugin(log, "none", {"first": None})], []

    assert same(nobody, "first", key="k", n=1)[0] == ("value", None)
    assert same(lambda log: ([plugin(log, "x", {"bare": 5})], []), "bare")[0] == ("value", 5)


def test_wrappers_see_arguments_and_result_in_order_and_may_replace_it():
    def build(log):
        return [plugin(log, "backend", {"first": "stored"}),
                wrapper(log, "inner", tryfirst=False, trylast=True),
                wrapper(log, "replacer", replace="replaced"),
                wrapper(log, "outer", tryfirst=True)], []

    (kind, value), log = same(build, "first", key="k", n=2)
    assert (kind, value) == ("value", "replaced")
    assert log == [("outer", "enter", ("k", 2)), ("replacer", "enter", ("k", 2)),
                   ("inner", "enter", ("k", 2)), ("backend", "called", ("k", 2)),
                   ("inner", "saw result", "stored"), ("replacer", "saw result", "stored"),
                   ("outer", "saw result", "replaced")]
    same(build, "collect", key="k", n=2)  # the list of a hook that is not firstresult


def test_exceptions_pass_through_wrappers_as_in_pluggy():
    def failing(log):
        return [plugin(log, "backend", {"first": OSError("disk gone")}),
                wrapper(log, "inner"), wrapper(log, "outer")], []

    (kind, (name, msg)), log = same(failing, "first", key="k", n=3)
    assert (kind, name, msg) == ("raised", "OSError", "disk gone")
    assert ("inner", "saw exception", "OSError('disk gone')") in log
    assert ("outer", "saw exception", "OSError('disk gone')") in log

    def swallowed(log):
        return [plugin(log, "backend", {"first": KeyError("x")}),
                wrapper(log, "swallower", swallow=True), wrapper(log, "outer")], []

    (kind, value), log = same(swallowed, "first", key="k", n=3)
    assert (kind, value) == ("value", "swallower swallowed")
    assert ("outer", "saw result", "swallower swallowed") in log

    def raising_wrapper(log):
        return [plugin(log, "backend", {"first": 1}),
                wrapper(log, "raiser", raise_after=ValueError("checksum")),
                wrapper(log, "outer")], []

    (kind, (name, _)), log = same(raising_wrapper, "first", key="k", n=3)
    assert (kind, name) == ("raised", "ValueError")
    assert ("outer", "saw exception", "ValueError('checksum')") in log

    def bad_wrappers(log):  # the protocol broken: pluggy's RuntimeError either way
        return [plugin(log, "backend", {"first": 1}), wrapper(log, "no yield", no_yield=True),
                wrapper(log, "outer")], []

    assert same(bad_wrappers, "first", key="k", n=3)[0][0] == "raised"

    def twice(log):
        return [plugin(log, "backend", {"first": 1}), wrapper(log, "twice", twice=True),
                wrapper(log, "outer")], []

    assert same(twice, "first", key="k", n=3)[0][0] == "raised"


def test_a_call_without_an_argument_is_pluggys_error():
    def build(log):
        return [plugin(log, "backend", {"first": 1}), wrapper(log, "w")], []

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        (kind, (name, _)), log = same(build, "first", key="k")
    assert (kind, name) == ("raised", "HookCallError") and log == []
    assert len(seen) == 2  # pluggy's warning, once per call, both times


def test_registrations_after_the_first_call_are_seen():
    log: list = []
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(Spec)
    pm.register(plugin(log, "a", {"first": None, "collect": "a"}))
    other = plugin(log, "other tier", {"first": "other"})
    caller = TierHookCaller(pm, "first", [other])
    collect = TierHookCaller(pm, "collect", [other])
    reference = pm.subset_hook_caller("collect", [other])
    assert caller(key="k", n=0) is None and collect(key="k", n=0) == ["a"]
    assert planned(caller) and planned(collect)
    pm.register(other)  # an excluded plugin, registered after the callers were made
    pm.register(plugin(log, "b", {"first": "b", "collect": "b"}))
    assert caller(key="k", n=0) == "b"
    assert collect(key="k", n=0) == reference(key="k", n=0) == ["b", "a"]
    w = wrapper(log, "late wrapper", replace="wrapped")
    pm.register(w)
    assert caller(key="k", n=0) == "wrapped" and ("late wrapper", "saw result", "b") in log
    pm.unregister(w)
    assert caller(key="k", n=0) == "b"
    assert [i.plugin_name for i in caller.get_hookimpls()] == \
        [i.plugin_name for i in pm.subset_hook_caller("first", [other]).get_hookimpls()]


def test_old_style_hookwrappers_are_pluggys_own_call():
    def build(log):
        return [plugin(log, "backend", {"first": "stored"}),
                wrapper(log, "old", ("first",), replace="forced", old_style=True),
                wrapper(log, "new")], []

    theirs, ours, caller = both(build, "first", key="k", n=4)
    assert not planned(caller)
    assert ours == theirs and ours[0] == ("value", "forced")
    assert ("old", "saw", "stored") in ours[1]

    def failing(log):
        return [plugin(log, "backend", {"first": OSError("gone")}),
                wrapper(log, "old", ("first",), old_style=True)], []

    theirs, ours, _ = both(failing, "first", key="k", n=4)
    assert ours == theirs and ours[0][0] == "raised"


def test_hook_call_monitoring_is_pluggys_own_call():
    log: list = []
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(Spec)
    pm.register(plugin(log, "a", {"first": 1}))
    caller = TierHookCaller(pm, "first")
    assert caller(key="k", n=0) == 1
    traced: list = []
    undo = pm.add_hookcall_monitoring(lambda name, impls, kw: traced.append(name),
                                      lambda outcome, name, impls, kw: traced.append("after"))
    assert caller(key="k", n=0) == 1 and traced == ["first", "after"]
    assert not planned(caller)
    undo()
    assert caller(key="k", n=0) == 1 and traced == ["first", "after"]
    assert planned(caller)


def test_storage_manager_wrappers_see_every_call_through_tier_callers():
    seen = []

    class Spy:
        @hookimpl(wrapper=True)
        def contains(self, keys, pin):  # noqa: ANN001
            answer = yield
            seen.append((len(keys), pin, list(answer)))
            return [not hit for hit in answer]  # replaced: the manager gets the wrapper's list

    with StorageManager({"tiers": [{"backend": "local_cpu", "name": "l1",
                                    "options": {"capacity": "1MiB"}}]}) as mgr:
        assert isinstance(mgr._tiers[0].hooks["contains"], TierHookCaller)  # noqa: SLF001
        assert mgr.holds("l1", [make_key(1)]) == [False]
        mgr.add_wrapper(Spy())
        assert mgr.holds("l1", [make_key(1)]) == [True]
        assert seen == [(1, False, [False])]


@pytest.mark.parametrize("hook", ["collect", "first"])
def test_repeated_calls_agree(hook):
    def build(log):
        return [plugin(log, "a", {hook: "a"}), plugin(log, "none", {hook: None}),
                wrapper(log, "w")], []

    theirs, ours, caller = both(build, hook, key="k", n=1)
    assert ours == theirs and planned(caller)
    for _ in range(3):  # the plan reused
        assert caller(key="k", n=1) == theirs[0][1]
