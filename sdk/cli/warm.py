"""``kvplug warm --url URL --prompts FILE.jsonl``: prefill prompts into a running engine's tiers
(or ``kvplug warm --model MODEL --kvplug-config FILE --prompts ...``: into an engine started in
this process, :mod:`kvplug.connector.warm_local`, no server; the same steps and summary).

Each line of the file is a JSON object ``{"prompt": "...", "cache_salt": "..."}`` (the salt
optional: the tenant the prompt is warmed for). For each prompt the engine's lookup
(``/kvplug/v1/lookup``) says how much is held already; a prompt held up to its last full block is
skipped (so a second run does nothing, and an interrupted run resumes where it stopped), any other
is sent as a prefill-only request (``/v1/completions``, ``max_tokens=1``), which stores its KV in
every tier. The summary is the tokens held per tier before and after, from the same lookup.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .common import call, console, err_console, escape, fail, key_opt


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """The prompts of a JSONL file; an error naming the line for anything else."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            fail(f"{path}:{n}: not JSON ({exc})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or \
                not isinstance(row.get("cache_salt", ""), str):
            fail(f'{path}:{n}: each line must be {{"prompt": "text", "cache_salt": "optional"}}')
        out.append({"prompt": row["prompt"], **({"cache_salt": row["cache_salt"]}
                                                 if row.get("cache_salt") else {})})
    if not out:
        fail(f"{path}: no prompts")
    return out


def _post(url: str, path: str, body: dict[str, Any], api_key: str | None) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        fail(f"{url}{path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}")
    except (urllib.error.URLError, OSError) as exc:
        fail(f"{url}{path}: {getattr(exc, 'reason', exc)}")


def _served_model(url: str, api_key: str | None) -> str:
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - one clear line for any failure
        fail(f"{url}/v1/models: {exc}; pass --model")


def held_fully(look: dict[str, Any]) -> bool:
    """Whether the lookup finds the prompt up to the last full block before its last token
    (what an identical request would load: vLLM computes at least one token)."""
    cap = (look["prompt_tokens"] - 1) // look["block_size"] * look["block_size"]
    return look["tokens"] >= cap


def parse_engine_args(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``--engine-arg KEY=VALUE`` pairs as ``vllm.LLM`` keyword arguments (values read as YAML:
    ``max_model_len=4096``, ``enforce_eager=true``); an error naming a malformed pair."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            fail(f"--engine-arg {pair!r}: write it as KEY=VALUE, e.g. max_model_len=4096")
        out[key] = yaml.safe_load(value)
    return out


def warm(prompts: list[dict[str, Any]], look: Callable[[dict[str, Any]], dict[str, Any]],
         prefill: Callable[[dict[str, Any]], Any], concurrency: int, as_json: bool) -> None:
    """Warm ``prompts``: ``look`` answers the engine's lookup of one, ``prefill`` sends one
    prefill-only request; prints the summary (tokens held per tier before and after) and exits 1
    unless every prompt is then held fully."""

    def warm_one(p: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        before = look(p)
        if held_fully(before):
            return before, False
        prefill(p)
        return before, True

    befores: list[dict[str, Any]] = []
    sent = 0
    with Progress(TextColumn("warming"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[sent]} prefilled"), console=err_console,
                  disable=as_json) as progress:
        task = progress.add_task("warm", total=len(prompts), sent=0)
        with ThreadPoolExecutor(concurrency) as pool:
            for before, did in pool.map(warm_one, prompts):
                befores.append(before)
                sent += did
                progress.update(task, advance=1, sent=sent)
    afters = [look(p) for p in prompts]
    tiers = list(afters[0]["tiers"])
    summary = {
        "prompts": len(prompts), "prefilled": sent, "skipped": len(prompts) - sent,
        "prompt_tokens": sum(a["prompt_tokens"] for a in afters),
        "held_fully": sum(held_fully(a) for a in afters),
        "tiers": {t: {"held_before": sum(b["tiers"][t]["held"] for b in befores),
                      "held_after": sum(a["tiers"][t]["held"] for a in afters)} for t in tiers},
    }
    for t in summary["tiers"].values():
        t["stored"] = t["held_after"] - t["held_before"]
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        console.print(f"{summary['prompts']} prompts: {sent} prefilled, {summary['skipped']} "
                      f"already held; {summary['held_fully']} now held fully", highlight=False)
        table = Table(title="tokens held per tier, all prompts")
        for col in ("Tier", "Before", "After", "Stored"):
            table.add_column(col)
        for name, t in summary["tiers"].items():
            table.add_row(escape(name), str(t["held_before"]), str(t["held_after"]),
                          str(t["stored"]))
        console.print(table)
    if summary["held_fully"] < len(prompts):
        err_console.print(f"{len(prompts) - summary['held_fully']} prompts are not held fully "
                          "after warming (a tier too small, stores dropped, or the prompt is "
                          "refused by the tenant rules): see `kvplug cache status`",
                          highlight=False)
        raise click.exceptions.Exit(1)


@click.command("warm")
@click.option("--url", help="A `kvplug serve` server, e.g. http://engine:8000 (or --model).")
@click.option("--prompts", "prompts_file", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='JSONL: one {"prompt": ..., "cache_salt": optional} per line.')
@click.option("--model", help="With --url: the served model name [default: the server's first "
              "model]. Without --url: the model to start here, in-process (no server).")
@click.option("--kvplug-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="In-process: kvplug YAML (tiers...) [default: kvplug's defaults, "
              "$KVPLUG_CONFIG].")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="In-process: a vllm.LLM argument (repeatable), e.g. max_model_len=4096.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Prefill requests in flight at once (with --url).")
@key_opt
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def warm_cmd(url: str | None, prompts_file: Path, model: str | None,
             kvplug_config: Path | None, engine_args: tuple[str, ...], concurrency: int,
             api_key: str | None, as_json: bool) -> None:
    """Prefill the prompts of a JSONL file into kvplug's tiers: a running engine's (--url), or
    an engine started here on --model with --kvplug-config (no server).

    Prompts the engine's lookup finds held are skipped: running it again is free, and an
    interrupted run resumes. Prints the tokens held per tier before and after."""
    prompts = read_prompts(prompts_file)
    if url is None:
        if model is None:
            fail("give --url (a running `kvplug serve`) or --model (an engine started here)")
        if kvplug_config is not None:
            from .config import check_or_fail

            check_or_fail(kvplug_config)
        # vLLM logs to stdout by default: to stderr here, so stdout is the summary (--json)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from kvplug.connector.warm_local import LocalEngine

        engine = LocalEngine(model, kvplug_config, parse_engine_args(engine_args))
        warm(prompts, engine.lookup, engine.prefill, 1, as_json)
        return
    if kvplug_config is not None or engine_args:
        fail("--kvplug-config and --engine-arg are for an engine started here (--model without "
             "--url); a server has its own")
    served = model or _served_model(url, api_key)

    def prefill(p: dict[str, Any]) -> None:
        body = {"model": served, "prompt": p["prompt"], "max_tokens": 1, "temperature": 0}
        if "cache_salt" in p:
            body["cache_salt"] = p["cache_salt"]
        _post(url, "/v1/completions", body, api_key)

    warm(prompts, lambda p: call(url, "/lookup", p, api_key), prefill, concurrency, as_json)
