"""``kvplug config check FILE``: validate a config and print the tiers it resolves to.

Nothing it prints holds a secret: options and settings go through :func:`kvplug.redact.redact_data`,
problems through a :class:`~kvplug.redact.Redactor` of the tier's options."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel, ByteSize, ValidationError
from rich.table import Table

from ..codecs.registry import build_codec
from ..config import ENV_PREFIX, RESERVED_ENV, KVPlugConfig, TierConfig, load_config, widest_schema
from ..errors import KVPlugError
from ..plugins import load_backend_class
from ..policies.registry import check_policies
from ..redact import Redactor, describe_validation_error, redact_data
from .common import console, escape, fail


def _show(value: Any) -> str:
    if isinstance(value, ByteSize):
        return value.human_readable(decimal=False)
    if isinstance(value, Path):
        return str(value)
    return json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)


def resolve_tier(tier: TierConfig) -> dict[str, Any]:
    """Load and validate one tier's backend, options and policies, like the StorageManager does
    at start."""
    check_policies(tier)
    cls, info = load_backend_class(tier.backend)
    model = getattr(cls, "Options", None)
    options: dict[str, Any] = dict(tier.options)
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            parsed = model.model_validate(tier.options)
        except ValidationError as exc:
            problems = "; ".join(describe_validation_error(e, Redactor(tier.options))
                                 for e in exc.errors())
            raise KVPlugError(
                f"tier {tier.tier_name!r} (backend {tier.backend!r}): bad options: {problems}. "
                f"Allowed options: {', '.join(model.model_fields)}"
            ) from None
        options = {name: getattr(parsed, name) for name in type(parsed).model_fields}
    codec, codec_info = build_codec(tier, bool(getattr(cls, "never_blocks", False)))
    out = {"name": tier.tier_name, "backend": tier.backend, "package": info.package,
           "version": info.version, "class": f"{cls.__module__}:{cls.__qualname__}",
           "options": redact_data(options), "timeout_s": tier.timeout_s}
    if codec is not None and codec_info is not None:
        out["codec"] = {"name": codec_info.name, "package": codec_info.package,
                        "lossy": codec.lossy, "options": codec.describe()}
    return out


def check_config(path: Path) -> tuple[KVPlugConfig, list[dict[str, Any]], list[str]]:
    """The validated config, its resolved tiers, and every problem found (empty when valid)."""
    try:
        cfg = load_config(path, schema=widest_schema())
    except KVPlugError as exc:
        fail(f"{path}: {exc}")
    problems: list[str] = []
    names = cfg.tier_names()
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"tier name(s) {dupes} appear more than once; give each a unique 'name'")
    tiers = []
    for tier in cfg.tiers:
        try:
            tiers.append(resolve_tier(tier))
        except Exception as exc:  # noqa: BLE001 - every tier's problem is reported, then exit 1
            problems.append(Redactor(tier.options)(str(exc)))
    return cfg, tiers, problems


def check_or_fail(path: Path) -> None:
    """Validate a kvplug YAML now (:func:`check_config`), so a bad key fails before vLLM spends a
    minute starting: one line naming every problem, exit 1."""
    _, _, problems = check_config(path)
    if problems:
        fail(f"{path}: " + "; ".join(problems))


@click.group("config")
def config_group() -> None:
    """Work with kvplug config files."""


@config_group.command("check")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the resolved config as JSON.")
def check_cmd(file: Path, as_json: bool) -> None:
    """Validate FILE (YAML) and print the resolved tiers, fastest first."""
    cfg, tiers, problems = check_config(file)
    overrides = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in RESERVED_ENV)
    if as_json:
        settings = redact_data(cfg.model_dump(exclude={"tiers"}))
        click.echo(json.dumps({"valid": not problems, "settings": settings, "tiers": tiers,
                               "problems": problems, "env_overrides": overrides},
                              indent=2, default=_show))
    else:
        table = Table(title=f"kvplug tiers from {file}")
        for col in ("#", "Tier", "Backend", "Package", "Options", "Timeout"):
            table.add_column(col, overflow="fold")
        for i, t in enumerate(tiers, 1):
            opts = ", ".join(f"{k}={_show(v)}" for k, v in t["options"].items())
            cells = (str(i), t["name"], t["backend"], f"{t['package']} {t['version']}", opts,
                     f"{t['timeout_s']:g}s")
            table.add_row(*(escape(c) for c in cells))
        console.print(table)
        shown = redact_data(cfg.model_dump(exclude={"tiers"}))
        settings = ", ".join(f"{k}={v}" for k, v in shown.items())
        console.print(f"settings: {settings}", markup=False, highlight=False)
        if overrides:
            console.print(f"environment overrides applied: {', '.join(overrides)}")
        for p in problems:
            console.print(f"[red]problem:[/] {escape(p)}", highlight=False, soft_wrap=True)
    if problems:
        fail(f"{file}: {len(problems)} problem(s) found", code=1)
    if not as_json:
        console.print(f"[green]OK[/]: {escape(str(file))} is valid ({len(tiers)} tiers)", highlight=False)
