"""``python -m kvplug.connector.demo``: a real vLLM engine with kvplug on its default tiers.

Builds a small local model (config + random weights, fixed seed; no download), starts vLLM with
``KVPlugConnector`` on kvplug's embedded default tiers (local_cpu in front of posix in the kvplug
cache directory), and runs long prompts that share a prefix. For each prompt it prints the time to
first token cold (first time the engine sees it) and warm (again), and how many tokens each tier
served. Run it twice: the second run's "cold" requests are served from the disk tier the first run
wrote.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any


def _prompts(n: int, shared: int, unique: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` random token prompts that share their first ``shared`` tokens (ids 3.. avoid BOS/EOS)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(unique)] for _ in range(n)]


Result = tuple[float, dict[str, Any], list[int]]  # (seconds, kvplug's report, first token)


def _ttft(llm: Any, tokens: list[int]) -> Result:
    """Time to first token of one prompt, what kvplug reported for it, and the token itself."""
    from vllm import SamplingParams, TokensPrompt

    # 2 tokens: with 1 the request ends in the step that loads, before the workers report
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, (out.kv_transfer_params or {}).get("kvplug") or {}, list(out.outputs[0].token_ids)[:1]


def _tiers(rep: dict[str, Any]) -> str:
    """``"256 local_cpu, 512 posix"``: tokens each tier served, from kvplug's per-request report."""
    tiers = rep.get("tiers") or {}
    return ", ".join(f"{n} {t}" for t, n in tiers.items() if n) or "-"


def _start_llm(model: str) -> Any:
    """A vLLM engine on ``model`` with KVPlugConnector on the default tiers, warmed up."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=8192, max_num_batched_tokens=8192,
              dtype="bfloat16", disable_log_stats=True,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVPlugConnector", kv_connector_module_path="kvplug.connector",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={}))
    _ttft(llm, [5] * 100)  # warm-up (shorter than a chunk: nothing stored)
    return llm


Row = tuple[int, int, Result, Result]  # (prompt index, tokens, cold, warm)


def _report(console: Any, rows: list[Row]) -> None:
    """The cold/warm table, and whether the disk tier served anything written by an earlier run."""
    from rich.table import Table

    table = Table(title="time to first token: cold vs warm (same prompt again)")
    for col in ("prompt", "tokens", "cold TTFT", "cold: tokens from", "warm TTFT",
                "warm: tokens from", "speed-up", "same token"):
        table.add_column(col, justify="right")
    for i, n, (ct, cr, ctok), (wt, wr, wtok) in rows:
        table.add_row(str(i), str(n), f"{ct * 1e3:.0f} ms", _tiers(cr), f"{wt * 1e3:.0f} ms",
                      _tiers(wr), f"{ct / wt:.1f}x", "yes" if ctok == wtok else "no")
    console.print(table)
    disk = sum((cr.get("tiers") or {}).get("posix", 0) for _, _, (_, cr, _), _ in rows)
    if disk:
        console.print(f"cold requests found {disk} tokens on the disk tier written by an earlier "
                      "run.")
    else:
        console.print("run the same command again: its cold requests will hit the disk tier.")


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run every prompt cold then warm, print the table; 0 on success."""
    ap = argparse.ArgumentParser(prog="python -m kvplug.connector.demo",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="number of documents")
    ap.add_argument("--shared", type=int, default=1024, help="tokens of the shared prefix")
    ap.add_argument("--unique", type=int, default=2048, help="tokens unique to each prompt")
    ap.add_argument("--model", default="small", help="model preset (kvplug.connector.demo.model)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    args = ap.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from kvplug.config import default_cache_dir, load_config
    from rich.console import Console
    from rich.progress import Progress

    from .model import PRESETS, make_model

    console = Console(width=max(Console().width, 120))  # keep the table readable in logs
    cfg = load_config(None)
    console.print(f"[bold]kvplug demo[/]: tiers {' -> '.join(cfg.tier_names())} "
                  f"(cache dir {default_cache_dir()})")
    with console.status("making the local model (random weights, seed 1234)..."):
        model = make_model(args.model)
    with console.status("starting vLLM with KVPlugConnector (takes ~30 s on a small CPU)..."):
        llm = _start_llm(str(model))

    vocab = PRESETS[args.model]["vocab_size"]
    prompts = _prompts(args.prompts, args.shared, args.unique, vocab, args.seed)
    rows: list[Row] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("prompts", total=2 * len(prompts))
        for i, p in enumerate(prompts):
            cold = _ttft(llm, p)
            progress.advance(task)
            warm = _ttft(llm, p)
            progress.advance(task)
            rows.append((i, len(p), cold, warm))
    _report(console, rows)
    return 0
