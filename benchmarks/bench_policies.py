"""Eviction and admission policies on recorded and generated traffic, each against LRU/always in
the same run: hit tokens, and bytes written to each tier.

    .venv/bin/python -m benchmarks.bench_policies [--traces chat,zipf,scan] [--dir /dev/shm/x]
        [--chunk-kib 64] [--json FILE]

Each trace is a list of requests, each a chain of chunk ids (a prefix: chunk i's key covers every
earlier token, as kvplug's chunk hashes do). A request is replayed through a real StorageManager
with real tiers — ``local_cpu`` (L1) in front of ``posix`` on a RAM disk — as the connector drives
it: ``lookup_prefix`` (pinning), ``batched_get`` of the hit prefix, unpin, then the chunks after
it are "computed" (an object from L1's pool) and stored with ``batched_put``; the posix tier's
writes are waited for after each request, so every run sees the same order. Every chunk is
``--chunk-kib`` of bytes and counts as 256 tokens.

Traces:

* ``chat``: ``benchmarks/traces/chat_small.json`` (a real vLLM engine's lookups: system prompt,
  multi-turn conversations, shared documents), replayed ``--chat-passes`` times; the 10% of ids
  the most lookups ask for (the system prompt) are the same in every pass, the rest are new users
  each pass. A lookup that repeats the previous one within 2 s (vLLM asking again for one
  request) is the same request, not another.
* ``zipf``: ``--tenants`` tenants (each its own system prompt of 2 chunks, so each tenant's
  chunks are its own: the chain covers the prompt), ``--docs`` documents of 4 chunks picked by
  Zipf(``--zipf-s``), each request ending in a one-off question chunk; tenants picked by Zipf too.
* ``scan``: a hot set (``--hot`` prompts of 3 chunks) asked round-robin, then a batch job's scan
  of ``--scan`` one-off prompts of 3 chunks with one hot request every 10; then the hot set
  again. "hot hits after scan" is the share of the hot set's tokens served in that last round.

Policies, on both tiers: eviction ``lru`` or ``s3fifo``; admission on the disk tier: ``always``,
``tinylfu`` (min_count 2: a chunk is written when it is computed a second time) or
``tinylfu+on_load`` (also written when its second use is a load from L1). Tier sizes
(``--chat-l1``, ``--chat-disk``, ``--zipf-l1``...: chunks) are set below each trace's working
set, where policies matter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402
from kvplug.keys import CacheKey  # noqa: E402
from kvplug.memory import MemoryFormat  # noqa: E402
from kvplug.storage_manager import StorageManager  # noqa: E402

from benchmarks.fleet_trace import hottest
from benchmarks.fleet_trace import load as load_trace

TOKENS_PER_CHUNK = 256
#: (eviction on both tiers, admission on the disk tier): the first is the baseline (as before)
POLICIES = [("lru", "always"), ("s3fifo", "always"), ("lru", "tinylfu"), ("s3fifo", "tinylfu"),
            ("lru", "tinylfu+on_load")]
ADMISSION = {"always": {"policy": "always"}, "tinylfu": {"policy": "tinylfu"},
             "tinylfu+on_load": {"policy": "tinylfu", "on_load": True}}


def key_of(chunk: int) -> CacheKey:
    return CacheKey("bench/policies", "bfloat16", "LBHNC-bs16", 1, 0, chunk.to_bytes(8, "big"))


# -- traffic ---------------------------------------------------------------------------------------
class Ids:
    """Distinct chunk ids for chains: ``of(path)`` names the chunk at the end of ``path`` (a
    tuple of what the chain covers), the same id for the same path."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def of(self, path: tuple) -> int:
        return self._ids.setdefault(path, len(self._ids))

    def chain(self, parts: list) -> list[int]:
        return [self.of(tuple(parts[: i + 1])) for i in range(len(parts))]


def chat_requests(path: str, passes: int) -> list[tuple[str, list[int]]]:
    trace = load_trace(path)
    shared = hottest(trace, 0.1)
    lookups, last = [], None
    for t, op, ids, _ in trace["events"]:
        if op != "L":
            continue
        if last is not None and last[1] == ids and t - last[0] < 2000:
            continue
        lookups.append(ids)
        last = (t, ids)
    out = []
    n = trace["num_ids"]
    for p in range(passes):
        for ids in lookups:
            out.append(("chat", [i if i in shared else i + n * (p + 1) for i in ids]))
    return out


def zipf_requests(n: int, tenants: int, docs: int, s: float, seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    ids = Ids()

    def zipf(k: int) -> list[float]:
        return [1 / (r + 1) ** s for r in range(k)]

    tw, dw = zipf(tenants), zipf(docs)
    out = []
    for q in range(n):
        t = rng.choices(range(tenants), tw)[0]
        d = rng.choices(range(docs), dw)[0]
        parts = [("sys", t, 0), ("sys", t, 1), *[("doc", d, j) for j in range(4)], ("q", q)]
        out.append((f"t{t}", ids.chain(parts)))
    return out


def scan_requests(hot: int, scan: int, rounds: int) -> list[tuple[str, list[int]]]:
    ids = Ids()

    def prompt(kind: str, i: int) -> list[int]:
        return ids.chain([(kind, i, j) for j in range(3)])

    out = [("warm", prompt("hot", i % hot)) for i in range(hot * rounds)]
    h = 0
    for i in range(scan):
        out.append(("scan", prompt("scan", i)))
        if i % 10 == 9:
            out.append(("during", prompt("hot", h % hot)))
            h += 1
    out += [("after", prompt("hot", i)) for i in range(hot)]
    return out


# -- replay ----------------------------------------------------------------------------------------
def replay(requests: list[tuple[str, list[int]]], eviction: str, admission: str, root: Path,
           l1_chunks: int, disk_chunks: int, chunk_bytes: int) -> dict:
    shape = (2, 2, chunk_bytes // 4)
    tiers = [
        {"backend": "local_cpu", "options": {"capacity": l1_chunks * chunk_bytes, "prefault": False},
         "eviction": eviction},
        # a chunk file is its bytes plus a 4 KiB-aligned header
        {"backend": "posix", "options": {"path": str(root), "capacity": disk_chunks * (chunk_bytes + 4096)},
         "eviction": eviction, "admission": ADMISSION[admission]},
    ]
    hits = {"all": 0}
    asked = {"all": 0}
    t0 = time.perf_counter()
    with StorageManager({"tiers": tiers, "chunk_size": TOKENS_PER_CHUNK}) as mgr:
        assert mgr.backend("posix").wait_indexed(60)
        for label, chain in requests:
            keys = [key_of(i) for i in chain]
            look = mgr.lookup_prefix(keys, pin=True)
            n = look.num_chunks
            if n:
                for obj in mgr.batched_get(keys[:n]):
                    if obj is None:
                        raise AssertionError("a chunk lookup pinned could not be read")
                    obj.ref_down()
                mgr.unpin(keys[:n], look.tiers)
            new = []
            for key in keys[n:]:
                obj = mgr.allocate(shape, torch.uint8, MemoryFormat.KV_PAGES, TOKENS_PER_CHUNK)
                if obj is None:
                    raise AssertionError("L1 has no room for a chunk being computed")
                obj.byte_view[:8].copy_(torch.frombuffer(bytearray(key.chunk_hash), dtype=torch.uint8))
                new.append(obj)
            mgr.batched_put(keys[n:], new)
            for obj in new:
                obj.ref_down()
            mgr.flush(60)
            for k in ("all", label):
                hits[k] = hits.get(k, 0) + n * TOKENS_PER_CHUNK
                asked[k] = asked.get(k, 0) + len(keys) * TOKENS_PER_CHUNK
        stats = mgr.stats()
    return {
        "eviction": eviction, "admission": admission,
        "hit_tokens": hits["all"], "asked_tokens": asked["all"],
        "hits_by_label": hits, "asked_by_label": asked,
        "l1_bytes_written": stats["local_cpu"]["bytes_written"],
        "disk_bytes_written": stats["posix"]["disk_bytes_written"],
        "disk_writes": stats["posix"]["writes"],
        "disk_rejected": stats["posix"].get("admission_rejected", 0),
        "disk_late": stats["posix"].get("admission_late", 0),
        "seconds": time.perf_counter() - t0,
    }


def table(name: str, rows: list[dict], extra: str | None = None) -> str:
    base = rows[0]
    head = ("| eviction / admission (disk) | hit tokens | vs lru/always | L1 MiB written | disk MiB "
            "written | vs lru/always | disk files refused / written late |")
    lines = [f"**{name}** ({base['asked_tokens']:,} tokens asked)", "", head,
             "|---|---|---|---|---|---|---|"]
    if extra:
        lines[2] = head + f" {extra} |"
        lines[3] += "---|"
    for r in rows:
        cells = [f"{r['eviction']} / {r['admission']}", f"{r['hit_tokens']:,}",
                 f"{r['hit_tokens'] / max(1, base['hit_tokens']) - 1:+.1%}",
                 f"{r['l1_bytes_written'] / 2**20:,.0f}", f"{r['disk_bytes_written'] / 2**20:,.0f}",
                 f"{r['disk_bytes_written'] / max(1, base['disk_bytes_written']) - 1:+.1%}",
                 f"{r['disk_rejected']:.0f} / {r['disk_late']:.0f}"]
        if extra:
            h, a = r["hits_by_label"].get("after", 0), r["asked_by_label"].get("after", 1)
            cells.append(f"{h / a:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="chat,zipf,scan")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--chunk-kib", type=int, default=64)
    ap.add_argument("--chat-trace", default=str(Path(__file__).parent / "traces" / "chat_small.json"))
    ap.add_argument("--chat-passes", type=int, default=8)
    ap.add_argument("--chat-l1", type=int, default=16, help="L1 chunks (chat)")
    ap.add_argument("--chat-disk", type=int, default=64, help="disk chunks (chat)")
    ap.add_argument("--requests", type=int, default=3000, help="zipf requests")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--docs", type=int, default=300)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--zipf-l1", type=int, default=64)
    ap.add_argument("--zipf-disk", type=int, default=512)
    ap.add_argument("--hot", type=int, default=20)
    ap.add_argument("--scan", type=int, default=600)
    ap.add_argument("--scan-l1", type=int, default=24)
    ap.add_argument("--scan-disk", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chunk_bytes = args.chunk_kib * 1024
    traces = {
        "chat": (lambda: chat_requests(args.chat_trace, args.chat_passes), args.chat_l1, args.chat_disk),
        "zipf": (lambda: zipf_requests(args.requests, args.tenants, args.docs, args.zipf_s, args.seed),
                 args.zipf_l1, args.zipf_disk),
        "scan": (lambda: scan_requests(args.hot, args.scan, 4), args.scan_l1, args.scan_disk),
    }
    results: dict[str, list[dict]] = {}
    for name in args.traces.split(","):
        make, l1, disk = traces[name]
        requests = make()
        distinct = len({i for _, c in requests for i in c})
        print(f"## {name}: {len(requests)} requests, {distinct} distinct chunks; L1 {l1} chunks, "
              f"disk {disk} chunks of {args.chunk_kib} KiB", flush=True)
        rows = []
        for eviction, admission in POLICIES:
            root = Path(tempfile.mkdtemp(prefix="kvplug-bench-policies-", dir=args.dir))
            try:
                rows.append(replay(requests, eviction, admission, root, l1, disk, chunk_bytes))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"  {eviction}/{admission}: {rows[-1]['seconds']:.1f}s", file=sys.stderr, flush=True)
        results[name] = rows
        print(table(name, rows, "hot hits after scan" if name == "scan" else None), flush=True)
        print(flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
