"""A fleet on one machine: N client processes replay a recorded engine's storage traffic against
one shared store, N stepped, to find where the store saturates and what kvplug does then.

    .venv/bin/python -m benchmarks.bench_fleet [--stores resp,mooncake] [--clients 1,2,4,8,16,32]
        [--duration 12] [--max-events 100000] [--shared 0.1] [--speed 0] [--timeout-s 2]
        [--saturate-timeout 0.05] [--l1 32MiB] [--ops LGP] [--negative-cache-s S]
        [--trace benchmarks/traces/chat_small.json] [--json FILE] [--keep-logs DIR]

* The trace (``benchmarks/fleet_trace.py``) is what one real vLLM engine asked of kvplug: lookups
  (chunk keys), loads and stores (chunk sizes), in order. Each client process is one "engine": a
  StorageManager with its own L1 (``local_cpu``, ``--l1``) in front of the shared store, as an
  engine's worker has, and no engine: it replays the trace's calls (``lookup_prefix``,
  ``batched_get``, ``batched_put``) back to back (``--speed 0``: as fast as the store answers, to
  saturate it) or at ``--speed`` times the recorded pace, looping until ``--duration`` seconds or
  ``--max-events`` calls. The chunk ids of the trace become keys per engine: the ``--shared``
  share of ids that most lookups ask for (the system prompt, shared documents) are common to all
  engines, the rest private to one engine and to one pass over the trace (each pass is new users).
* Stores, fresh for each step, on 127.0.0.1 only: a ``redis-server`` (``--maxmemory``,
  ``allkeys-lru``) for the ``resp`` tier; a ``mooncake_master`` plus one storage process lending
  ``--mooncake-segment`` of memory for the ``mooncake`` tier (clients lend only
  ``--client-segment``, as engines in front of dedicated storage nodes). Mooncake's clients
  listen on every interface, so with mooncake the script re-runs itself in a private network
  namespace (``unshare -n``; root).
* Reported per step: lookups/s (calls and keys), GB/s stored (written by the tier's writers) and
  loaded (from the store, and from L1), p50/p99 latency of each call kind as the caller sees it
  (a store is queued: its latency is the submit), the share of loads that missed, of store calls
  that timed out or found the breaker open, of stores dropped, and the errors that reached the
  caller (must be 0: kvplug turns a saturated store into misses), where lookup hits and loads
  came from (L1 or store, shared or private ids), the CPU of the store's processes and of the
  clients, and how many engines' traffic (at the recorded pace) the step carried; each figure
  also as a ratio to the single-client step of the same run; redis-server's own per-command
  costs (``INFO commandstats``) and evictions. ``--saturate-timeout T`` adds a step at the
  largest N with the tier's ``timeout_s`` at T seconds: bounded latency at saturation.
  ``--ops L`` / ``--ops GP`` with ``--l1 0`` replay only lookups / only loads and stores with no
  L1, for the store's cost per call.

Raw figures are bound to this machine (2 shared cores run the store, the clients and the
benchmark); the ratios between steps of one run are what carries over.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

import torch  # noqa: E402
from kvplug.keys import CacheKey  # noqa: E402
from kvplug.memory import MemoryFormat, heap_memory_obj  # noqa: E402
from kvplug.storage_manager import StorageManager  # noqa: E402

from benchmarks import fleet_trace  # noqa: E402
from benchmarks.fleet_report import KINDS, STORE_STATS, merge, report  # noqa: E402


# -- the replay (one engine) --------------------------------------------------------------------
def chunk_key(engine: int, loop: int, chunk: int, shared: bool) -> CacheKey:
    """The store key of a trace chunk id for one engine and pass (shared ids: the same for all)."""
    name = f"s:{chunk}" if shared else f"e{engine}:p{loop}:{chunk}"
    return CacheKey("fleet/replay", "bfloat16", "LBHNC-bs128", 1, 0,
                    hashlib.blake2b(name.encode(), digest_size=32).digest())


class Replayer:
    """Replays a trace's calls on one StorageManager, counting calls, keys, hits, bytes, latency
    per kind, and the exceptions that reached the caller (``errors``)."""

    def __init__(self, mgr: StorageManager, trace: dict, engine: int, shared: set[int],
                 seed: int = 0) -> None:
        self.mgr, self.trace, self.engine, self.shared = mgr, trace, engine, shared
        self.store = mgr.tier_names[-1]
        sizes = [b for ev in trace["events"] if ev[1] != "L" for b in ev[3]] or [1]
        gen = torch.Generator().manual_seed(seed * 7919 + engine)
        self._src = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8, generator=gen)
        self.lat: dict[str, list[float]] = {k: [] for k in KINDS}
        self.n: dict[str, float] = dict.fromkeys(
            ("lookup_calls", "lookup_keys", "lookup_found", "found_l1_shared",
             "found_store_shared", "found_l1_private", "found_store_private", "get_calls",
             "get_keys", "get_hits", "get_bytes", "get_l1_shared", "get_store_shared",
             "get_l1_private", "get_store_private", "put_calls", "put_keys", "put_bytes",
             "errors", "events", "passes", "trace_s"), 0)
        self.elapsed = 0.0

    def _obj(self, nbytes: int):  # noqa: ANN202 - MemoryObj
        obj = self.mgr.allocate((nbytes,), torch.uint8, MemoryFormat.KV_PAGES,
                                num_tokens=max(1, nbytes // 6144))
        if obj is None:
            obj = heap_memory_obj((nbytes,), torch.uint8, num_tokens=max(1, nbytes // 6144))
        obj.byte_view.copy_(self._src[:nbytes])
        return obj

    def _l1_holds(self, keys: list[CacheKey]) -> list[bool]:
        """Which keys L1 holds now (a call that never blocks and leaves its LRU order alone): a load of
        them is an L1 hit, of the others a store read."""
        if len(self.mgr.tier_names) < 2:
            return [False] * len(keys)
        return self.mgr.holds(self.mgr.tier_names[0], keys) or [False] * len(keys)

    def _one(self, op: str, keys: list[CacheKey], extra: Any, shared: list[bool]) -> None:
        n = self.n
        if op == "L":
            t = time.perf_counter()
            found = self.mgr.lookup_prefix(keys)
            self.lat["lookup"].append(time.perf_counter() - t)
            n["lookup_calls"] += 1
            n["lookup_keys"] += len(keys)
            n["lookup_found"] += found.num_chunks
            for where, sh in zip(found.tiers, shared):
                place = "store" if where == self.store else "l1"
                n[f"found_{place}_{'shared' if sh else 'private'}"] += 1
        elif op == "G":
            local = self._l1_holds(keys)
            t = time.perf_counter()
            got = self.mgr.batched_get(keys)
            self.lat["get"].append(time.perf_counter() - t)
            n["get_calls"] += 1
            n["get_keys"] += len(keys)
            for obj, in_l1, sh in zip(got, local, shared):
                if obj is not None:
                    n[f"get_{'l1' if in_l1 else 'store'}_{'shared' if sh else 'private'}"] += 1
                    n["get_hits"] += 1
                    n["get_bytes"] += obj.nbytes
                    obj.ref_down()
        else:
            objs = [self._obj(b) for b in extra]
            t = time.perf_counter()
            self.mgr.batched_put(keys, objs)
            self.lat["put"].append(time.perf_counter() - t)
            for obj in objs:
                obj.ref_down()
            n["put_calls"] += 1
            n["put_keys"] += len(keys)
            n["put_bytes"] += sum(extra)

    def run(self, duration_s: float, max_events: int, speed: float = 0.0,
            max_passes: int | None = None, ops: str = "LGP") -> None:
        """Replay until ``duration_s``, ``max_events`` calls or ``max_passes`` passes; paced at
        ``speed`` times the recorded rate (0: back to back); only the kinds in ``ops``."""
        events = [ev for ev in self.trace["events"] if ev[1] in ops]
        span = (events[-1][0] if events else 0.0) / 1e3
        start = time.monotonic()
        deadline = start + duration_s
        p = 0
        while max_passes is None or p < max_passes:
            for t_ms, op, ids, extra in events:
                now = time.monotonic()
                if now >= deadline or self.n["events"] >= max_events:
                    self.elapsed = now - start
                    return
                if speed > 0:
                    due = start + (p * span + t_ms / 1e3) / speed
                    if due > now:
                        time.sleep(min(due - now, deadline - now))
                shared = [i in self.shared for i in ids]
                keys = [chunk_key(self.engine, p, i, s) for i, s in zip(ids, shared)]
                try:
                    self._one(op, keys, extra, shared)
                except Exception:  # noqa: BLE001 - what vLLM would see: counted, must stay 0
                    self.n["errors"] += 1
                    logging.getLogger("bench_fleet").exception("replayed %s raised", op)
                self.n["events"] += 1
                self.n["trace_s"] = p * span + t_ms / 1e3  # recorded time replayed so far
            p += 1
            self.n["passes"] = p
        self.elapsed = time.monotonic() - start

    def result(self) -> dict:
        stats = self.mgr.stats()
        store = stats[self.store]
        l1 = stats[self.mgr.tier_names[0]] if len(self.mgr.tier_names) > 1 else {}
        return {"n": self.n, "lat": self.lat, "elapsed": self.elapsed,
                "store": {k: float(store.get(k, 0.0)) for k in STORE_STATS},
                "l1_hits": float(l1.get("hits", 0.0))}


# -- the fleet (processes, servers) -------------------------------------------------------------
def store_tier(store: str, address: str, timeout_s: float, client_segment: str = "16MiB",
               **opts: Any) -> dict:
    """The shared store's tier config (``address``: a redis URL or a mooncake master). A
    mooncake client lends ``client_segment`` (with none, Mooncake 0.3.13's TCP transfers fail
    part of the puts: "Local segment descriptor not found", -600)."""
    if store == "resp":
        options = {"url": address}
    else:
        options = {"master": address, "global_segment_size": client_segment}
    options.update(timeout_s=timeout_s, **opts)
    return {"backend": store, "name": "store", "timeout_s": timeout_s * 2 + 0.5,
            "options": options}


def _stderr_to(path: str) -> None:
    """Send this process's stderr (Mooncake's C++ logs a line per failed put) to a file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _client(idx: int, cfg: dict, trace_path: str, shared: list[int], args: dict,
            ready: Any, go: Any, out: Any) -> None:
    _stderr_to(os.path.join(args["logdir"], f"client-{idx}.log"))
    torch.set_num_threads(1)
    logging.getLogger("kvplug").setLevel(logging.ERROR)
    try:
        mgr = StorageManager(cfg)
        rep = Replayer(mgr, fleet_trace.load(trace_path), idx, set(shared), args["seed"])
        if mgr.holds("store", [chunk_key(idx, -1, 0, False)]) is None:  # connects, untimed
            raise RuntimeError("the store did not answer a first lookup")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put({"client": idx, "fatal": f"{type(exc).__name__}: {exc}"})
        ready.release()
        return
    ready.release()
    go.wait()
    cpu = time.process_time()
    rep.run(args["duration"], args["max_events"], args["speed"], ops=args["ops"])
    out.put({"client": idx, **rep.result(), "cpu_s": time.process_time() - cpu})
    out.close()
    out.join_thread()  # the result is sent before this process ends
    closer = threading.Thread(target=mgr.close, daemon=True)
    closer.start()
    closer.join(10)
    os._exit(0)  # a close still draining a saturated store is not waited for


def _storage_node(master: str, size: str, ready: Any, stop: Any, log: str) -> None:
    """Mooncake: the process that lends the store its memory (clients lend little)."""
    _stderr_to(log)
    mgr = StorageManager({"tiers": [{"backend": "mooncake", "options": {
        "master": master, "global_segment_size": size, "local_buffer_size": "16MiB"}}]})
    mgr.backend(0).io.store()  # wait for the client (set up in the background as the tier starts)
    ready.release()
    stop.wait()
    mgr.close()
    os._exit(0)


class Servers:
    """The shared store for one step, started fresh on 127.0.0.1 and stopped after."""

    def __init__(self, store: str, workdir: Path, args: argparse.Namespace, ctx: Any) -> None:
        self.store, self.node, self.stop_node = store, None, None
        if store == "resp":
            from tests.support.redis_server import RedisServer

            self.server = RedisServer(workdir / "redis", maxmemory=args.maxmemory)
            self.address = self.server.url
            return
        from tests.support.mooncake_store import MooncakeMaster

        self.server = MooncakeMaster(workdir / "mooncake")
        self.address = self.server.address
        ready, self.stop_node = ctx.Semaphore(0), ctx.Event()
        self.node = ctx.Process(target=_storage_node,
                                args=(self.address, args.mooncake_segment, ready, self.stop_node,
                                      str(workdir / "storage.log")))
        self.node.start()
        if not ready.acquire(timeout=120):
            self.close()
            raise RuntimeError("the mooncake storage process did not come up")

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds each of the store's processes has used so far: ``server`` (redis-server,
        or mooncake_master: metadata) and, for mooncake, ``node`` (the storage process: bytes)."""
        out: dict[str, float] = {}
        for name, proc in (("server", self.server.proc), ("node", self.node)):
            if proc is None:
                continue
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    def command_costs(self) -> dict[str, list[float]]:
        """redis-server's own count and CPU microseconds per command (INFO commandstats)."""
        if self.store != "resp":
            return {}
        client = self.server.client()
        try:
            info = client.info("commandstats")
            evicted = client.info("stats")["evicted_keys"]
        finally:
            client.close()
        out = {k.removeprefix("cmdstat_"): [v["calls"], v["usec"]] for k, v in info.items()}
        return {**out, "evicted_keys": [evicted, 0]}

    def close(self) -> None:
        if self.node is not None:
            self.stop_node.set()
            self.node.join(20)
            if self.node.is_alive():
                self.node.kill()
        self.server.stop()


def run_step(store: str, clients: int, timeout_s: float, args: argparse.Namespace,
             workdir: Path) -> dict:
    """One step: fresh servers, ``clients`` processes replaying at once; the merged result."""
    ctx = mp.get_context("fork")  # torch is imported already: children start in milliseconds
    trace = fleet_trace.load(args.trace)
    shared = sorted(fleet_trace.hottest(trace, args.shared))
    stepdir = workdir / f"{store}-{clients}-{timeout_s}"
    stepdir.mkdir(parents=True)
    servers = Servers(store, stepdir, args, ctx)
    extra = {} if args.negative_cache_s is None else {"negative_cache_s": args.negative_cache_s}
    l1 = [] if args.l1 in ("0", "") else [
        {"backend": "local_cpu", "options": {"capacity": args.l1, "prefault": False}}]
    cfg = {"chunk_size": trace["chunk_size"], "tiers": [
        *l1, store_tier(store, servers.address, timeout_s, args.client_segment, **extra)]}
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    opts = {"duration": args.duration, "max_events": args.max_events, "speed": args.speed,
            "seed": args.seed, "ops": args.ops, "logdir": str(stepdir)}
    procs = [ctx.Process(target=_client, args=(i, cfg, args.trace, shared, opts, ready, go, out))
             for i in range(clients)]
    results: list[dict] = []
    try:
        for p in procs:
            p.start()
        for _ in procs:
            if not ready.acquire(timeout=180):
                raise RuntimeError("a client did not come up within 180 s")
        cpu0 = servers.cpu_s()
        go.set()
        deadline = time.monotonic() + args.duration + 120
        while len(results) < clients:
            results.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
        cpu = {k: v - cpu0[k] for k, v in servers.cpu_s().items()}
        costs = servers.command_costs()
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
        servers.close()
    fatal = [r["fatal"] for r in results if "fatal" in r]
    if fatal:
        raise RuntimeError(f"{len(fatal)} client(s) failed to start: {fatal[0]}")
    row = merge(results, store, clients, timeout_s)
    # CPU the store used while the clients ran, in cores (mooncake: master + storage process)
    row["store_cores"] = sum(cpu.values()) / row["duration_s"]
    row.update({f"{k}_cores": v / row["duration_s"] for k, v in cpu.items()})
    row["store_commands"] = costs
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(HERE / "traces" / "chat_small.json"))
    ap.add_argument("--stores", default="resp,mooncake", help="comma-separated: resp, mooncake")
    ap.add_argument("--clients", default="1,2,4,8,16,32", help="client processes per step")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per step")
    ap.add_argument("--max-events", type=int, default=100_000, help="calls per client per step")
    ap.add_argument("--speed", type=float, default=0.0,
                    help="times the recorded pace; 0: back to back (saturate)")
    ap.add_argument("--shared", type=float, default=0.1,
                    help="share of chunk ids common to every engine (the hottest)")
    ap.add_argument("--timeout-s", type=float, default=2.0, help="the tier's timeout_s")
    ap.add_argument("--saturate-timeout", type=float, default=0.0,
                    help="add a step at the largest N with this timeout_s (0: none)")
    ap.add_argument("--l1", default="32MiB",
                    help="each client's L1 capacity (the trace's pass stores ~100 MiB)")
    ap.add_argument("--maxmemory", default="2gb", help="redis-server's maxmemory")
    ap.add_argument("--mooncake-segment", default="2GiB",
                    help="memory the mooncake storage process lends the store")
    ap.add_argument("--client-segment", default="16MiB",
                    help="memory each mooncake client lends the store")
    ap.add_argument("--ops", default="LGP",
                    help="replay only these kinds: L lookups, G loads, P stores (per-call costs)")
    ap.add_argument("--negative-cache-s", type=float, default=None,
                    help="the tier's negative_cache_s (default: the tier's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--keep-logs", help="copy the servers' and clients' logs here")
    args = ap.parse_args()
    stores = args.stores.split(",")
    if "mooncake" in stores:
        from tests.support.mooncake_store import rerun_module_in_private_netns

        rerun_module_in_private_netns(__spec__.name)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    logging.getLogger("kvplug").setLevel(logging.ERROR)
    trace = fleet_trace.load(args.trace)
    print(f"trace {args.trace}: {json.dumps(fleet_trace.summary(trace))}", flush=True)
    steps = [int(x) for x in args.clients.split(",")]
    rows: list[dict] = []
    workdir = Path(tempfile.mkdtemp(prefix="kvplug-bench-fleet-"))
    try:
        for store in stores:
            plan = [(n, args.timeout_s) for n in steps]
            if args.saturate_timeout:
                plan.append((max(steps), args.saturate_timeout))
            for n, tmo in plan:
                t = time.monotonic()
                rows.append(run_step(store, n, tmo, args, workdir))
                print(f"{store} N={n} timeout_s={tmo}: {time.monotonic() - t:.0f} s, "
                      f"{json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()})}",
                      flush=True)
    finally:
        if args.keep_logs:
            shutil.copytree(workdir, args.keep_logs, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.sock", "*.rdb"))
        shutil.rmtree(workdir, ignore_errors=True)
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
