"""The config: one YAML file, ``KVPLUG_*`` environment overrides and a dict, for every room.

:class:`KVPlugConfig` holds what the core reads (``chunk_size``, ``tiers``); a room above the core
extends it (``kvplug.connector.protocol.config.ConnectorConfig`` adds ``layerwise``, ``save_decode``...),
and :func:`load_config` validates against the schema the caller names.

Precedence (later wins): built-in defaults < YAML file (``$KVPLUG_CONFIG``, or a ``config_file``
key / path given by the caller) < the caller's dict (what vLLM passes as
``kv_connector_extra_config``) < ``KVPLUG_*`` environment variables. Nested fields use ``__``:
``KVPLUG_CHUNK_SIZE=512``, ``KVPLUG_SAVE_DECODE=true``, ``KVPLUG_TIERS='[{backend: local_cpu}]'``
(values are parsed as YAML). Every unknown key or bad value is a :class:`ConfigError` that names
it and what is accepted; an unknown ``KVPLUG_*`` variable is only a warning naming the closest
one. Sizes accept ``8GiB``, ``512MB``, ``1e9``...
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import types
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .redact import Redactor, is_secret_name, redact_data, scrub

logger = logging.getLogger("kvplug.config")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
#: What a secret pasted where its variable's name belongs looks like (hex of 16+ bytes).
_LIKE_SECRET = re.compile(r"[0-9a-fA-F]{32,}")
#: Config keys whose values are never echoed in an error (they name secrets, or may be one).
_UNECHOED = ("auth_key_env", "auth_previous_key_envs")
ENV_PREFIX = "KVPLUG_"
#: Environment variables with a meaning of their own (not config overrides).
RESERVED_ENV = {"KVPLUG_CONFIG", "KVPLUG_CACHE_DIR", "KVPLUG_TENANT_KEY_FILE", "KVPLUG_LOG_LEVEL",
                "KVPLUG_LOAD_BACKENDS", "KVPLUG_LOAD_CODECS"}


def default_cache_dir() -> Path:
    """``$KVPLUG_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvplug``, else ``~/.cache/kvplug``."""
    if os.environ.get("KVPLUG_CACHE_DIR"):
        return Path(os.environ["KVPLUG_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvplug"


def _is_number(annotation: Any) -> bool:
    """Whether a field's type takes numbers only (``int``, ``float``, ``ByteSize``, ``int | None``…)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _is_number(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return bool(args) and all(_is_number(a) for a in args)
    return isinstance(annotation, type) and issubclass(annotation, (int, float)) \
        and not issubclass(annotation, bool)


class BaseOptions(BaseModel):
    """The base of every kvplug settings model — the config, each backend's and codec's
    ``Options``: unknown keys are errors, and a boolean is never read as a number (pydantic's lax
    mode would take YAML's ``true`` as 1, e.g. ``chunk_size: true``). Third-party backends and
    codecs should derive their ``Options`` from it too."""

    model_config = ConfigDict(extra="forbid")

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """The fields a ``repr`` shows, secrets masked (:func:`kvplug.redact.redact_data`: values
        under secret names, URL credentials); nested settings mask their own."""
        for name, value in super().__repr_args__():
            if name is None or isinstance(value, BaseModel):
                yield name, value
            else:
                yield name, redact_data({name: value})[name]

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _is_number(field.annotation):
                raise ValueError(f"{info.field_name} should be a number, not the boolean {value!r}")
        return value


class _Strict(BaseOptions):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PolicyConfig(BaseModel):
    """A tier's ``eviction`` or ``admission`` setting: ``{policy: NAME, ...its options}`` (or just
    ``NAME``). The name is an entry point of ``kvplug.policies`` (``lru``, ``s3fifo``,
    ``always``, ``tinylfu`` or a third party's) or ``'package.module:Class'``; the other keys are
    the policy's options, validated by its ``Options`` model (:mod:`kvplug.policies.registry`)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    policy: str = Field(description="policy name (kvplug.policies entry point) or 'module:Class'")

    def options(self) -> dict[str, Any]:
        """Every key but ``policy``."""
        return dict(self.model_extra or {})


class QuotaConfig(_Strict):
    """A tier's ``quotas``: bytes each tenant's chunks may hold there (:mod:`kvplug.policies.tenants`)."""

    default: ByteSize | None = Field(
        default=None, description="quota of every tenant without a line of its own (requests "
        "without a tenant included); none: unbounded")
    tenants: dict[str, ByteSize] = Field(
        default_factory=dict, description="tenant (its cache_salt or tenant name, hashed at "
        "start, never kept) -> its quota, e.g. {team-a: 20GiB}")


class TierConfig(_Strict):
    """One storage tier: which backend, its name, its options, its policies."""

    backend: str = Field(description="entry-point name (e.g. 'posix') or 'package.module:Class'")
    name: str | None = Field(default=None, description="unique tier name; defaults to backend")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the backend")
    timeout_s: float = Field(
        default=5.0, gt=0, description="bound on one get/contains of this tier; past it, a miss"
    )
    codec: str | None = Field(
        default=None,
        description="codec for what this tier stores ('lossless', 'fp8' or a kvplug.codecs entry "
                    "point); not for a tier that never blocks (L1 keeps raw pages)",
    )
    codec_options: dict[str, Any] = Field(default_factory=dict, description="passed to the codec")
    eviction: PolicyConfig | None = Field(
        default=None, description="which entries leave a full tier: {policy: lru} (the default) "
        "or s3fifo (scan-resistant), or a kvplug.policies entry point; for tiers whose backend "
        "orders its own victims (local_cpu, posix, gds)")
    admission: PolicyConfig | None = Field(
        default=None, description="which chunks are written to the tier: {policy: always} (the "
        "default) or {policy: tinylfu, min_count: 2} (only chunks used that often), or a "
        "kvplug.policies entry point")

    quotas: QuotaConfig | None = Field(
        default=None, description="per-tenant byte quotas on this tier: {default: SIZE, tenants: "
        "{NAME: SIZE}}; a tenant over its quota evicts its own entries first (tiers whose "
        "backend orders its own victims: local_cpu, posix, gds), or its stores are skipped "
        "(resp, mooncake, fsspec: counted by this process, approximate)")

    max_pinned_fraction: float = Field(
        default=0.5, ge=0, le=1, description="share of the tier's capacity that an operator's "
        "pins (kvplug cache pin) may hold; a pin past it is refused, naming this setting")

    @field_validator("eviction", "admission", mode="before")
    @classmethod
    def _policy_shorthand(cls, value: Any) -> Any:
        return {"policy": value} if isinstance(value, str) else value

    @property
    def tier_name(self) -> str:
        return self.name or self.backend


def default_tiers() -> list[TierConfig]:
    """The built-in tiers: 2 GiB of host RAM in front of a 20 GiB disk cache."""
    return [
        TierConfig(backend="local_cpu", options={"capacity": "2GiB"}),
        TierConfig(
            backend="posix",
            options={"path": str(default_cache_dir() / "chunks"), "capacity": "20GiB"},
        ),
    ]


class KVPlugConfig(_Strict):
    """What the core reads: chunking and tiers.

    A room above the core adds its own settings by subclassing (the connector's
    ``kvplug.connector.protocol.config.ConnectorConfig``); one YAML file configures both. A core load
    accepts and ignores the keys such an extension declares, and rejects every other unknown key.
    Extensions are the subclasses imported so far plus those declared under the entry-point group
    ``kvplug.config`` (so a process that never imported the connector still knows its keys).
    A renamed key is declared in :attr:`deprecated_keys` of the schema that owns it.
    """

    #: Renamed keys, old name -> new name: an old key is read as the new one with a warning
    #: naming the new key; both given is an error naming both. Each extension declares its own.
    deprecated_keys: ClassVar[Mapping[str, str]] = {}

    chunk_size: PositiveInt = Field(default=256, description="tokens per chunk")
    tiers: list[TierConfig] = Field(default_factory=default_tiers, min_length=1)
    max_heap_fallback: ByteSize | None = Field(
        default=None, description="heap bytes reads may hold at once when L1 has no room "
        "(e.g. '1GiB', the default); past it a read is a miss (kvplug.read_memory)")
    auth_key_env: str | None = Field(
        default=None,
        description="name of the environment variable holding the deployment secret (>= 32 "
                    "bytes, hex or base64): every chunk is then authenticated (MACs) and named "
                    "by a keyed hash; None = plain chunks (xxh3 checksums, readable names)")
    auth_previous_key_envs: list[str] = Field(
        default_factory=list,
        description="environment variables of earlier secrets, still accepted when verifying "
                    "(a rotation); names stay keyed by the last (oldest) of them")

    encrypt: bool = Field(
        default=False,
        description="encrypt chunks at rest (needs auth_key_env): every tier but host memory "
                    "stores each layer AES-256-GCM under a key derived from the secret and the "
                    "request's tenant (its cache_salt), the header's model, dtype, layout and "
                    "parallelism sealed too; only encrypted chunks are read")

    @field_validator("auth_key_env", "auth_previous_key_envs")
    @classmethod
    def _env_names(cls, value: Any) -> Any:
        for name in [value] if isinstance(value, str) else value or []:
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name) \
                    or _LIKE_SECRET.fullmatch(name):
                raise ValueError("not an environment variable name (shown: never, it may be "
                                 "a secret); give the NAME of the variable holding the secret, "
                                 "e.g. KV_CACHE_SECRET, never the secret itself")
        return value

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Read each deprecated key (:attr:`deprecated_keys`) as its new name."""
        if not isinstance(data, Mapping) or not any(k in data for k in cls.deprecated_keys):
            return data
        data = dict(data)
        for old, new in cls.deprecated_keys.items():
            if old not in data:
                continue
            if new in data:
                raise ValueError(f"config keys {old!r} (deprecated) and {new!r} are both given; "
                                 f"keep only {new!r}")
            logger.warning("config key %r is deprecated and read as %r: rename it", old, new)
            data[new] = data.pop(old)
        return data

    @model_validator(mode="after")
    def _previous_needs_current(self) -> KVPlugConfig:
        if self.auth_previous_key_envs and not self.auth_key_env:
            raise ValueError("auth_previous_key_envs needs auth_key_env (the current secret)")
        if self.encrypt and not self.auth_key_env:
            raise ValueError("encrypt: true needs auth_key_env (the environment variable "
                             "holding the deployment secret the encryption keys derive from)")
        return self

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _EXTENSIONS.append(cls)

    def tier_names(self) -> list[str]:
        return [t.tier_name for t in self.tiers]


_EXTENSIONS: list[type[KVPlugConfig]] = []
EXTENSION_GROUP = "kvplug.config"
C = TypeVar("C", bound=KVPlugConfig)


@functools.cache
def declared_extensions() -> tuple[type[KVPlugConfig], ...]:
    """Extension schemas declared by installed packages (loaded once per process)."""
    found = []
    for ep in entry_points(group=EXTENSION_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken extension is named, not fatal here
            raise ConfigError(f"config extension {ep.name!r} ({ep.value}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from exc
        if isinstance(cls, type) and issubclass(cls, KVPlugConfig):
            found.append(cls)
    return tuple(found)


def widest_schema() -> type[KVPlugConfig]:
    """The declared extension with the most settings (the connector's, where installed), else
    :class:`KVPlugConfig`: what ``kvplug config check`` validates a file against."""
    return max(declared_extensions(), key=lambda c: len(c.model_fields), default=KVPlugConfig)


def _foreign_keys(schema: type[KVPlugConfig]) -> list[str]:
    """Top-level keys some other extension declares (its deprecated names included), which
    ``schema`` itself does not."""
    own = [*schema.model_fields, *schema.deprecated_keys]
    out: list[str] = []
    for ext in (*_EXTENSIONS, *declared_extensions()):
        out += [k for k in (*ext.model_fields, *ext.deprecated_keys) if k not in own and k not in out]
    return out


def parse_size(value: str | int | float) -> int:
    """``'8GiB'`` -> 8589934592; raises ConfigError naming the value."""
    try:
        return int(_SizeModel(size=value).size)
    except ValidationError:
        raise ConfigError(
            f"size {value!r} is not understood; use bytes or a unit like '512MiB', '8GiB', '1GB'"
        ) from None


class _SizeModel(BaseModel):
    size: ByteSize


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {scrub(str(exc))}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping, got {type(data).__name__}")
    return data


def _warn_unknown_env(name: str, fields: list[str]) -> None:
    """An unrelated ``KVPLUG_*`` variable (a user's own ``KVPLUG_HOME``) is ignored with a warning
    naming the closest valid one, as vLLM does for ``VLLM_*``; only dict and file keys are strict."""
    valid = [ENV_PREFIX + f.upper() for f in fields] + sorted(RESERVED_ENV)
    n = len(ENV_PREFIX)  # compare what follows the shared prefix
    close = [ENV_PREFIX + m for m in difflib.get_close_matches(name[n:], [v[n:] for v in valid], 1)]
    hint = f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(valid)}"
    logger.warning("environment variable %s is not a kvplug setting and is ignored%s", name, hint)


def _secret_vars(data: Mapping[str, Any], env: Mapping[str, str]) -> set[str]:
    """The environment variables the config names as holding secrets (``auth_key_env``...):
    not settings, so never read as overrides nor warned about, whatever their prefix."""
    names = [data.get("auth_key_env"), *(data.get("auth_previous_key_envs") or [])]
    names += [env.get(ENV_PREFIX + "AUTH_KEY_ENV")]
    return {n for n in names if isinstance(n, str)}


def _env_overrides(env: Mapping[str, str], fields: list[str],
                   skip: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV or name in skip:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        if path[0] not in fields:
            _warn_unknown_env(name, fields)
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _explain(exc: ValidationError, top_level: list[str], redact: Redactor) -> str:
    """Every error of ``exc``, naming the key and (never a secret, :mod:`kvplug.redact`) the value."""
    lines = []
    for err in exc.errors():
        parts = [str(p) for p in err["loc"]]
        if "quotas" in parts and parts[parts.index("quotas") + 1:][:1] == ["tenants"]:
            # a tenant's name may be its cache salt: never echoed (kvplug.policies.tenants)
            at = parts.index("quotas") + 2
            parts = [*parts[:at], "<a tenant>"] if len(parts) > at else parts
            err = {**err, "input": "***"}
        elif isinstance(err.get("input"), dict) and "quotas" in err["input"]:
            err = {**err, "input": {k: ("{...}" if k == "quotas" else v)
                                    for k, v in err["input"].items()}}
        loc = ".".join(parts)
        if err["type"] == "extra_forbidden":
            keys = top_level
            if len(err["loc"]) > 1 and err["loc"][0] == "tiers":
                keys = list(TierConfig.model_fields)
            allowed = ", ".join(keys)
            lines.append(f"unknown config key {loc!r}; allowed keys here: {allowed}")
        elif not err["loc"]:  # a rule over several keys: the whole config is not echoed
            lines.append(f"config: {err['msg']}")
        elif err["loc"][0] in _UNECHOED:
            lines.append(f"config value {loc!r}: {err['msg']}")
        else:
            secret = any(is_secret_name(str(p)) for p in err["loc"])
            shown = "=***" if secret else f"={err.get('input')!r}"
            lines.append(redact(f"config value {loc!r}{shown}: {err['msg']}"))
    return "; ".join(lines)


def load_config(
    source: KVPlugConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    schema: type[C] = KVPlugConfig,  # type: ignore[assignment]
) -> C:
    """Build a validated ``schema`` from a dict, a YAML path, or nothing (defaults + environment).

    A dict may name a YAML file under ``config_file``; its other keys override the file's. Keys
    that belong to another extension of :class:`KVPlugConfig` are dropped; any other unknown key
    is a :class:`ConfigError` naming it.
    """
    if isinstance(source, schema):
        return source
    if isinstance(source, KVPlugConfig):
        source = source.model_dump()
    env = os.environ if env is None else env
    foreign = _foreign_keys(schema)
    data: dict[str, Any] = {}
    if env.get("KVPLUG_CONFIG"):
        data = _read_yaml(env["KVPLUG_CONFIG"])
    if isinstance(source, (str, os.PathLike)):
        data = _deep_merge(data, _read_yaml(source))
    elif source is not None:
        given = dict(source)
        if "config_file" in given:
            data = _deep_merge(data, _read_yaml(given.pop("config_file")))
        data = _deep_merge(data, given)
    data = _deep_merge(data, _env_overrides(env, [*schema.model_fields, *schema.deprecated_keys,
                                                  *foreign],
                                            _secret_vars(data, env)))
    data = {k: v for k, v in data.items() if k not in foreign}
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, [*schema.model_fields, *foreign], Redactor(data))) from None
