"""``python -m kvplug.connector.demo``: a real vLLM engine with kvplug on its default tiers.

Builds a small local model (config + random weights + a BPE tokenizer trained locally, fixed seeds;
no download), starts vLLM with ``KVPlugConnector`` on kvplug's default tiers (local_cpu in front of
posix in the kvplug cache directory), and sends long text prompts that share a prefix. For each
prompt it prints the time to first token cold (first time the engine sees it) and warm (again) and
how many tokens each tier served, then what each tier holds. vLLM's own logs go to a file named on
screen (``-v``: to the terminal). Run it twice: the second run's "cold" requests are served from the
disk tier the first run wrote.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

Result = tuple[float, dict[str, Any], list[int], int]  # (seconds, kvplug's report, 1st token, tokens)
Row = tuple[int, Result, Result]  # (prompt index, cold, warm)


def _texts(tokenizer: Any, n: int, shared: int, unique: int, seed: int) -> list[str]:
    """``n`` made-up documents sharing a prefix of about ``shared`` tokens, each with about
    ``unique`` more (sentences of the tokenizer's training language, whole words: the shared
    prefix tokenizes the same in every document)."""
    from .tokenizer import sentences

    def text(start_seed: int, tokens: int) -> str:
        parts: list[str] = []
        for s in sentences(start_seed, 1 << 20):
            parts.append(s)
            if len(parts) % 16 == 0 and len(tokenizer.encode(" ".join(parts))) >= tokens:
                break
        return " ".join(parts)

    prefix = text(seed, shared)
    return [f"{prefix} {text(seed + 1 + i, unique)}" for i in range(n)]


def _ttft(llm: Any, prompt: str | list[int]) -> Result:
    """Time to first token of one prompt, kvplug's report for it, the token, the prompt's length."""
    from vllm import SamplingParams, TokensPrompt

    # 2 tokens: with 1 the request ends in the step that loads, before the workers report
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    inp = prompt if isinstance(prompt, str) else TokensPrompt(prompt_token_ids=prompt)
    t0 = time.perf_counter()
    (out,) = llm.generate([inp], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    report = (out.kv_transfer_params or {}).get("kvplug") or {}
    return dt, report, list(out.outputs[0].token_ids)[:1], len(out.prompt_token_ids or ())


def _served(rep: dict[str, Any]) -> str:
    """``"256 local_cpu, 512 posix"``: tokens each tier served, from kvplug's per-request report."""
    tiers = rep.get("tiers") or {}
    return ", ".join(f"{n} {t}" for t, n in tiers.items() if n) or "-"


def _start_llm(model: str) -> Any:
    """A vLLM engine on ``model`` with KVPlugConnector (by name) on the default tiers, warmed up."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, enforce_eager=True, enable_prefix_caching=False, max_model_len=8192,
              max_num_batched_tokens=8192, dtype="bfloat16", disable_log_stats=True,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVPlugConnector", kv_role="kv_both",
                  kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"report_to_client": True}))  # for the table
    _ttft(llm, "Warm up.")  # shorter than a chunk: nothing stored
    return llm


def _tier_holdings(worker: Any) -> dict[str, dict[str, float]]:
    """Runs in each vLLM worker: wait for queued writes, then every tier's stats."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    storage = getattr(getattr(get_kv_transfer_group(), "_worker", None), "storage", None)
    if storage is None:
        return {}
    storage.flush(timeout=60)
    return storage.stats()


def _report(console: Any, rows: list[Row], holdings: dict[str, dict[str, float]],
            cfg: Any) -> None:
    """The cold/warm table, what each tier holds, and where the disk cache is."""
    from kvplug.cli.common import human_bytes
    from rich.table import Table

    table = Table(title="time to first token: cold vs warm (same prompt again)")
    for col in ("prompt", "tokens", "cold TTFT", "cold: tokens from", "warm TTFT",
                "warm: tokens from", "speed-up", "same token"):
        table.add_column(col, justify="right")
    for i, (ct, cr, ctok, n), (wt, wr, wtok, _) in rows:
        table.add_row(str(i), str(n), f"{ct * 1e3:.0f} ms", _served(cr), f"{wt * 1e3:.0f} ms",
                      _served(wr), f"{ct / wt:.1f}x", "yes" if ctok == wtok else "no")
    console.print(table)
    tiers = Table(title="what each tier holds now")
    for col in ("tier", "backend", "chunks", "bytes", "capacity", "where"):
        tiers.add_column(col, justify="left" if col in ("tier", "backend", "where") else "right")
    for t in cfg.tiers:
        st = holdings.get(t.tier_name, {})
        where = str(Path(t.options["path"]).expanduser()) if "path" in t.options else "host RAM"
        tiers.add_row(t.tier_name, t.backend, f"{st.get('entries', 0):.0f}",
                      human_bytes(st.get("bytes", 0)), human_bytes(st.get("capacity", 0)), where)
    console.print(tiers)
    disk = sum((cr.get("tiers") or {}).get("posix", 0) for _, (_, cr, _, _), _ in rows)
    if disk:
        console.print(f"cold requests found {disk} tokens on the disk tier written by an earlier "
                      "run.")
    else:
        console.print("run the same command again: its cold requests will hit the disk tier.")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvplug.connector.demo",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="number of documents")
    ap.add_argument("--shared", type=int, default=1024, help="tokens of the shared prefix (about)")
    ap.add_argument("--unique", type=int, default=2048, help="tokens unique to each prompt (about)")
    ap.add_argument("--model", default="small", help="model preset (kvplug.connector.demo.model)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="show vLLM's logs here instead of writing them to a log file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run every prompt cold then warm, print the tables; 0 on success."""
    args = _args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # the tier table asks the worker process for its tiers' stats (a function sent over vLLM's
    # own local IPC, which vLLM only allows with this switch); the demo serves nobody else
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from kvplug.config import default_cache_dir, load_config
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .model import make_model
    from .quiet import redirected_output

    cfg = load_config(None)
    log = None if args.verbose else default_cache_dir() / "demo-vllm.log"
    with redirected_output(log) as screen:
        console = Console(file=screen, width=max(Console(file=screen).width, 120))
        console.print(f"[bold]kvplug demo[/]: tiers {' -> '.join(cfg.tier_names())}",
                      highlight=False)
        if log:
            console.print(f"vLLM's logs: {log} (-v: here)", highlight=False, soft_wrap=True)
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            progress.add_task("making the local model (random weights, seed 1234)", total=None)
            model = make_model(args.model)
            progress.add_task("starting vLLM with KVPlugConnector (~30-60 s on a small CPU)",
                              total=None)
            llm = _start_llm(str(model))
        texts = _texts(llm.get_tokenizer(), args.prompts, args.shared, args.unique, args.seed)
        rows: list[Row] = []
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("prompts, cold then warm", total=2 * len(texts))
            for i, text in enumerate(texts):
                cold = _ttft(llm, text)
                progress.advance(task)
                rows.append((i, cold, _ttft(llm, text)))
                progress.advance(task)
        holdings: dict[str, dict[str, float]] = {}
        for part in llm.collective_rpc(_tier_holdings):
            holdings.update(part)
        _report(console, rows, holdings, cfg)
        llm.llm_engine.engine_core.shutdown()  # its processes' last log lines go to the log too
    return 0
