"""vLLM CPU engines running side by side, as the test suite's workers run them: OpenMP threads.

    .venv/bin/python -m benchmarks.bench_engine_threads [--engines 4] [--generations 15]

Starts ``--engines`` processes at once, each an ``LLM`` on the tiny demo model (random weights,
no kvplug) generating ``--generations`` times (an 800-token prompt, 64 tokens), and reports each
one's generation time (its start-up excluded) under two environments, in turn:

* **default**: torch's thread per core in an in-process engine; vLLM's automatic core binding
  (``VLLM_CPU_OMP_THREADS_BIND=auto``) in a multi-process one;
* **one thread**: ``OMP_NUM_THREADS=1`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind``, what
  tests/conftest.py sets for every process the suite starts.

Both layouts (``--layouts in-process,multi-process``). On a machine with fewer cores than
engines times threads, OpenMP's waiting threads spin on cores the other engines need, and the
automatic binding puts every multi-process engine's worker on the same core. The figure is the
ratio default / one thread of the median engine's time, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "ENGINE-THREADS "
LAYOUTS = {"in-process": "0", "multi-process": "1"}
ENVIRONMENTS = {"default": {}, "one thread": {"OMP_NUM_THREADS": "1",
                                              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}}

_ENGINE = """
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt

def main():
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=1024, dtype="bfloat16", num_gpu_blocks_override=16)
    prompt = TokensPrompt(prompt_token_ids=list(range(1, 800)))
    params = SamplingParams(max_tokens=64, temperature=0.0)
    t0 = time.monotonic()
    for _ in range(int(sys.argv[2])):
        llm.generate([prompt], params, use_tqdm=False)
    print(MARK + json.dumps({"seconds": time.monotonic() - t0}), flush=True)

if __name__ == "__main__":
    main()
"""


def run_batch(layout: str, extra: dict[str, str], engines: int, generations: int,
              model: str) -> list[float]:
    """Each engine's generation seconds, ``engines`` processes started at once."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": LAYOUTS[layout], "VLLM_CPU_KVCACHE_SPACE": "1",
                "TORCHDYNAMO_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": str(REPO), **extra})
    code = f"MARK = {MARK!r}\n" + _ENGINE
    procs = [subprocess.Popen([sys.executable, "-c", code, model, str(generations)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(engines)]
    out = []
    for p in procs:
        text = p.communicate(timeout=1800)[0]
        line = next((x for x in text.splitlines() if x.startswith(MARK)), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"an engine failed (exit status {p.returncode}) in {layout}, {extra}")
        out.append(json.loads(line[len(MARK):])["seconds"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4, help="engines at once (the suite: 4)")
    ap.add_argument("--generations", type=int, default=15, help="generations per engine")
    ap.add_argument("--layouts", default="in-process,multi-process")
    args = ap.parse_args(argv)
    print(f"{os.cpu_count()} CPUs, {args.engines} engines at once, {args.generations} "
          "generations each (seconds of generation per engine)")
    with tempfile.TemporaryDirectory(prefix="kvplug-engine-threads-") as root:
        from kvplug.connector.demo.model import make_model

        model = str(make_model("tiny", root=Path(root)))  # once, before the engines start
        for layout in args.layouts.split(","):
            if layout not in LAYOUTS:
                ap.error(f"--layouts: {layout!r} is not one of {sorted(LAYOUTS)}")
            medians = {}
            for name, extra in ENVIRONMENTS.items():
                times = run_batch(layout, extra, args.engines, args.generations, model)
                medians[name] = statistics.median(times)
                print(f"  {layout:13} {name:10} " + " ".join(f"{t:6.1f}" for t in sorted(times)),
                      flush=True)
            print(f"  {layout:13} default / one thread: "
                  f"{medians['default'] / medians['one thread']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
