"""One tier's caller of one hook: pluggy's call, with its per-call preparation done once.

pluggy's ``HookCaller.__call__`` works out on every call what changes only when a plugin is
registered or unregistered: the implementations that apply (for a tier, a subset of the hook's:
a list built and copied per call), which of them wrap the others, the names of each one's
arguments, the spec's defaults and ``firstresult``: ~3.5 µs a call through two wrappers, where a
posix read of 256 KiB from the page cache is ~20 µs of system calls and checksums.
:class:`TierHookCaller` keeps that preparation (its *plan*) and calls the implementations
directly (~1.7 µs), running the protocol of pluggy's ``_multicall`` step for step:

* every new-style wrapper (``@hookimpl(wrapper=True)``: metrics, codecs, fault injection, any
  plugin given to ``StorageManager.add_wrapper``) is started in pluggy's order (the tryfirst ones
  outermost), sees the call's arguments, then the result it yields for — or the exception, thrown
  in — and may replace either; a wrapper that does not yield, or yields twice, is pluggy's
  ``RuntimeError``;
* the implementations run in pluggy's order; a ``firstresult`` hook (as its spec declares it,
  :mod:`kvplug.hookspecs`) stops at the first answer that is not ``None`` and returns it, any other
  returns the list of answers;
* an exception leaves through every wrapper started, innermost first, and is raised to the caller
  unless one of them returns instead.

The plan is remade when the hook's registered implementations change (the hook's list, which
pluggy changes in place on every registration, compared with a copy of the one the plan was made
from: a few identity comparisons per call). What the plan does not cover is pluggy's own call,
unchanged: an old-style ``hookwrapper=True`` implementation, an implementation with keyword
arguments that have defaults, a spec missing, historic or with defaults, a call without every
argument of the spec (pluggy warns, and raises ``HookCallError`` where an implementation needs
it), and hook-call monitoring (``PluginManager.add_hookcall_monitoring``, ``enable_tracing``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator
from operator import itemgetter
from typing import Any, NoReturn

import pluggy

try:  # the function pluggy runs hook calls with when no monitoring replaced it
    from pluggy._callers import _multicall as _PLUGGY_MULTICALL
except ImportError:  # a pluggy without it: every call is pluggy's own
    _PLUGGY_MULTICALL = None

#: One implementation prepared: ``(function, how many arguments it takes (0, 1, or 2 for
#: several), the getter of its arguments from the call's keyword arguments)``.
Step = tuple[Callable[..., Any], int, Callable[[dict], Any] | None]


def _step(impl: Any) -> Step:
    names = tuple(impl.argnames)
    if not names:
        return impl.function, 0, None
    return impl.function, min(len(names), 2), itemgetter(*names)


def _raise_wrapfail(gen: Generator, msg: str) -> NoReturn:
    """pluggy's error for a wrapper that broke the protocol (the same words)."""
    co = gen.gi_code  # type: ignore[attr-defined]
    raise RuntimeError(f"wrap_controller at {co.co_name!r} {co.co_filename}:{co.co_firstlineno} "
                       f"{msg}")


class _Plan:
    """What a call of the hook needs, worked out from its implementations once."""

    __slots__ = ("wrappers", "impls", "firstresult", "needs")

    def __init__(self, wrappers: tuple[Step, ...], impls: tuple[Step, ...], firstresult: bool,
                 needs: Callable[[dict], Any] | None) -> None:
        self.wrappers = wrappers  # in call order: outermost first
        self.impls = impls  # in call order
        self.firstresult = firstresult
        #: the getter of every argument of the spec (None: it has none), whose ``KeyError``
        #: says the call is pluggy's (an implementation's arguments are some of the spec's)
        self.needs = needs


class TierHookCaller:
    """Calls hook ``name`` of ``pm`` on the implementations of every plugin but ``excluded``
    ones (the plugins registered for other tiers), as ``pm.subset_hook_caller(name, excluded)``
    would, with pluggy's per-call preparation done once (see the module's docstring).
    Thread-safe: what a call reads of the caller is one tuple, replaced whole."""

    __slots__ = ("name", "_pm", "_hook", "_impls", "_fast", "_excluded", "_state")

    def __init__(self, pm: pluggy.PluginManager, name: str, excluded: Collection[object] = ()
                 ) -> None:
        self.name = name
        self._pm = pm
        self._hook = getattr(pm.hook, name)
        #: the hook's list of implementations, which pluggy changes in place on every
        #: registration
        impls = getattr(self._hook, "_hookimpls", None)
        self._impls: list = impls if isinstance(impls, list) else []
        #: whether this pluggy is the one the plan was written for (else every call is its own)
        self._fast = (isinstance(impls, list) and _PLUGGY_MULTICALL is not None
                      and hasattr(pm, "_inner_hookexec"))
        self._excluded = set(excluded)
        #: ``(the hook's implementations the plan was made from, pluggy's call function then,
        #: the plan or None for pluggy's own call, pluggy's caller of this subset)``
        self._state: tuple[list, object, _Plan | None, Any] = self._prepare()

    def get_hookimpls(self) -> list:
        """The implementations a call runs (pluggy's order), as pluggy's caller answers it."""
        return self._state[3].get_hookimpls()

    def __repr__(self) -> str:
        return f"<TierHookCaller {self.name!r}>"

    def _prepare(self) -> tuple[list, object, _Plan | None, Any]:
        """The state for the hook's implementations now: with no plan where the call must be
        pluggy's own."""
        pluggy_caller = self._pm.subset_hook_caller(self.name, self._excluded)
        hookexec = getattr(self._pm, "_inner_hookexec", None)
        impls = self._hook.get_hookimpls()  # a copy, compared with the live list on each call
        spec = self._hook.spec
        mine = [i for i in impls if i.plugin not in self._excluded]
        if (not self._fast or hookexec is not _PLUGGY_MULTICALL or spec is None
                or self._hook.is_historic()
                or getattr(spec, "kwargdefaults", None)
                or any(i.hookwrapper or i.kwargnames for i in mine)):
            return impls, hookexec, None, pluggy_caller
        # pluggy calls its list in reverse: tryfirst wrappers, wrappers, trylast wrappers, then
        # the implementations, tryfirst first
        order = mine[::-1]
        plan = _Plan(
            wrappers=tuple(_step(i) for i in order if i.wrapper),
            impls=tuple(_step(i) for i in order if not i.wrapper),
            firstresult=bool(spec.opts.get("firstresult", False)),
            needs=itemgetter(*spec.argnames) if spec.argnames else None,
        )
        return impls, hookexec, plan, pluggy_caller

    def __call__(self, **kwargs: Any) -> Any:
        state = self._state
        if not self._fast:
            return state[3](**kwargs)
        if self._impls != state[0] or self._pm._inner_hookexec is not state[1]:
            # registrations changed (or hook-call monitoring was turned on or off)
            state = self._state = self._prepare()
        plan = state[2]
        if plan is None:
            return state[3](**kwargs)
        if plan.needs is not None:
            try:
                plan.needs(kwargs)
            except KeyError:  # pluggy warns, and fails where an implementation needs it
                return state[3](**kwargs)
        teardowns: list[Generator] = []
        exception: BaseException | None = None
        result: Any = None
        try:
            for fn, arity, get in plan.wrappers:
                gen = fn() if not arity else fn(get(kwargs)) if arity == 1 else fn(*get(kwargs))
                try:
                    next(gen)
                except StopIteration:
                    _raise_wrapfail(gen, "did not yield")
                teardowns.append(gen)
            if plan.firstresult:
                for fn, arity, get in plan.impls:
                    res = fn() if not arity else fn(get(kwargs)) if arity == 1 \
                        else fn(*get(kwargs))
                    if res is not None:
                        result = res
                        break
            else:
                result = []
                for fn, arity, get in plan.impls:
                    res = fn() if not arity else fn(get(kwargs)) if arity == 1 \
                        else fn(*get(kwargs))
                    if res is not None:
                        result.append(res)
        except BaseException as exc:  # noqa: BLE001 - thrown into the wrappers, as pluggy does
            exception = exc
        for teardown in reversed(teardowns):  # pluggy's teardown loop, step for step
            try:
                if exception is not None:
                    try:
                        teardown.throw(exception)
                    except RuntimeError as re:
                        # a StopIteration thrown into a generator comes out as RuntimeError
                        if isinstance(exception, StopIteration) and re.__cause__ is exception:
                            teardown.close()
                            continue
                        raise
                else:
                    teardown.send(result)
                teardown.close()  # a wrapper that yielded twice: finalized, then an error
            except StopIteration as si:
                result = si.value
                exception = None
                continue
            except BaseException as e:  # noqa: BLE001
                exception = e
                continue
            _raise_wrapfail(teardown, "has second yield")
        if exception is not None:
            raise exception
        return result
