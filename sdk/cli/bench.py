"""``kvplug bench``: qualify one storage tier without an engine — store, lookup and load figures.

The tier is driven through a :class:`~kvplug.storage_manager.StorageManager` that holds only that
tier (no L1 in front), the way the engine calls it: ``batched_put`` then ``flush`` (a store is
done when it is durable in the tier), ``lookup_prefix`` (the ``contains`` hook), ``get`` for one
key and ``batched_get`` for a batch (the tier's ``batched_get`` hook where it has one). Values are
random bytes; every load is compared byte for byte with what was stored: a mismatch is an error,
reported, never a figure. Where the tier has a raw medium (``posix``/``gds``: plain files in the
same directory; ``resp``: redis-py against the same server; ``fsspec``: the same filesystem's
``pipe``/``cat``; ``mooncake``: a second client of the same master), the same bytes are moved
through it in the same run, so each row has a ratio. What the bench stored is evicted at the end
of each cell (and on an interrupt).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch
from rich.progress import Progress
from rich.table import Table

from ..bench_raw import BenchError, RawTarget, raw_medium
from ..config import TierConfig, load_config, parse_size, widest_schema
from ..errors import KVPlugError
from ..keys import CacheKey
from ..memory import MemoryFormat, MemoryObj, MemoryObjMeta
from ..redact import Redactor
from ..storage_manager import StorageManager
from .common import console, err_console, escape, fail, human_bytes

#: Layers of every benchmark value (``[layers, 2 blocks, page bytes]``, layer major, like a chunk).
LAYERS = 32
BLOCKS = 2
#: Random bytes the values are cut from (each key gets its own 4 KiB-aligned window of it).
POOL_BYTES = 64 << 20
PHASES = ("store", "lookup", "load")


# -- values --------------------------------------------------------------------------------------
class Values:
    """Random values of one size: key ``i``'s bytes are a window of one random buffer at an offset
    of its own (a random 4 KiB slot, shifted by 64 bytes per lap over the slots: distinct for the
    first million keys), so a tier answering with another key's value is caught without holding a
    copy per key."""

    def __init__(self, nbytes: int, seed: int) -> None:
        if nbytes % (LAYERS * BLOCKS):
            raise click.BadParameter(f"value size {nbytes} is not a multiple of {LAYERS * BLOCKS}")
        self.nbytes = nbytes
        self.shape = (LAYERS, BLOCKS, nbytes // (LAYERS * BLOCKS))
        gen = torch.Generator().manual_seed(seed)
        self.buffer = torch.randint(0, 256, (POOL_BYTES + nbytes,), dtype=torch.uint8,
                                    generator=gen)
        self._slots = torch.randperm(POOL_BYTES // 4096, generator=gen).tolist()

    def view(self, i: int) -> torch.Tensor:
        n = len(self._slots)
        off = self._slots[i % n] * 4096 + (i // n) * 64 % 4096
        return self.buffer[off : off + self.nbytes]

    def obj(self, i: int, num_tokens: int) -> MemoryObj:
        """Key ``i``'s value as a memory object (a view: stores hold it by reference)."""
        meta = MemoryObjMeta(self.shape, torch.uint8, MemoryFormat.KV_PAGES, num_tokens)
        return MemoryObj(self.view(i).view(self.shape), meta)


def bench_key(run: bytes, i: int) -> CacheKey:
    """Key ``i`` of this run (a model name no engine uses, so nothing real is touched)."""
    return CacheKey("kvplug-bench/random", "uint8", "bench", 1, 0, run + i.to_bytes(8, "big"))


# -- figures -------------------------------------------------------------------------------------
@dataclass
class Phase:
    """What one phase (store, lookup or load) of one cell did, summed over its threads."""

    ops: int = 0
    keys: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    bytes_verified: int = 0
    misses: int = 0
    errors: list[str] = field(default_factory=list)
    dropped: int = 0

    def figures(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        q = (lambda p: lat[min(len(lat) - 1, math.ceil(p * len(lat)) - 1)] * 1e3) if lat else (
            lambda p: None)
        s = self.seconds if self.ops and self.seconds > 0 else None
        return {
            "ops": self.ops, "keys": self.keys, "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "mb_s": round(self.nbytes / s / 1e6, 1) if s and self.nbytes else None,
            "ops_s": round(self.ops / s, 1) if s else None,
            "keys_s": round(self.keys / s, 1) if s else None,
            "p50_ms": q(0.5), "p99_ms": q(0.99),
            "bytes_verified": self.bytes_verified, "misses": self.misses, "dropped": self.dropped,
            "errors": self.errors[:5], "error_count": len(self.errors),
        }


def merged(phases: list[Phase]) -> Phase:
    """One phase's figures over several rounds (sums; latencies pooled)."""
    out = Phase()
    for p in phases:
        out.ops += p.ops
        out.keys += p.keys
        out.nbytes += p.nbytes
        out.seconds += p.seconds
        out.latencies += p.latencies
        out.bytes_verified += p.bytes_verified
        out.misses += p.misses
        out.errors += p.errors
        out.dropped += p.dropped
    return out


def rate(phase: Phase, name: str) -> float | None:
    """A phase's MB/s (lookups: keys/s), or None when it did nothing."""
    if not phase.ops or phase.seconds <= 0:
        return None
    return (phase.keys if name == "lookup" else phase.nbytes) / phase.seconds


class Budget:
    """The run's bound in time: a phase stops at its own deadline or the run's, whichever first."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return self.end - time.monotonic()


def run_threads(threads: int, seconds: float, budget: Budget,
                work: Callable[[int, int], tuple[int, int, int, int]]) -> Phase:
    """Call ``work(thread, op)`` from ``threads`` threads until ``seconds`` pass (every thread does
    at least one op); ``work`` returns ``(keys, bytes, bytes verified, misses, seconds spent
    comparing)``, raises :class:`Mismatch` for wrong bytes and :class:`StopPhase` to stop.
    Time spent comparing is left out of the figures."""
    phase = Phase()
    lock = threading.Lock()
    deadline = time.monotonic() + max(0.0, min(seconds, budget.left()))
    compare_s = [0.0] * threads
    stop = threading.Event()

    def loop(t: int) -> None:
        op = 0
        while op == 0 or (time.monotonic() < deadline and not stop.is_set()):
            t0 = time.perf_counter()
            try:
                keys, nbytes, verified, misses, spent = work(t, op)
            except StopPhase:
                return
            except Mismatch as exc:
                with lock:
                    phase.errors.append(str(exc))
                stop.set()
                return
            except Exception as exc:  # noqa: BLE001 - a failing call ends the phase, reported
                with lock:
                    phase.errors.append(f"{type(exc).__name__}: {exc}")
                stop.set()
                return
            dt = time.perf_counter() - t0 - spent
            compare_s[t] += spent
            with lock:
                phase.ops += 1
                phase.keys += keys
                phase.nbytes += nbytes
                phase.bytes_verified += verified
                phase.misses += misses
                phase.latencies.append(dt)
            op += 1

    start = time.perf_counter()
    workers = [threading.Thread(target=loop, args=(t,), name=f"kvplug-bench-{t}", daemon=True)
               for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    phase.seconds = max(1e-9, time.perf_counter() - start - sum(compare_s) / threads)
    return phase


class Mismatch(Exception):
    """A load returned bytes other than those stored."""


class StopPhase(Exception):
    """Raised by a phase's work to end its thread quietly (the store wrote its byte budget)."""


def compare(got: torch.Tensor | bytes | memoryview, want: torch.Tensor, what: str) -> float:
    """Seconds spent checking that ``got`` holds exactly ``want``'s bytes; raises Mismatch."""
    t0 = time.perf_counter()
    if not isinstance(got, torch.Tensor):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = torch.frombuffer(got, dtype=torch.uint8)
    got = got.reshape(-1)
    if got.numel() != want.numel():
        raise Mismatch(f"{what}: loaded {got.numel()} bytes, stored {want.numel()}")
    if not torch.equal(got, want):
        first = int((got != want).nonzero()[0])
        raise Mismatch(f"{what}: loaded bytes differ from the stored ones (first at byte {first})")
    return time.perf_counter() - t0


# -- the tier through the StorageManager ---------------------------------------------------------
class TierTarget:
    """The tier alone in a StorageManager; store, lookup and load as the engine calls them."""

    label = "kvplug"

    def __init__(self, tier: TierConfig) -> None:
        self.mgr = StorageManager({"tiers": [tier.model_dump()]})
        self.name = self.mgr.tier_names[0]

    def store(self, keys: list[CacheKey], objs: list[MemoryObj]) -> None:
        self.mgr.batched_put(keys, objs)
        if not self.mgr.flush(timeout=600):
            raise TimeoutError("flush did not drain the tier's writes within 600 s")

    def held(self, keys: list[CacheKey]) -> list[bool]:
        answer = self.mgr.holds(self.name, keys)
        if answer is None:
            raise RuntimeError(f"tier {self.name!r} did not answer contains ({self.fault_hint()})")
        return answer

    def lookup(self, keys: list[CacheKey]) -> int:
        return self.mgr.lookup_prefix(keys).num_chunks

    def load(self, keys: list[CacheKey]) -> list[Any]:
        if len(keys) == 1:
            return [self.mgr.get(keys[0], promote=False)]
        return self.mgr.batched_get(keys)

    def release(self, got: Any) -> None:
        if got is not None:
            got.ref_down()

    def payload(self, got: Any) -> torch.Tensor:
        return got.byte_view

    def remove(self, keys: list[CacheKey]) -> None:
        if keys:
            self.mgr.evict(keys)

    def fault_hint(self) -> str:
        st = self.mgr.stats().get(self.name, {})
        return f"faults={int(st.get('faults', 0))}, timeouts={int(st.get('timeouts', 0))}"

    def close(self) -> None:
        self.mgr.close()


# -- one cell ------------------------------------------------------------------------------------
@dataclass
class Cell:
    size: int
    batch: int
    threads: int


def bench_cell(target: TierTarget | RawTarget, cell: Cell, values: Values, run: bytes,
               seconds: float, max_bytes: int, budget: Budget, chunk_size: int) -> dict[str, Phase]:
    """Store, then look up and load what was stored, from ``cell.threads`` threads; the keys are
    removed again before returning."""
    counter = [0]
    lock = threading.Lock()
    written: list[list[int]] = [[] for _ in range(cell.threads)]
    cap = max(max_bytes, cell.threads * cell.batch * cell.size)

    def next_ids() -> list[int]:
        with lock:
            first = counter[0]
            counter[0] += cell.batch
        return list(range(first, first + cell.batch))

    def store(t: int, op: int) -> tuple[int, int, int, int, float]:
        if op and counter[0] * cell.size >= cap:
            raise StopPhase
        ids = next_ids()
        objs = [values.obj(i, chunk_size) for i in ids]
        try:
            target.store([bench_key(run, i) for i in ids], objs)
        finally:
            for obj in objs:  # the tier holds its own references, as after an engine's store
                obj.ref_down()
        written[t].extend(ids)
        return len(ids), len(ids) * cell.size, 0, 0, 0.0

    try:
        out: dict[str, Phase] = {}
        st = run_threads(cell.threads, seconds, budget, store)
        ids_all = [i for w in written for i in w]
        keys_all = [bench_key(run, i) for i in ids_all]
        held = [i for i, h in zip(ids_all, _held(target, keys_all)) if h] if keys_all else []
        st.dropped = len(ids_all) - len(held)
        st.keys, st.nbytes = len(held), len(held) * cell.size  # only what the tier kept counts
        out["store"] = st
        if not held:
            out["lookup"] = out["load"] = Phase(errors=["the tier kept none of the values stored "
                                                        "(see store.dropped)"])
            return out
        rounds = [0] * cell.threads

        def batch_of(t: int) -> list[int]:
            n = rounds[t]
            rounds[t] += 1
            start = (t * 7919 + n * cell.batch) % len(held)
            return [held[(start + j) % len(held)] for j in range(cell.batch)]

        def lookup(t: int, op: int) -> tuple[int, int, int, int, float]:
            ids = batch_of(t)
            found = target.lookup([bench_key(run, i) for i in ids])
            return len(ids), 0, 0, len(ids) - found, 0.0

        out["lookup"] = run_threads(cell.threads, seconds, budget, lookup)
        rounds[:] = [0] * cell.threads

        def load(t: int, op: int) -> tuple[int, int, int, int, float]:
            ids = batch_of(t)
            got = target.load([bench_key(run, i) for i in ids])
            t0 = time.perf_counter()
            verified = misses = 0
            try:
                for i, g in zip(ids, got):
                    if g is None:
                        misses += 1
                        continue
                    compare(target.payload(g), values.view(i), f"key #{i} ({human_bytes(cell.size)})")
                    verified += cell.size
            finally:
                for g in got:
                    target.release(g)
            return len(ids), verified, verified, misses, time.perf_counter() - t0

        out["load"] = run_threads(cell.threads, seconds, budget, load)
        return out
    finally:
        ids_all = list(range(counter[0]))
        for start in range(0, len(ids_all), 1024):
            target.remove([bench_key(run, i) for i in ids_all[start : start + 1024]])


def _held(target: TierTarget | RawTarget, keys: list[CacheKey]) -> list[bool]:
    out: list[bool] = []
    for start in range(0, len(keys), 1024):
        out += target.held(keys[start : start + 1024])
    return out


def cell_figures(runs: dict[str, list[dict[str, Phase]]]) -> dict[str, Any]:
    """A cell's figures over its rounds: each side's phases merged, and per phase the median
    over rounds of tier / raw in the same round (``ratio``: what a load spike on a shared
    machine moves least)."""
    out: dict[str, Any] = {who: {ph: merged([r[ph] for r in rs]).figures() for ph in PHASES}
                           for who, rs in runs.items() if rs}
    if runs["kvplug"] and runs["raw"]:
        out["ratio"] = {}
        for ph in PHASES:
            pairs = [(rate(k[ph], ph), rate(r[ph], ph)) for k, r in zip(runs["kvplug"], runs["raw"])]
            each = [a / b for a, b in pairs if a and b]
            out["ratio"][ph] = round(statistics.median(each), 3) if each else None
        out["rounds"] = min(len(runs["kvplug"]), len(runs["raw"]))
    return out


# -- the command ---------------------------------------------------------------------------------
def parse_list(text: str, what: str, conv: Callable[[str], int]) -> list[int]:
    try:
        values = [conv(v.strip()) for v in text.split(",") if v.strip()]
    except (ValueError, TypeError, KVPlugError) as exc:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of {what} ({exc})") from None
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"{text!r}: give one or more positive {what}")
    return values


def resolve_tier(config: Path | None, tier: str | None, backend: str | None,
                 options: str | None) -> tuple[TierConfig, int]:
    """The tier to qualify and the chunk size, from ``--config/--tier`` or ``--backend/--options``."""
    if (config is None) == (backend is None):
        fail("give either --config FILE (with --tier NAME if it has several tiers) or "
             "--backend NAME (with --options JSON)", code=2)
    if backend is not None:
        if tier is not None:
            fail("--tier selects a tier of --config; with --backend, name it in --options", code=2)
        try:
            opts = json.loads(options) if options else {}
        except json.JSONDecodeError as exc:
            fail(f"--options is not valid JSON ({exc.msg} at character {exc.pos}); "
                 "give an object, e.g. --options '{\"path\": \"/tmp/kvplug-bench\"}'", code=2)
        if not isinstance(opts, dict):
            fail(f"--options is a JSON {type(opts).__name__}, not an object; give "
                 "e.g. --options '{\"path\": \"/tmp/kvplug-bench\"}'", code=2)
        try:
            return TierConfig(backend=backend, options=opts, timeout_s=600.0), 256
        except Exception as exc:  # noqa: BLE001 - pydantic's message names the field
            fail(f"bad tier: {Redactor('', opts)(str(exc))}", code=2)
    if options is not None:
        fail("--options goes with --backend; with --config the options are in the file", code=2)
    try:
        cfg = load_config(config, schema=widest_schema())
    except KVPlugError as exc:
        fail(f"{config}: {exc}", code=2)
    names = cfg.tier_names()
    if tier is None:
        if len(names) != 1:
            fail(f"{config} has tiers {names}; pick one with --tier NAME", code=2)
        tier = names[0]
    if tier not in names:
        fail(f"{config} has no tier {tier!r}; its tiers are {names}", code=2)
    chosen = cfg.tiers[names.index(tier)]
    # The bench waits for the tier's answers: a long bound so a slow medium is measured, not cut.
    return chosen.model_copy(update={"timeout_s": max(chosen.timeout_s, 600.0)}), cfg.chunk_size


def _rows(report: dict[str, Any]) -> Iterator[list[str]]:
    def f(v: Any, fmt: str = "{:.0f}") -> str:
        return "-" if v is None else fmt.format(v)

    for c in report["cells"]:
        for phase in PHASES:
            k = c["kvplug"][phase]
            r = c.get("raw", {}).get(phase) if c.get("raw") else None
            rate_ = "mb_s" if phase != "lookup" else "keys_s"
            each = (c.get("ratio") or {}).get(phase)
            ratio = f"{each:.2f}x" if each else "-"
            errors = k["error_count"] + (r["error_count"] if r else 0)
            yield [human_bytes(c["size"]), str(c["batch"]), str(c["threads"]), phase,
                   f(k["mb_s"]), f(k["ops_s"]), f(k["keys_s"]), f(k["p50_ms"], "{:.2f}"),
                   f(k["p99_ms"], "{:.2f}"), human_bytes(k["bytes_verified"]) if phase == "load"
                   else "", f(r[rate_]) if r else "-", ratio,
                   f"[red]{errors}[/]" if errors else str(k["misses"] + k["dropped"])]


def print_table(report: dict[str, Any]) -> None:
    table = Table(title=f"kvplug bench: tier {escape(report['tier'])} "
                        f"(backend {escape(report['backend'])}), alone in a StorageManager")
    for col in ("Value", "Batch", "Threads", "Op", "MB/s", "Ops/s", "Keys/s", "p50 ms", "p99 ms",
                "Verified", "Raw MB/s|keys/s", "Ratio", "Miss/err"):
        table.add_column(col, justify="right" if col not in ("Op",) else "left")
    for row in _rows(report):
        table.add_row(*row)
    console.print(table)
    console.print(f"raw medium: {escape(report['raw'])}; the same bytes without the tier's "
                  "checks (every load verified, atomic stores, the index)", highlight=False)
    for c in report["cells"]:
        for who in ("kvplug", "raw"):
            for phase in PHASES:
                for e in ((c.get(who) or {}).get(phase) or {}).get("errors", []):
                    console.print(f"[red]{who} {phase} error[/] ({human_bytes(c['size'])}, batch "
                                  f"{c['batch']}, {c['threads']} threads): {escape(e)}",
                                  highlight=False, soft_wrap=True)
    for s in report["skipped"]:
        console.print(f"[yellow]skipped[/] {escape(s)}", highlight=False)


def _errors(report: dict[str, Any]) -> int:
    return sum(((c.get(who) or {}).get(p) or {}).get("error_count", 0)
               for c in report["cells"] for who in ("kvplug", "raw") for p in PHASES)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("kvplug bench", total=total)

        def step(what: str) -> None:
            progress.update(task, advance=1, description=what)

        yield step


@click.command("bench")
@click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path),
              help="A kvplug config file (YAML); the tier is picked with --tier.")
@click.option("--tier", help="Name of the tier in --config to qualify.")
@click.option("--backend", help="Backend name (entry point, third-party ones included) or "
              "'package.module:Class', instead of --config.")
@click.option("--options", help="The backend's options as a JSON object (with --backend).")
@click.option("--sizes", default="256KiB,1MiB,4MiB", show_default=True,
              help="Value sizes, comma-separated.")
@click.option("--batches", default="1,96", show_default=True, help="Keys per call.")
@click.option("--threads", "threads_", default="1,4", show_default=True,
              help="Threads calling at once.")
@click.option("--seconds", default=2.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds per phase (store, lookup, load) of each cell, for the tier and for "
                   "the raw medium each; every thread does at least one call.")
@click.option("--max-seconds", default=600.0, show_default=True, type=click.FloatRange(min=0),
              help="Bound on the whole run; cells not started by then are skipped (listed).")
@click.option("--max-bytes", default="1GiB", show_default=True,
              help="Bytes stored per cell at most (at least one batch per thread).")
@click.option("--raw/--no-raw", default=True, show_default=True,
              help="Also move the same bytes through the tier's raw medium.")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(min=1),
              help="Run each cell this many times, tier and raw medium alternating (each first "
                   "every other round); the ratio is the median over rounds of tier / raw in the "
                   "same round (on a shared machine, what moves least).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random values.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_cmd(config: Path | None, tier: str | None, backend: str | None, options: str | None,
              sizes: str, batches: str, threads_: str, seconds: float, max_seconds: float,
              max_bytes: str, raw: bool, rounds: int, seed: int, as_json: bool) -> None:
    """Qualify one storage tier: store, lookup and load MB/s, ops/s and p50/p99 latency.

    The tier is built alone in a StorageManager (no L1 in front), so the figures are the tier's
    own: a store is batched_put + flush, a lookup is lookup_prefix (contains), a load is get for
    one key and batched_get for a batch. Values are random bytes; every loaded byte is compared
    with what was stored (a mismatch is an error, exit 1, never a figure). Beside each row the
    same bytes go through the raw medium where there is one (posix/gds: plain files in the same
    directory; resp: redis-py on the same server; fsspec: the same filesystem's pipe/cat;
    mooncake: a second client of the same master), and the ratio is tier/raw (with --rounds, the
    median over rounds of tier/raw in the same round: on a shared machine, what moves least). The
    raw side does none of the tier's work: no checksum or MAC verified on a load, no atomic
    store (a file's temporary name and rename), no index, no hand-off to a writer thread; where a
    ratio is under 1 at small batches, that work and the tier's Python per call are the
    difference. A store the tier dropped (its write queue full) is counted as dropped, not as
    stored. Everything stored is evicted again.
    """
    size_list = parse_list(sizes, "sizes (e.g. 256KiB,1MiB)", parse_size)
    batch_list = parse_list(batches, "batch sizes", int)
    thread_list = parse_list(threads_, "thread counts", int)
    budget_bytes = parse_list(max_bytes, "byte counts", parse_size)[0]
    tier_cfg, chunk_size = resolve_tier(config, tier, backend, options)
    budget = Budget(max_seconds)
    logging.getLogger("kvplug").setLevel(logging.ERROR)  # faults are counted and reported here
    redact = Redactor(str(tier_cfg.options.get("url", "")), tier_cfg.options)
    try:
        target = TierTarget(tier_cfg)
    except KVPlugError as exc:
        fail(redact(str(exc)), code=2)
    raw_target_: RawTarget | None = None
    raw_note = "not measured (--no-raw)"
    try:
        _preflight(target, tier_cfg, redact)
        if raw:  # the backend's own raw client (kvplug.bench_raw)
            try:
                raw_target_, raw_note = raw_medium(tier_cfg)
            except BenchError as exc:
                fail(redact(str(exc)))
            except Exception as exc:  # noqa: BLE001 - a missing client library, a refused login
                fail(f"the raw medium of tier {target.name!r} could not be opened: "
                     f"{redact.error(exc)}; pass --no-raw to qualify the tier alone")
        cells = [Cell(s, b, t) for s in size_list for b in batch_list for t in thread_list]
        report: dict[str, Any] = {
            "tier": target.name, "backend": tier_cfg.backend, "raw": raw_note,
            "seconds_per_phase": seconds, "max_bytes_per_cell": budget_bytes, "cells": [],
            "skipped": [],
            "rounds": rounds,
            "note": "the tier alone in a StorageManager; MB/s over each phase's wall time "
                    "(comparing loaded bytes left out); lookup rates in keys/s; ratio: the median "
                    "over rounds of tier / raw in the same round",
        }
        run = uuid.uuid4().bytes[:6]
        per_cell = (2 if raw_target_ is not None else 1) * rounds
        with _progress(len(cells) * per_cell) as step:
            for n, cell in enumerate(cells):
                label = f"{human_bytes(cell.size)} x{cell.batch}, {cell.threads} thread(s)"
                if budget.left() <= 0:
                    report["skipped"].append(f"{label}: --max-seconds {max_seconds:g} reached")
                    continue
                values = Values(cell.size, seed + n)
                entry: dict[str, Any] = {"size": cell.size, "batch": cell.batch,
                                         "threads": cell.threads}
                runs: dict[str, list[dict[str, Phase]]] = {"kvplug": [], "raw": []}
                for r in range(rounds):  # tier and raw alternate, each first every other round
                    order = [("kvplug", target), ("raw", raw_target_)][:: 1 if r % 2 == 0 else -1]
                    for who, tgt in order:
                        if tgt is None or (r and budget.left() <= 0):
                            continue
                        step(f"{label}: {who}" + (f" (round {r + 1})" if rounds > 1 else ""))
                        runs[who].append(bench_cell(tgt, cell, values, run + bytes([r % 256, n % 256]),
                                                    seconds, budget_bytes, budget, chunk_size))
                entry.update(cell_figures(runs))
                report["cells"].append(entry)
        report["tier_stats"] = {k: v for k, v in target.mgr.stats()[target.name].items()
                                if isinstance(v, (int, float))}
    finally:
        if raw_target_ is not None:
            raw_target_.close()
        target.close()
    for c in report["cells"]:  # a client's error text may quote a URL with its password
        for who in ("kvplug", "raw"):
            for phase in (c.get(who) or {}).values():
                phase["errors"] = [redact(e) for e in phase["errors"]]
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
    errors = _errors(report)
    if errors:
        fail(f"{errors} error(s): a load returned other bytes than stored, or a call failed "
             "(see above)")


def _preflight(target: TierTarget, tier: TierConfig, redact: Redactor) -> None:
    """Store, find and remove one small value, so an unreachable server or a tier that keeps
    nothing is one clear error before any figure."""
    values = Values(LAYERS * BLOCKS * 64, seed=12345)
    key = bench_key(uuid.uuid4().bytes[:8], 0)
    try:
        obj = values.obj(0, 1)
        target.store([key], [obj])
        obj.ref_down()
        kept = target.mgr.holds(target.name, [key])
    finally:
        target.remove([key])
    if not kept or not kept[0]:
        where = ", ".join(f"{k}={redact(str(v))}" for k, v in tier.options.items()
                          if k in ("url", "path", "master"))  # never a repr: it escapes quotes
        fail(redact(f"tier {target.name!r} (backend {tier.backend!r}) did not keep a test value "
             f"({target.fault_hint()}); is its medium reachable and writable? {where} "
             "Check the server address / directory in the tier's options."))
