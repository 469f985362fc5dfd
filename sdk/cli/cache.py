"""``kvplug cache lookup|clear|pin|unpin|status``: kvplug's management API from the command line.

With ``--url`` (a ``kvplug serve`` server) each command is one call to ``/kvplug/v1/...``
(:mod:`kvplug.connector.api`); ``--api-key`` (default ``$VLLM_API_KEY``) is sent as a bearer
token. With ``--config FILE`` and no engine running, ``status`` and ``clear --all/--tier`` act on
the configured stores directly, through a StorageManager and the same rules
(:mod:`kvplug.management`), as does ``clear --tenant``; a lookup, a prefix clear or a pin needs
the engine (keys hold the model's identity). Every clear prints what each tier removed and what
remains, and exits 1 unless every tier did all of it. ``--json`` prints the API's JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from .common import call, console, escape, fail, human_bytes, key_opt


def _size(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def _num(n: int | None) -> str:
    return "?" if n is None else str(n)


def _policy(setting: Any) -> str:
    """A policy as status reports it (``{"policy": NAME, ...options}``), e.g.
    ``tinylfu (min_count=2)``."""
    if not isinstance(setting, dict):
        return "-" if setting is None else str(setting)
    opts = ", ".join(f"{k}={v}" for k, v in setting.items() if k != "policy")
    return f"{setting.get('policy', '?')}" + (f" ({opts})" if opts else "")


def print_status(body: dict[str, Any]) -> None:
    table = Table(title=f"kvplug tiers of {escape(str(body.get('model', 'the stores')))}")
    for col in ("Tier", "Backend", "Used", "Capacity", "Entries", "Pinned", "Breaker",
                "Eviction", "Admission"):
        table.add_column(col)
    for t in body["tiers"]:
        pol = t.get("policies", {})
        table.add_row(escape(t["name"]), escape(t["backend"]), _size(t["used_bytes"]),
                      _size(t["capacity_bytes"]), _num(t["entries"]), _num(t["pinned"]),
                      t["breaker"] or "-", escape(_policy(pol.get("eviction"))),
                      escape(_policy(pol.get("admission"))))
    console.print(table)


def print_clear(body: dict[str, Any]) -> None:
    table = Table(title=f"kvplug clear ({escape(body['scope'])}): "
                        f"{'done' if body['ok'] else 'NOT complete'}")
    for col in ("Tier", "Removed", "Freed", "Remaining", "Complete", "Error / note"):
        table.add_column(col, overflow="fold")
    for name, t in body["tiers"].items():
        table.add_row(escape(name), _num(t["removed"]), human_bytes(t["removed_bytes"]),
                      _num(t["remaining"]), "yes" if t["complete"] else "[red]no[/]",
                      escape(t.get("error") or t.get("note") or ""))
    console.print(table)


def print_lookup(body: dict[str, Any]) -> None:
    console.print(f"{body['tokens']} of {body['prompt_tokens']} prompt tokens would load from "
                  f"kvplug (chunk {body['chunk_size']}, block {body['block_size']})",
                  highlight=False)
    table = Table()
    for col in ("Tier", "Held (leading tokens)", "Served (of the hit)"):
        table.add_column(col)
    for name, t in body["tiers"].items():
        table.add_row(escape(name), str(t["held"]), str(t["served"]))
    console.print(table)


def print_pin(body: dict[str, Any], what: str = "pin") -> None:
    table = Table(title=f"kvplug {what} ({body['tokens']} prompt tokens): "
                        f"{'done' if body['ok'] else 'NOT complete'}")
    cols = (("Pinned", "pinned"), ("Absent", "absent"), ("Refused", "refused")) \
        if what == "pin" else (("Unpinned", "unpinned"), ("Not pinned", "not_pinned"))
    for col in ("Tier", *(c for c, _ in cols), "Pinned bytes", "Limit", "Complete",
                "Error / note"):
        table.add_column(col, overflow="fold")
    for name, t in body["tiers"].items():
        table.add_row(escape(name), *(_num(t.get(k)) for _, k in cols),
                      _size(t.get("pinned_bytes")), _size(t.get("limit_bytes")),
                      "yes" if t["complete"] else "[red]no[/]",
                      escape(t.get("error") or t.get("note") or ""))
    console.print(table)


def _prompt_body(prompt: str | None, prompt_file: Path | None, token_ids: str | None,
                 cache_salt: str | None) -> dict[str, Any]:
    given = [x for x in (prompt, prompt_file, token_ids) if x is not None]
    if len(given) != 1:
        fail("give exactly one of --prompt, --prompt-file or --token-ids")
    body: dict[str, Any] = {"cache_salt": cache_salt} if cache_salt else {}
    if token_ids is not None:
        try:
            body["token_ids"] = [int(x) for x in token_ids.replace(",", " ").split()]
        except ValueError:
            fail(f"--token-ids {token_ids!r}: give integers separated by commas or spaces")
    else:
        body["prompt"] = (prompt if prompt is not None
                          else prompt_file.read_text().removesuffix("\n"))  # type: ignore[union-attr]
    return body


def _emit(body: dict[str, Any], as_json: bool, show: Any) -> None:
    if as_json:
        click.echo(json.dumps(body, indent=2))
    else:
        show(body)


url_opt = click.option("--url", help="A `kvplug serve` server, e.g. http://127.0.0.1:8000.")
json_opt = click.option("--json", "as_json", is_flag=True, help="Print the JSON answer.")
prompt_opts = [
    click.option("--prompt", help="Prompt text (tokenized by the served model)."),
    click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                 help="Prompt text from a file."),
    click.option("--token-ids", help="Token ids, comma or space separated."),
    click.option("--cache-salt", help="The requests' cache_salt."),
]


def _with(opts: list[Any]) -> Any:
    def deco(f: Any) -> Any:
        for o in reversed(opts):
            f = o(f)
        return f
    return deco


@click.group("cache")
def cache_group() -> None:
    """Ask a running engine what kvplug holds, clear it, see its tiers."""


@cache_group.command("lookup")
@url_opt
@key_opt
@_with(prompt_opts)
@json_opt
def lookup_cmd(url: str | None, api_key: str | None, prompt: str | None,
               prompt_file: Path | None, token_ids: str | None, cache_salt: str | None,
               as_json: bool) -> None:
    """Tokens of a prompt the engine would load from kvplug, and per tier."""
    if not url:
        fail("lookup needs --url: keys hold the engine's model identity")
    body = call(url, "/lookup", _prompt_body(prompt, prompt_file, token_ids, cache_salt),
                api_key)
    _emit(body, as_json, print_lookup)


def _pin(what: str, url: str | None, api_key: str | None, tiers: tuple[str, ...],
         prompt: str | None, prompt_file: Path | None, token_ids: str | None,
         cache_salt: str | None, as_json: bool) -> None:
    if not url:
        fail(f"{what} needs --url: keys hold the engine's model identity")
    req = _prompt_body(prompt, prompt_file, token_ids, cache_salt)
    if tiers:
        req["tiers"] = list(tiers)
    body = call(url, f"/{what}", req, api_key)
    _emit(body, as_json, lambda b: print_pin(b, what))
    if not body["ok"]:
        raise click.exceptions.Exit(1)


tier_opt = click.option("--tier", "tiers", multiple=True,
                        help="Only this tier (repeatable; default: every tier).")


@cache_group.command("pin")
@url_opt
@key_opt
@tier_opt
@_with(prompt_opts)
@json_opt
def pin_cmd(url: str | None, api_key: str | None, tiers: tuple[str, ...], prompt: str | None,
            prompt_file: Path | None, token_ids: str | None, cache_salt: str | None,
            as_json: bool) -> None:
    """Keep a prompt's chunks from eviction (a system prompt, a hot document) until unpinned,
    within each tier's max_pinned_fraction; exits 1 unless every tier pinned all of it."""
    _pin("pin", url, api_key, tiers, prompt, prompt_file, token_ids, cache_salt, as_json)


@cache_group.command("unpin")
@url_opt
@key_opt
@tier_opt
@_with(prompt_opts)
@json_opt
def unpin_cmd(url: str | None, api_key: str | None, tiers: tuple[str, ...], prompt: str | None,
              prompt_file: Path | None, token_ids: str | None, cache_salt: str | None,
              as_json: bool) -> None:
    """Release an operator's pins of a prompt's chunks."""
    _pin("unpin", url, api_key, tiers, prompt, prompt_file, token_ids, cache_salt, as_json)


def _storage(config: Path) -> Any:
    from ..errors import KVPlugError
    from ..storage_manager import StorageManager

    try:
        return StorageManager(str(config))
    except KVPlugError as exc:
        fail(f"{config}: {exc}")


@cache_group.command("status")
@url_opt
@key_opt
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="No engine: open the configured stores directly.")
@json_opt
def status_cmd(url: str | None, api_key: str | None, config: Path | None, as_json: bool) -> None:
    """Tiers, capacity and use, breakers, pins, policies."""
    if (url is None) == (config is None):
        fail("give --url (a running engine) or --config FILE (the stores, no engine)")
    if url:
        body = call(url, "/status", api_key=api_key)
    else:
        from ..management import tier_status

        with _storage(config) as storage:  # type: ignore[arg-type]
            body = {"model": str(config), "tiers": tier_status(storage)}
    _emit(body, as_json, print_status)


@cache_group.command("clear")
@url_opt
@key_opt
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="No engine: clear the configured stores directly (--all, --tier, --tenant).")
@click.option("--all", "everything", is_flag=True, help="Every entry of every tier.")
@click.option("--tier", "tiers", multiple=True, help="Only this tier (repeatable).")
@click.option("--tenant", help="One tenant's entries (its cache_salt or tenant name), on the "
              "tiers that can list them (L1, posix); --tier narrows it.")
@_with(prompt_opts)
@json_opt
def clear_cmd(url: str | None, api_key: str | None, config: Path | None, everything: bool,
              tiers: tuple[str, ...], tenant: str | None, prompt: str | None,
              prompt_file: Path | None, token_ids: str | None, cache_salt: str | None,
              as_json: bool) -> None:
    """Remove entries: --all, --tier NAME, a prompt's chunks (--prompt...), or --tenant.

    Prints per tier what was removed and what remains; exits 1 unless every tier did it all."""
    if (url is None) == (config is None):
        fail("give --url (a running engine) or --config FILE (the stores, no engine)")
    has_prompt = any(x is not None for x in (prompt, prompt_file, token_ids))
    picked = sum([everything, has_prompt, tenant is not None])
    if picked > 1 or (picked == 0 and not tiers) or (everything and tiers):
        fail("say what to clear: --all, --tier NAME, a prompt (--prompt, --prompt-file, "
             "--token-ids) or --tenant")
    scope = ("all" if everything else "prefix" if has_prompt else "tenant" if tenant
             else "tier")
    if config is not None:
        if scope == "prefix":
            fail("without an engine a prompt's chunks cannot be cleared (its keys hold the "
                 "engine's model identity): use --url")
        from ..management import clear_tenant, clear_tiers
        from ..policies.tenants import tenant_id

        with _storage(config) as storage:
            unknown = sorted(set(tiers) - set(storage.tier_names))
            if unknown:
                fail(f"unknown tier(s) {unknown}; tiers are {storage.tier_names}")
            per = (clear_tenant(storage, tenant_id(tenant, storage.auth), list(tiers) or None)
                   if tenant else clear_tiers(storage, list(tiers) or None))
        body = {"ok": all(t["complete"] for t in per.values()), "scope": scope,
                "tiers": {n: {"removed": t["removed"], "removed_bytes": t["removed_bytes"],
                              "remaining": t["remaining"], "complete": t["complete"],
                              "remaining_bytes": t.get("remaining_bytes"),
                              "error": t.get("error"), "note": t.get("note")}
                          for n, t in per.items()}}
    else:
        req: dict[str, Any] = {"scope": scope}
        if tiers:
            req["tiers"] = list(tiers)
        if tenant:
            req["tenant"] = tenant
        if has_prompt:
            req.update(_prompt_body(prompt, prompt_file, token_ids, cache_salt))
        body = call(url, "/clear", req, api_key)  # type: ignore[arg-type]
    _emit(body, as_json, print_clear)
    if not body["ok"]:
        raise click.exceptions.Exit(1)


__all__ = ["cache_group"]
