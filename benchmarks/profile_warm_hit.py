"""Where a warm hit's time goes: one engine in this process, cProfile around the warm request.

vLLM's engine core normally runs in a child process; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the
scheduler, the (CPU) worker and kvplug's connector all run here, so one profile sees the hashing,
the lookup round trip, the load and the forward pass. Engines as in ``bench_vllm_e2e.py``.

    .venv/bin/python -m benchmarks.profile_warm_hit --config kvplug-cpu [--prompt-len 3001] \
        [--repeat 3] [--top 35] [--sort cumulative]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="kvplug-cpu")
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompt-len", type=int, default=3001)
    ap.add_argument("--blocks", type=int, default=72)
    ap.add_argument("--repeat", type=int, default=3, help="distinct prompts, each cold then warm")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--sort", default="cumulative")
    ap.add_argument("--dump", type=Path, help="write the warm requests' profile here (pstats)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvplug.connector.demo.model import PRESETS, make_model
    from vllm import SamplingParams, TokensPrompt

    from benchmarks.bench_vllm_e2e import _engine, _prompts

    model = str(make_model(args.model, weights=False))
    llm = _engine(args.config, model, Path(tempfile.mkdtemp(prefix="prof-")), args.blocks)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def gen(p: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p)], one, use_tqdm=False)
        return time.perf_counter() - t0

    gen([7] * 64)
    prof = cProfile.Profile()
    cold, warm = [], []
    for p in _prompts(args.repeat, args.prompt_len, 1, PRESETS[args.model]["vocab_size"]):
        cold.append(gen(p))
        prof.enable()
        warm.append(gen(p))
        prof.disable()
    print(f"{args.config}: cold {[round(x * 1e3) for x in cold]} ms, "
          f"warm {[round(x * 1e3) for x in warm]} ms; load {os.getloadavg()}")
    st = pstats.Stats(prof)
    if args.dump:
        st.dump_stats(args.dump)
    st.sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
