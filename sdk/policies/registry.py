"""Policy discovery and building: entry points in the ``kvplug.policies`` group, validated against
:mod:`kvplug.policyspecs` with pluggy, built per tier from its ``eviction`` / ``admission`` config.

The backends' machinery finds them (:func:`kvplug.plugins.discover_entry_points`);
``KVPLUG_LOAD_POLICIES=a,b`` restricts discovery to those names. A name that is not installed,
installed but of the other kind, a class that fails the spec or options it does not accept is a
:class:`~kvplug.errors.ConfigError` naming the tier, the bad value and the choices.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, ValidationError

from ..config import PolicyConfig, TierConfig
from ..errors import BackendLoadError, BackendValidationError, ConfigError, KVPlugError
from ..plugins import BackendInfo, check_hookimpls, discover_entry_points
from ..policyspecs import SPECS, PolicyContext

ENTRY_POINT_GROUP = "kvplug.policies"
#: The policy each kind uses when a tier names none (the behaviour before policies existed).
DEFAULTS = {"eviction": "lru", "admission": "always"}

_lock = threading.Lock()
_cache: dict[str, tuple[type, BackendInfo]] = {}

__all__ = ["DEFAULTS", "ENTRY_POINT_GROUP", "PolicyConfig", "build_policy", "discover_policies",
           "load_policy_class", "policies_of_kind", "validate_policy_class"]


def discover_policies() -> dict[str, BackendInfo]:
    """Every policy declared by an installed package (nothing imported)."""
    return discover_entry_points(ENTRY_POINT_GROUP, "policy", "KVPLUG_LOAD_POLICIES",
                                 "restrict the policies loaded with KVPLUG_LOAD_POLICIES")


def policies_of_kind(kind: str) -> list[str]:
    """The installed policy names of ``kind`` (each class imported once, to read its kind)."""
    out = []
    for name in sorted(discover_policies()):
        try:
            cls, _ = load_policy_class(name)
        except KVPlugError:
            continue  # a broken policy is reported when a tier names it
        if getattr(cls, "kind", None) == kind:
            out.append(name)
    return out


def validate_policy_class(cls: type, name: str, package: str = "?") -> str:
    """Check ``cls`` against its kind's hook specs; its kind, or ``BackendValidationError``."""
    kind = getattr(cls, "kind", None)
    if kind not in SPECS:
        raise BackendValidationError(
            f"policy {name!r} from package {package}: class attribute kind is {kind!r}; set it to "
            f"one of {', '.join(repr(k) for k in SPECS)}")
    model = getattr(cls, "Options", None)
    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise BackendValidationError(
            f"policy {name!r} from package {package}: Options is {model!r}, not a pydantic model "
            "class; derive it from kvplug.config.BaseOptions")
    check_hookimpls(cls, SPECS[kind], f"validate-policy:{name}",
                    f"{kind} policy {name!r} from package {package}",
                    "kvplug policy contract (kvplug.policyspecs)", "kvplug.policyspecs")
    return kind


def load_policy_class(name: str) -> tuple[type, BackendInfo]:
    """The validated class declared under ``name`` (or named as ``"package.module:Class"``)."""
    with _lock:
        hit = _cache.get(name)
    if hit is not None:
        return hit
    if ":" in name:
        info = BackendInfo(name, name, name.partition(":")[0], "?", "policy")
    else:
        found = discover_policies()
        if name not in found:
            raise ConfigError(
                f"policy {name!r} is not installed; installed policies: "
                f"{', '.join(sorted(found)) or 'none'}. Install the package that declares it "
                f"under [project.entry-points.\"{ENTRY_POINT_GROUP}\"], or name a class as "
                "'package.module:Class'")
        info = found[name]
    cls = info.load()
    validate_policy_class(cls, info.name, info.package)
    with _lock:
        _cache[name] = (cls, info)
    return cls, info


def check_choice(kind: str, name: str, where: str) -> type:
    """The class of policy ``name`` for a ``kind`` setting at ``where`` (e.g. ``tier 'disk'``):
    a :class:`ConfigError` naming the value and the installed choices when it is not one."""
    try:
        cls, _ = load_policy_class(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {kind}: policy {name!r} is not an installed {kind} policy; "
                          f"choices: {', '.join(policies_of_kind(kind)) or 'none'}"
                          f" ({exc})") from None
    except (BackendLoadError, BackendValidationError) as exc:
        raise ConfigError(f"{where}: {kind}: {exc}") from None
    if cls.kind != kind:
        raise ConfigError(
            f"{where}: {kind}: policy {name!r} is an {cls.kind} policy, not an {kind} one; "
            f"{kind} policies: {', '.join(policies_of_kind(kind))}")
    return cls


def check_policies(tier: TierConfig) -> None:
    """The policies a tier's config names (``eviction``, ``admission``) are installed and of
    their kind: a :class:`ConfigError` naming the value and the choices, checked where tiers are
    built (:mod:`kvplug.tier_setup`) and by ``kvplug config check`` (the config schema itself
    loads no entry points)."""
    for kind in ("eviction", "admission"):
        chosen = getattr(tier, kind)
        if chosen is not None:
            check_choice(kind, chosen.policy, f"tier {tier.tier_name!r}")


def build_policy(kind: str, cfg: PolicyConfig | None, tier: str, capacity: int | None = None,
                 chunk_bytes: int | None = None, extra: dict[str, Any] | None = None) -> Any:
    """The ``kind`` policy a tier's config asks for (its default without one), built with its
    options validated; a :class:`ConfigError` names the tier, the value and the choices."""
    name = cfg.policy if cfg is not None else DEFAULTS[kind]
    where = f"tier {tier!r}"
    cls = check_choice(kind, name, where)
    raw = cfg.options() if cfg is not None else {}
    options: Any = dict(raw)
    model = getattr(cls, "Options", None)
    if model is not None:
        try:
            options = model.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}={e.get('input')!r}:"
                                 f" {e['msg']}" for e in exc.errors())
            raise ConfigError(
                f"{where}: {kind} policy {name!r}: bad option(s): {problems}. Allowed options: "
                f"{', '.join(model.model_fields) or 'none'}") from None
    elif raw:
        raise ConfigError(f"{where}: {kind} policy {name!r} takes no options; got "
                          f"{', '.join(sorted(raw))}")
    ctx = PolicyContext(tier=tier, options=options, capacity=capacity, chunk_bytes=chunk_bytes,
                        extra=dict(extra or {}))
    try:
        return cls(ctx)
    except KVPlugError:
        raise
    except Exception as exc:
        raise BackendLoadError(f"{where}: {kind} policy {name!r} failed to start: "
                               f"{type(exc).__name__}: {exc}") from exc
