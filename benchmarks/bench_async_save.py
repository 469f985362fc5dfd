"""Asynchronous saves on CPU: does copying (and putting) stored KV on a thread help the engine,
or does it compete for the cores? One script, one run, the same prompts for every configuration.

Configurations (each in its own fresh engine process; the rounds alternate them to spread the
machine's load evenly):
  none     vLLM without a connector (prefix caching off)
  sync     kvplug (local_cpu), ``async_save: false``: copy and put inside ``wait_for_save``
  async    kvplug (local_cpu), ``async_save: true``: copy and put on the save thread

Workload: a storing (cold) run, everything new: ``--batch`` prompts of ``--prompt-len`` tokens
generating ``--max-tokens`` tokens each (the answer is stored too), ``--reps`` times with fresh
prompts; the figure is the median wall time per configuration and the ratios between them.

    python -m benchmarks.bench_async_save [--rounds 2] [--reps 3] [--model small]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

CONFIGS = ["none", "sync", "async"]
RESULT = "BENCH-RESULT "


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _engine(name: str, model: str, blocks: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if name != "none":
        kv = KVTransferConfig(
            kv_connector="KVPlugConnector", kv_connector_module_path="kvplug.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "tiers": [{"backend": "local_cpu", "options": {"capacity": "4GiB"}}],
                "log_every_load": False, "async_save": name == "async"})
    return LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
               enable_prefix_caching=False, max_model_len=8192, max_num_batched_tokens=4096,
               max_num_seqs=8, dtype="bfloat16", num_gpu_blocks_override=blocks,
               kv_transfer_config=kv, disable_log_stats=True, seed=0)


def _run_one(name: str, model: str, args: argparse.Namespace, rnd: int) -> dict:
    from kvplug.connector.demo.model import PRESETS
    from vllm import SamplingParams, TokensPrompt

    vocab = PRESETS[args.model]["vocab_size"]
    llm = _engine(name, model, args.blocks)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[7] * 300)], sp, use_tqdm=False)  # warm-up
    times = []
    for rep in range(args.reps):  # fresh prompts each time (same across configs): all cold
        batch = _prompts(args.batch, args.prompt_len, 1000 * rnd + rep, vocab)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return {"config": name, "round": rnd, "times": times}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=400, help="vLLM KV blocks (128 tokens each)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--model", default="small",
                    help="model preset (kvplug.connector.demo.model.PRESETS)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvplug.connector.demo.model import make_model

    model = str(make_model(args.model, weights=False))
    if args.one:
        print(RESULT + json.dumps(_run_one(args.one, model, args, args.round)), flush=True)
        return 0
    results: list[dict] = []
    for rnd in range(args.rounds):
        for name in args.configs.split(","):
            cmd = [sys.executable, "-m", __spec__.name, "--one", name, "--round", str(rnd)]
            for k in ("prompt_len", "batch", "max_tokens", "reps", "blocks", "model"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            print(f"round {rnd}: {name} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
            if line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            results.append(json.loads(line[len(RESULT):]))
    med = {}
    for name in args.configs.split(","):
        ts = sorted(t for r in results if r["config"] == name for t in r["times"])
        med[name] = ts[len(ts) // 2]
    tokens = args.batch * args.prompt_len
    print(f"\n{args.model}: {args.batch} x {args.prompt_len}-token prompts + {args.max_tokens} "
          f"generated, all cold (stored), {args.rounds} rounds x {args.reps} reps; median wall "
          "time per batch")
    for name, t in med.items():
        print(f"  {name:<6} {t * 1e3:8.0f} ms   {tokens / t:8.0f} prompt tok/s")
    if "sync" in med and "async" in med:
        print(f"  async/sync {med['async'] / med['sync']:.3f}x"
              + (f"; sync/none {med['sync'] / med['none']:.3f}x; async/none "
                 f"{med['async'] / med['none']:.3f}x" if "none" in med else ""))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
