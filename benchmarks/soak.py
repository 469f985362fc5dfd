"""Soak: hours (or minutes) of traffic on one real vLLM engine with kvplug, looking for leaks.

Traffic: requests drawn from a fixed set of prompts that share prefixes at random (documents +
tails), several in flight at once, some aborted after a random number of engine steps; vLLM's KV
space is small (``--blocks``) so the scheduler preempts; kvplug's tiers are small (local_cpu
``--l1``, posix ``--disk``, and with ``--s3`` an fsspec tier on moto's server on 127.0.0.1) so
they evict all the time. Every finished request is compared with its prompt's reference (the same
engine, loading switched off for that request): tokens and logprobs must be identical.

Sampled over time (a CSV row every ``--sample-every`` requests): the worker's RSS, threads and
/proc task count, the L1 pool's use and live allocations, pins, extra references, background
loads. When traffic stops and the stores have drained: pins, extra references and in-flight loads
must be zero and the thread counts no higher than after the warm-up (the JSON summary's
``checks``; the exit status is 1 if one fails).

Memory (``soak_memory``): besides the RSS, glibc's heap in use and free (``mallinfo2``); with
``--trim`` the RSS after ``malloc_trim(0)``; with ``--tracemalloc`` Python's traced memory and, in
the summary, the sites that grew most. ``--no-kvplug`` is the control: the same traffic and engine
without a KV connector (vLLM's own curve).

Bounded: stops after ``--requests`` requests or ``--max-seconds`` seconds, whichever comes first.
Network: none but 127.0.0.1 (moto, with ``--s3``).

    python -m benchmarks.soak --requests 3000 --max-seconds 1200 --s3 --trim --tracemalloc \
        --out /tmp/soak
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import soak_memory as mem

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT = "SOAK-RESULT "
CHUNK = 256
#: Candidates a reference records per position: a near-tie may be between three tokens (seen:
#: prompt 3, token 15: the served token was the reference's third candidate, and the served run
#: gave it a logprob within 0.0005 of the reference's best).
REF_CANDIDATES = 5


# -- what the worker process reports (runs there through collective_rpc) -----------------------

def thread_kinds() -> dict[str, int]:
    """This process's threads by name, digits dropped (which pool a new thread belongs to)."""
    kinds: dict[str, int] = {}
    for t in threading.enumerate():
        name = "".join(c for c in t.name if not c.isdigit()).rstrip("-_ ") or "?"
        kinds[name] = kinds.get(name, 0) + 1
    return dict(sorted(kinds.items()))


def pool_headroom() -> int:
    """Threads this process's live thread pools may still start (they start them lazily)."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    pools = [o for o in gc.get_objects()  # type(), not isinstance(): a dead weak proxy raises
             if issubclass(type(o), ThreadPoolExecutor)]
    return sum(max(0, ex._max_workers - len(ex._threads)) for ex in pools if not ex._shutdown)


def worker_probe(_worker: Any = None, trim: bool = False) -> dict[str, Any]:
    """The worker's memory (:func:`soak_memory.memory_probe`), threads and everything kvplug
    holds for loads and stores (nothing of kvplug's without a KV connector: the control)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    out: dict[str, Any] = {
        **mem.memory_probe(trim), "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")), "thread_kinds": thread_kinds(),
        "pool_headroom": pool_headroom(),
    }
    if not has_kv_transfer_group():
        return out
    w = get_kv_transfer_group()._worker
    mgr = w.storage
    out.update(worker_pins=sum(len(keys) for keys, _ in w._pins.values()),
               background=len(w._background) if w._background is not None else 0)
    pinned = pending = 0.0
    for name, st in mgr.stats().items():
        pinned += st.get("pinned", 0)
        pending += st.get("pending_writes", 0)
        if name == "local_cpu":
            l1 = mgr.backend("local_cpu")
            with l1._lock:
                entries = list(l1._entries.values())
                pool = l1.pool.stats()
            out.update(l1_entries=len(entries), l1_bytes=st["bytes"], l1_capacity=st["capacity"],
                       pool_used=pool.used, pool_live=pool.num_allocations,
                       extra_refs=sum(o.ref_count - 1 for o in entries),
                       l1_evictions=st.get("evictions", 0))
    out.update(tier_pins=pinned, pending_writes=pending,
               read_heap_fallbacks=getattr(mgr, "read_heap_fallbacks", 0))
    return out


# -- traffic -------------------------------------------------------------------------------------

def make_prompts(n_docs: int, n_prompts: int, seed: int, vocab: int = 4096) -> list[list[int]]:
    """``n_prompts`` prompts over ``n_docs`` shared documents: doc + (sometimes a second doc) +
    a private tail; lengths so a prompt covers 1-4 chunks plus a partial one."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, vocab) for _ in range(rng.choice((128, 256, 384, 512)))]
            for _ in range(n_docs)]
    prompts = []
    for _ in range(n_prompts):
        p = list(rng.choice(docs))
        if rng.random() < 0.3:
            p += rng.choice(docs)
        p += [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 300))]
        prompts.append(p)
    return prompts


def compare(toks: list[int], lps: list[float], ref: tuple[list[int], list[float], list[dict]],
            tol: float) -> tuple[str, float]:
    """``("exact"|"close"|"tie"|"wrong", largest logprob difference)`` of an output against its
    reference (tokens, logprobs, its best ``REF_CANDIDATES`` candidates per position).

    Batches of different shapes round differently in bf16 on CPU, so logprobs may differ by a
    little (``close``: every token equal, every logprob within ``tol``); where another of the
    reference's candidates was within ``2 * tol`` of its best, such noise may pick that one and
    the answers part from there (``tie``: equal and close up to that token, which is one of the
    reference's candidates). Anything else is ``wrong``."""
    ref_t, ref_l, ref_top = ref
    diff = 0.0
    for j, (t, lp) in enumerate(zip(toks, lps)):
        if t != ref_t[j]:
            alt = ref_top[j].get(t)
            # both runs carry up to ``tol`` of noise: a gap of up to 2 * tol can flip
            tie = alt is not None and abs(alt - ref_l[j]) <= 2 * tol and abs(lp - alt) <= tol
            return ("tie" if tie else "wrong"), diff
        diff = max(diff, abs(lp - ref_l[j]))
        if diff > tol:
            return "wrong", diff
    return ("exact" if diff == 0.0 else "close"), diff


def _preemptions(llm: Any) -> int:
    """vLLM's own count of preempted requests (its metrics), -1 if it has none."""
    for m in llm.get_metrics():
        if "preempt" in m.name:
            return int(getattr(m, "value", 0))
    return -1


def _tiers(args: argparse.Namespace, work: Path, s3_url: str | None,
           s3_opts: dict[str, Any] | None) -> list[dict[str, Any]]:
    tiers: list[dict[str, Any]] = [
        {"backend": "local_cpu", "options": {"capacity": args.l1}},
        {"backend": "posix", "options": {"path": str(work / "chunks"), "capacity": args.disk}},
    ]
    if s3_url:
        tiers.append({"backend": "fsspec", "timeout_s": 10.0,
                      "options": {"url": s3_url, "storage_options": s3_opts, "timeout_s": 8.0,
                                  "capacity": args.s3_capacity}})
    return tiers


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole soak in this process (the engine's core and worker in their own)."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(probe)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    from kvplug.connector.demo.model import make_model
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    from benchmarks import soak as me  # the probe by module name, importable in the engine's processes

    work = Path(args.work or tempfile.mkdtemp(prefix="kvplug-soak-"))
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvplug-soak-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    server = s3_url = s3_opts = None
    if args.s3 and not args.no_kvplug:
        from tests.support.s3_server import CREDENTIALS, MotoServer, S3Env

        for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                     ("AWS_DEFAULT_REGION", "us-east-1")):
            os.environ[k] = v
        server = MotoServer()  # 127.0.0.1, in this process
        env = S3Env(server)
        env.create_bucket()
        s3_url, s3_opts = env.url("soak"), {"endpoint_url": env.endpoint, **CREDENTIALS}

    model = args.model or make_model("tiny", root=work / "models")
    kv = None if args.no_kvplug else KVTransferConfig(
        kv_connector="KVPlugConnector", kv_connector_module_path=args.connector_module,
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"report_to_client": True,
                                   "tiers": _tiers(args, work, s3_url, s3_opts)})
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=min(2048, (args.blocks - 1) * 128),
              max_num_batched_tokens=CHUNK,
              max_num_seqs=args.max_seqs, dtype="bfloat16", seed=0, disable_log_stats=False,
              num_gpu_blocks_override=args.blocks, kv_transfer_config=kv)
    eng = llm.llm_engine
    rng = random.Random(args.seed)
    prompts = make_prompts(args.docs, args.prompts, args.seed)

    def params(n: int, load: bool = True) -> SamplingParams:
        extra = None if load or kv is None else {
            "extra_args": {"kv_transfer_params": {"kvplug_load": False}}}
        return SamplingParams(temperature=0.0, max_tokens=n, logprobs=0 if load else REF_CANDIDATES,
                              ignore_eos=True, **(extra or {}))

    t_start = time.monotonic()
    # references: every prompt once, loading off (also the warm-up: every tier stores and evicts)
    refs: dict[int, tuple[list[int], list[float], list[dict[int, float]]]] = {}
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        [params(args.max_tokens, load=False)] * len(prompts), use_tqdm=False)
    for i, o in enumerate(outs):
        c = o.outputs[0]
        refs[i] = (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                   [{t: x.logprob for t, x in lp.items()} for lp in c.logprobs])

    samples: list[dict[str, float]] = []

    def sample(done: int) -> dict[str, float]:
        row = {"t_s": round(time.monotonic() - t_start, 1), "requests": done,
               "driver_rss_kib": mem.proc_status("VmRSS"), "driver_threads": threading.active_count(),
               **llm.collective_rpc(me.worker_probe, args=(args.trim,))[0]}
        samples.append(row)
        return row

    weights = [1.0 / (1 + i) for i in range(len(prompts))]  # some prompts much more popular
    inflight: dict[str, dict[str, Any]] = {}
    counts = {"submitted": 0, "finished": 0, "aborted": 0, "wrong": 0, "hit_requests": 0,
              "loaded_tokens": 0, "failed_blocks": 0, "prompt_tokens": 0, "exact": 0,
              "close": 0, "tie": 0}
    max_diff = 0.0
    by_tier: dict[str, int] = {}
    wrong_examples: list[dict[str, Any]] = []
    warm: dict[str, float] | None = None  # the baseline, sampled when the warm-up ends
    traced_base: int | None = None  # requests done when tracemalloc's base snapshot was taken
    deadline = t_start + args.max_seconds
    next_sample = args.sample_every
    steps = 0
    while True:
        stop_new = counts["submitted"] >= args.requests or time.monotonic() > deadline
        while not stop_new and len(inflight) < args.concurrency:
            i = rng.choices(range(len(prompts)), weights)[0]
            rid = f"r{counts['submitted']}"
            n = rng.randint(1, args.max_tokens)
            abort_at = steps + rng.randint(0, 6) if rng.random() < args.abort_rate else None
            eng.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), params(n))
            inflight[rid] = {"i": i, "abort_at": abort_at}
            counts["submitted"] += 1
            counts["prompt_tokens"] += len(prompts[i])
        if not inflight:
            break
        to_abort = [r for r, v in inflight.items()
                    if v["abort_at"] is not None and v["abort_at"] <= steps]
        if to_abort:
            eng.abort_request(to_abort)
            for r in to_abort:
                inflight.pop(r)
            counts["aborted"] += len(to_abort)
        for o in eng.step():
            if not o.finished or o.request_id not in inflight:
                continue
            i = inflight.pop(o.request_id)["i"]
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            counts["finished"] += 1
            verdict, diff = compare(toks, lps, refs[i], args.logprob_tol)
            max_diff = max(max_diff, diff)
            counts[verdict] += 1
            if verdict == "wrong" and len(wrong_examples) < 5:
                j = next((k for k, t in enumerate(toks) if t != refs[i][0][k]), None)
                wrong_examples.append({"request": o.request_id, "prompt": i, "tokens": toks,
                                       "ref": refs[i][0][:len(toks)], "first_diff": j,
                                       "served_logprob": None if j is None else lps[j],
                                       "ref_top2": None if j is None else refs[i][2][j]})
            rep = (o.kv_transfer_params or {}).get("kvplug") or {}
            if rep.get("loaded_tokens"):
                counts["hit_requests"] += 1
                counts["loaded_tokens"] += rep["loaded_tokens"]
                for t, n in (rep.get("tiers") or {}).items():
                    by_tier[t] = by_tier.get(t, 0) + n
            counts["failed_blocks"] += rep.get("failed_blocks", 0) or 0
        steps += 1
        done = counts["finished"] + counts["aborted"]
        if warm is None and done >= args.warmup:
            warm = sample(done)
            if args.tracemalloc:  # from here on; growth is measured from one interval later
                llm.collective_rpc(mem.start_tracing)
        if (args.tracemalloc and warm is not None and traced_base is None
                and done >= warm["requests"] + args.sample_every):
            llm.collective_rpc(mem.mark_base)
            traced_base = done
        if done >= next_sample:
            next_sample += args.sample_every
            row = sample(done)
            if args.verbose:
                print(json.dumps(row), flush=True)
    traffic_s = time.monotonic() - t_start

    # settle: stores drain, background loads end (bounded only to catch a hang)
    end = time.monotonic() + 120
    final = sample(counts["finished"] + counts["aborted"])
    while (final.get("pending_writes") or final.get("background")) and time.monotonic() < end:
        time.sleep(0.5)
        final = llm.collective_rpc(me.worker_probe)[0]
    final = sample(counts["finished"] + counts["aborted"])
    warm = warm or samples[0]
    preempt = _preemptions(llm)
    py_growth = llm.collective_rpc(mem.growth)[0] if args.tracemalloc else []

    rss = [s["rss_kib"] for s in samples]
    half = len(rss) // 2

    def no_growth(row: dict[str, Any]) -> bool:
        """The worker's threads may only have filled pools that existed after the warm-up: live
        threads plus the pools' unstarted slots do not grow, nor do native threads."""
        return (row["threads"] + row["pool_headroom"] <= warm["threads"] + warm["pool_headroom"]
                and row["tasks"] - row["threads"] <= warm["tasks"] - warm["threads"])

    checks = {
        "wrong_outputs_zero": counts["wrong"] == 0,
        "compared_all": counts["exact"] + counts["close"] + counts["tie"] + counts["wrong"]
        == counts["finished"],
        # the driver's moto server starts a thread per connection: compared once traffic stopped
        "no_thread_growth": all(no_growth(r) for r in samples[samples.index(warm):])
        and final["driver_threads"] <= warm["driver_threads"],
    }
    kvplug_checks = {  # what kvplug holds (none of it in the control, --no-kvplug)
        "pins_zero": final["worker_pins"] == 0 and final["tier_pins"] == 0,
        # every L1 entry holds one reference; the pool holds nothing L1 does not store (entries
        # read into heap memory when the pool was full may sit in L1 outside the pool)
        "extra_references_zero": final["extra_refs"] == 0
        and final["pool_live"] <= final["l1_entries"] and final["pool_used"] <= final["l1_bytes"],
        "background_loads_zero": final["background"] == 0 and final["pending_writes"] == 0,
        "l1_within_capacity": max(s["pool_used"] for s in samples) <= warm["l1_capacity"],
    } if not args.no_kvplug else {}
    checks.update(kvplug_checks)
    summary = {
        "args": vars(args), "traffic_s": round(traffic_s, 1), "steps": steps, **counts,
        "preemptions": preempt, "max_logprob_diff": max_diff, "hits_by_tier": by_tier,
        "requests_per_s": round((counts["finished"] + counts["aborted"]) / traffic_s, 2),
        "rss_kib": {"warm": warm["rss_kib"], "min": min(rss), "max": max(rss),
                    "final": final["rss_kib"],
                    "max_first_half": max(rss[:half] or rss), "max_second_half": max(rss[half:])},
        "threads": {"warm": warm["threads"], "final": final["threads"],
                    "headroom_warm": warm["pool_headroom"], "headroom_final": final["pool_headroom"],
                    "max": max(s["threads"] for s in samples),
                    "max_first_half": max(s["threads"] for s in samples[:half] or samples),
                    "kinds_warm": warm["thread_kinds"], "kinds_final": final["thread_kinds"]},
        "tasks": {"warm": warm["tasks"], "final": final["tasks"]},
        "driver_threads": {"warm": warm["driver_threads"], "final": final["driver_threads"]},
        "memory": mem.curve(samples[samples.index(warm):]), "python_growth": py_growth,
        "pool_used_max": max((s.get("pool_used", 0) for s in samples), default=0),
        "final": final,
        "checks": checks, "ok": all(checks.values()), "wrong_examples": wrong_examples,
        "csv": str(out_dir / "soak_samples.csv"),
    }
    with open(out_dir / "soak_samples.csv", "w", newline="") as fh:
        cols = list(dict.fromkeys(k for s in samples for k in s if k != "thread_kinds"))
        wr = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(samples)
    (out_dir / "soak_summary.json").write_text(json.dumps(summary, indent=1))
    if server is not None:
        server.stop()
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="stop after this many requests")
    ap.add_argument("--max-seconds", type=float, default=1200, help="... or after this long")
    ap.add_argument("--concurrency", type=int, default=12, help="requests in flight")
    ap.add_argument("--max-seqs", type=int, default=8, help="vLLM max_num_seqs")
    ap.add_argument("--blocks", type=int, default=16, help="vLLM KV blocks (128 tokens each)")
    ap.add_argument("--docs", type=int, default=16, help="shared documents")
    ap.add_argument("--prompts", type=int, default=48, help="distinct prompts")
    ap.add_argument("--max-tokens", type=int, default=32, help="longest answer")
    ap.add_argument("--abort-rate", type=float, default=0.1, help="share of requests aborted")
    ap.add_argument("--l1", default="8MiB", help="local_cpu capacity (512 KiB per chunk)")
    ap.add_argument("--disk", default="24MiB", help="posix capacity")
    ap.add_argument("--s3", action="store_true", help="add an fsspec tier on moto (127.0.0.1)")
    ap.add_argument("--s3-capacity", default="48MiB", help="fsspec capacity")
    ap.add_argument("--sample-every", type=int, default=100, help="requests between samples")
    ap.add_argument("--warmup", type=int, default=200,
                    help="requests before the baseline sample (thread pools fill up)")
    ap.add_argument("--logprob-tol", type=float, default=0.05,
                    help="largest logprob difference to the reference that is not wrong: "
                    "batches of different shapes round differently in bf16 on CPU")
    ap.add_argument("--connector-module", default="kvplug.connector",
                    help="kv_connector_module_path (tests.support.permuted_load: the negative control)")
    ap.add_argument("--model", default=None,
                    help="a model folder (default: the demo's tiny model, built in --work)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="working directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="where the CSV and JSON go (default: --work)")
    ap.add_argument("--verbose", action="store_true", help="print every sample")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="trace the worker's Python allocations from the warm-up on; the summary "
                    "lists the sites that grew most (python_growth)")
    ap.add_argument("--trim", action="store_true",
                    help="malloc_trim(0) the worker at each sample and record its RSS after "
                    "(rss_trimmed_kib): growth that trimming gives back is glibc's free memory")
    ap.add_argument("--no-kvplug", action="store_true",
                    help="the control: the same traffic and engine without a KV connector")
    args = ap.parse_args(argv)
    summary = run(args)
    print(RESULT + json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
