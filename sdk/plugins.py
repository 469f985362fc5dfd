"""Backend discovery: entry points in the ``kvplug.backends`` group, validated against the specs.

The same machinery finds codecs (group ``kvplug.codecs``, :mod:`kvplug.codecs.registry`):
:func:`discover_entry_points` and :meth:`BackendInfo.load` serve every plugin kind.

Backends load lazily — only the ones a config names (and all of them for ``kvplug backends``).
``KVPLUG_LOAD_BACKENDS=name1,name2`` restricts discovery to those names (like pytest's
``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), so a stray installed package cannot break a deployment.
An unknown name, two packages declaring one name, an import failure or a hook that fails
validation is an error naming the backend and its package; nothing is skipped silently.
"""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

import pluggy

from .errors import (
    BackendConflictError,
    BackendContractWarning,
    BackendLoadError,
    BackendNotFoundError,
    BackendValidationError,
)
from .hookspecs import PROJECT, BackendSpec, class_contract_problems, missing_hooks, unmet_needs

ENTRY_POINT_GROUP = "kvplug.backends"


@dataclass(frozen=True)
class BackendInfo:
    """One declared plugin (a backend, a codec): its name, ``module:attr`` target and the
    distribution declaring it."""

    name: str
    target: str
    package: str
    version: str
    kind: str = "backend"

    def load(self) -> type:
        return _import_target(self.target, self.name, self.package, self.kind)


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown package>", "?"
    return dist.metadata["Name"], dist.version


def discover_backends() -> dict[str, BackendInfo]:
    """Every backend declared by an installed package (without importing any of them)."""
    return discover_entry_points(ENTRY_POINT_GROUP, "backend", "KVPLUG_LOAD_BACKENDS",
                                 "select one explicitly with backend: 'module:Class' in the tier "
                                 "config")


def discover_entry_points(group: str, kind: str, allow_env: str, hint: str) -> dict[str, BackendInfo]:
    """Every ``kind`` declared in entry-point ``group`` by an installed package (nothing is
    imported). ``$allow_env`` (comma-separated names) restricts the result to those names; two
    packages declaring one name is a :class:`BackendConflictError` ending with ``hint``."""
    allow = {n.strip() for n in os.environ.get(allow_env, "").split(",") if n.strip()}
    found: dict[str, BackendInfo] = {}
    for ep in entry_points(group=group):
        if allow and ep.name not in allow:
            continue
        package, version = _dist_of(ep)
        info = BackendInfo(ep.name, ep.value, package, version, kind)
        prior = found.get(ep.name)
        if prior is not None and (prior.package, prior.target) != (package, ep.value):
            raise BackendConflictError(
                f"{kind} name {ep.name!r} is declared by two packages: {prior.package} "
                f"({prior.target}) and {package} ({ep.value}); uninstall one, or {hint}"
            )
        found[ep.name] = info
    return found


#: Module paths of kvplug's own classes that moved; a config naming an old path keeps working
#: with a :class:`DeprecationWarning` that names the new one.
MOVED_PATHS = {
    "kvplug.backends.fsspec_remote:FsspecBackend": "kvplug.backends.fsspec:FsspecBackend",
}


def import_object(target: str) -> object:
    """The object a ``"package.module:attr.sub"`` path names (a moved kvplug path is followed,
    with a :class:`DeprecationWarning`). Import errors propagate to the caller, which names what
    it was loading. Only for paths an operator wrote (a config, an entry point): never a name
    read from a store (:func:`kvplug.codecs.registry.decoder_for` resolves those)."""
    if target in MOVED_PATHS:
        warnings.warn(
            f"{target!r} moved to {MOVED_PATHS[target]!r}; update the config (the old path will "
            "be removed in a later release)",
            DeprecationWarning,
            stacklevel=2,
        )
        target = MOVED_PATHS[target]
    module_name, _, attr = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def _import_target(target: str, name: str, package: str, kind: str = "backend") -> type:
    try:
        obj = import_object(target)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported with its cause
        raise BackendLoadError(
            f"{kind} {name!r} from package {package} could not be loaded from {target!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(obj, type):
        raise BackendLoadError(
            f"{kind} {name!r} from package {package}: {target!r} is a "
            f"{type(obj).__name__}, not a class; point the entry point at the {kind} class"
        )
    return obj


def load_backend_class(name: str) -> tuple[type, BackendInfo]:
    """The validated class for a configured backend name or ``"module:Class"`` path."""
    if ":" in name:
        info = BackendInfo(name, name, name.partition(":")[0], "?")
    else:
        backends = discover_backends()
        if name not in backends:
            known = ", ".join(sorted(backends)) or "none"
            raise BackendNotFoundError(
                f"backend {name!r} is not installed; installed backends: {known}. Install the "
                f"package that declares it under [project.entry-points.\"{ENTRY_POINT_GROUP}\"], "
                "or name a class directly as 'package.module:Class'"
            )
        info = backends[name]
    cls = info.load()
    validate_backend_class(cls, info.name, info.package)
    return cls, info


def validate_backend_class(cls: type, name: str, package: str = "?") -> None:
    """Check a backend class against the hook specs and the class-level contract
    (:class:`~kvplug.hookspecs.BackendClass`); raise ``BackendValidationError`` if it fails."""
    problems = class_contract_problems(cls)
    if problems:
        raise BackendValidationError(
            f"backend {name!r} from package {package} does not honour the kvplug class contract "
            f"(kvplug.hookspecs.BackendClass): {'; '.join(problems)}"
        )
    check_hookimpls(cls, BackendSpec, f"validate:{name}",
                    f"backend {name!r} from package {package}", "kvplug contract",
                    "kvplug.hookspecs")


def check_hookimpls(cls: type, spec: type, register_as: str, who: str, contract: str,
                    specs_module: str) -> None:
    """Register ``cls`` against the hook specs ``spec`` as a plugin manager would, and check that
    it implements every ``@required`` hook (:func:`~kvplug.hookspecs.missing_hooks`); a
    ``BackendValidationError`` naming ``who`` (the backend or policy), the ``contract`` it breaks
    and the ``specs_module`` to read, if not. A ``required_with`` hook it lacks
    (:func:`~kvplug.hookspecs.unmet_needs`: ``unpin`` where ``contains`` takes ``pin``) is a
    :class:`~kvplug.errors.BackendContractWarning` naming the class and the fix. Backends and
    policies are validated through here."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(spec)
    try:
        pm.register(cls, name=register_as)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise BackendValidationError(f"{who} does not honour the {contract}: {exc}") from exc

    def implemented(hook: str) -> list[tuple[str, ...]]:
        return [impl.argnames for impl in getattr(pm.hook, hook).get_hookimpls()]

    missing = missing_hooks(spec, implemented)
    if missing:
        raise BackendValidationError(
            f"{who} implements no @hookimpl for required hook(s) {', '.join(missing)}; see "
            f"{specs_module} for their signatures")
    for unmet in unmet_needs(spec, implemented):
        warnings.warn(f"{who} ({cls.__module__}.{cls.__qualname__}): {unmet}",
                      BackendContractWarning, stacklevel=3)
