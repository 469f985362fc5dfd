"""A slow tier must not stall decoding: the longest inter-token gap of a decoding request while
another request's hit loads from a tier whose ``get`` and ``contains`` take 100 ms.

Two engines, one at a time, the same requests, the only tier a third-party-style slow tier
(tests/support/tiers_for_tests.py ``StallingTier``, ``stall_s`` 0.1, loaded by path like any third-party
backend):

  async    the tier as it is (no ``never_blocks``): kvplug loads its hits in the background
           (vLLM's asynchronous protocol)
  inline   the same tier declaring ``never_blocks = True`` (``InlineStallingTier`` below): kvplug
           believes it and loads inside the engine step, as for a tier that never blocks

In each: a prompt P is stored (cold run); a short request starts decoding; once it has produced
``--before`` tokens, P is submitted again (a hit of every chunk, each ``get`` 100 ms); decoding
goes on until P's first token and ``--after`` more decoder tokens. Reported per engine: the
decoder's median gap before P arrived (the normal gap), its longest gap while P was looked up
and loaded, and P's TTFT. Ratios are against the normal gap of the same engine.

    .venv/bin/python -m benchmarks.bench_slow_tier [--prompt-len 1600] [--stall 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.tiers_for_tests import StallingTier

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT = "BENCH-RESULT "


class InlineStallingTier(StallingTier):
    """The same slow tier, claiming it never blocks (so kvplug loads from it inside the step)."""

    never_blocks = True


def _run(mode: str, args: argparse.Namespace) -> dict:
    from kvplug.connector.demo.model import make_model
    from vllm import SamplingParams, TokensPrompt

    from tests.support import vllm_helpers as h

    h.engine_env()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ["PYTHONPATH"]])
    backend = ("tests.support.tiers_for_tests:StallingTier" if mode == "async"
               else "benchmarks.bench_slow_tier:InlineStallingTier")
    tier = {"backend": backend, "name": "slow", "timeout_s": 30,
            "options": {"stall_s": args.stall}}
    kv = h.transfer_config("kvplug", {"tiers": [tier], "log_every_load": False})
    llm = h.make_llm(make_model(args.model), kv, max_num_batched_tokens=args.batch_tokens)
    eng = llm.llm_engine
    P, short = h.prompt(args.prompt_len, 1), h.prompt(40, 2)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=P)], one, use_tqdm=False)  # store P (cold)

    arrivals: list[float] = []  # the decoder's token times
    first: dict[str, float] = {}
    eng.add_request("decoder", TokensPrompt(prompt_token_ids=short),
                    SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True))
    t_p = None
    n_at_p = 0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for o in eng.step():
            now = time.perf_counter()
            n = len(o.outputs[0].token_ids)
            if o.request_id == "decoder":
                arrivals += [now] * (n - len(arrivals))
            elif n and o.request_id not in first:
                first[o.request_id] = now
        if t_p is None and len(arrivals) >= args.before:
            eng.add_request("loader", TokensPrompt(prompt_token_ids=P), one)
            t_p, n_at_p = time.perf_counter(), len(arrivals)
        if "loader" in first and len(arrivals) >= n_at_p + args.after:
            break
    eng.abort_request(["decoder"])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    normal = statistics.median(gaps[5:n_at_p - 1])  # skip the first steps (warm-up)
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t_p and a < first["loader"]]
    return {"mode": mode, "normal_gap_ms": normal * 1e3,
            "max_gap_during_load_ms": max(during, default=0) * 1e3,
            "decoder_tokens_during_load": len(during),
            "loader_ttft_ms": (first["loader"] - t_p) * 1e3, "load": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="async,inline")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt-len", type=int, default=1600)
    ap.add_argument("--stall", type=float, default=0.1, help="seconds per get/contains")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--before", type=int, default=30, help="decoder tokens before P arrives")
    ap.add_argument("--after", type=int, default=10, help="decoder tokens after P's first")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(RESULT + json.dumps(_run(args.one, args)), flush=True)
        return 0
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", __spec__.name, "--one", mode, *sys.argv[1:]]
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [str(REPO), os.environ.get("PYTHONPATH", "")])})
        line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
        if line is None:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        rows.append(json.loads(line[len(RESULT):]))
    n_chunks = -(-args.prompt_len // 256)
    print(f"\nprompt P {args.prompt_len} tokens (~{n_chunks} chunks), tier get/contains "
          f"{args.stall * 1e3:.0f} ms each; model {args.model}")
    print(f"{'mode':<8}{'normal gap':>12}{'max gap while P loads':>24}{'ratio':>8}"
          f"{'decoder tokens meanwhile':>26}{'P TTFT':>10}")
    for r in rows:
        print(f"{r['mode']:<8}{r['normal_gap_ms']:>10.1f}ms{r['max_gap_during_load_ms']:>22.1f}ms"
              f"{r['max_gap_during_load_ms'] / r['normal_gap_ms']:>7.1f}x"
              f"{r['decoder_tokens_during_load']:>26}{r['loader_ttft_ms']:>8.0f}ms")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
