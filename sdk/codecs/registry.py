"""Codec discovery: entry points in the ``kvplug.codecs`` group, through the backends' machinery
(:func:`kvplug.plugins.discover_entry_points`). ``KVPLUG_LOAD_CODECS=a,b`` restricts it to those
names. A codec named in a config but not installed is a :class:`CodecNotFoundError` listing the
installed ones; a codec met in a stored chunk but not installed is a :class:`CodecMissingError`
(a miss) naming the package that wrote it.

Stored bytes never choose code: :func:`decoder_for` (a name read from a store) resolves only the
tier's own configured codec and the installed entry points, by name, never a ``module:Class``
path; only a config (the operator) may name a class by its path (:func:`load_codec_class`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from ..errors import (
    BackendConflictError,
    BackendLoadError,
    CodecMissingError,
    CodecNotFoundError,
    ConfigError,
    KVPlugError,
)
from ..plugins import BackendInfo, discover_entry_points
from .base import Codec

if TYPE_CHECKING:  # pragma: no cover
    from ..config import TierConfig

ENTRY_POINT_GROUP = "kvplug.codecs"

_lock = threading.Lock()
_cache: dict[str, tuple[type[Codec], BackendInfo] | Exception] = {}


def discover_codecs() -> dict[str, BackendInfo]:
    """Every codec declared by an installed package (without importing any of them)."""
    return discover_entry_points(ENTRY_POINT_GROUP, "codec", "KVPLUG_LOAD_CODECS",
                                 "restrict the codecs loaded with KVPLUG_LOAD_CODECS")


def load_codec_class(name: str) -> tuple[type[Codec], BackendInfo]:
    """The class declared under ``name`` (or named as ``"package.module:Class"``; imported once
    per process and cached), checked to be a :class:`Codec` subclass."""
    with _lock:
        hit = _cache.get(name)
    if isinstance(hit, Exception):
        raise hit
    if hit is not None:
        return hit
    try:
        codecs = discover_codecs() if ":" not in name else {
            name: BackendInfo(name, name, name.partition(":")[0], "?", "codec")}
        if name not in codecs:
            known = ", ".join(sorted(codecs)) or "none"
            raise CodecNotFoundError(
                f"codec {name!r} is not installed; installed codecs: {known}. Install the package "
                f"that declares it under [project.entry-points.\"{ENTRY_POINT_GROUP}\"]"
            )
        info = codecs[name]
        cls = info.load()
        if not issubclass(cls, Codec):
            raise BackendLoadError(
                f"codec {name!r} from package {info.package}: {info.target} is not a subclass of "
                "kvplug.codecs.Codec"
            )
        found: tuple[type[Codec], BackendInfo] | Exception = (cls, info)
    except (CodecNotFoundError, BackendLoadError) as exc:
        found = exc
    with _lock:
        _cache[name] = found
    if isinstance(found, Exception):
        raise found
    return found


def decoder_for(name: str, package: str, version: str,
                configured: tuple[type[Codec], BackendInfo] | None = None) -> type[Codec]:
    """The class that decodes frames written by codec ``name`` of ``package`` ``version``: the
    tier's ``configured`` codec when ``name`` is its name, else an installed ``kvplug.codecs``
    entry point of that name. ``name`` comes from a store, so it never names a module to import:
    anything else is a :class:`CodecMissingError` (a miss) naming the package to install."""
    if configured is not None and configured[1].name == name:
        return configured[0]
    with _lock:
        hit = _cache.get(name)
    if isinstance(hit, tuple) and ":" not in name:  # an entry point loaded before
        return hit[0]
    try:
        installed = ":" not in name and name in discover_codecs()
        if installed:
            return load_codec_class(name)[0]
        what = "not installed here"
    except (CodecNotFoundError, BackendLoadError, BackendConflictError) as exc:
        what = f"not loadable here: {exc}"
    raise CodecMissingError(
        f"chunk stored through codec {name[:80]!r} (package {package[:80] or '?'} "
        f"{version[:40]}) which is {what}; only installed kvplug.codecs entry points and the "
        f"tier's own codec decode chunks: install {package[:80] or 'the package declaring that codec'} "
        "to read such chunks"
    ) from None


def clear_cache() -> None:
    """Forget loaded codecs (tests install codecs at run time)."""
    with _lock:
        _cache.clear()


def build_codec(cfg: TierConfig, never_blocks: bool) -> tuple[Codec | None, BackendInfo | None]:
    """The codec a tier's config asks for, built from its validated ``codec_options``, or
    ``(None, None)``; a :class:`ConfigError` names what is wrong (unknown codec, bad options, a
    codec on a tier that never blocks)."""
    if cfg.codec is None:
        if cfg.codec_options:
            raise ConfigError(f"tier {cfg.tier_name!r}: codec_options given without a codec")
        return None, None
    if never_blocks:
        raise ConfigError(
            f"tier {cfg.tier_name!r} ({cfg.backend}) never blocks and keeps raw pages in memory; "
            f"codec {cfg.codec!r} applies to tiers that move bytes (disk, GDS, remote): set it on "
            "one of those"
        )
    cls, info = load_codec_class(cfg.codec)
    options: Any = dict(cfg.codec_options)
    model = getattr(cls, "Options", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            options = model.model_validate(cfg.codec_options)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}"
                                 for e in exc.errors())
            raise ConfigError(
                f"tier {cfg.tier_name!r} (codec {cfg.codec!r}): bad codec_options: {problems}. "
                f"Allowed options: {', '.join(model.model_fields)}"
            ) from None
    try:
        return cls(options), info
    except KVPlugError:
        raise
    except Exception as exc:
        raise BackendLoadError(
            f"tier {cfg.tier_name!r}: codec {cfg.codec!r} from package {info.package} failed to "
            f"start: {type(exc).__name__}: {exc}"
        ) from exc
