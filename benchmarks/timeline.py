"""A timeline probe for one engine run: when each step, lookup, fetch, read, scatter and forward
ran, in every process (vLLM forks its engine-core process from the one that installs it).

``install(prefix)`` wraps the functions below at class level in this process before the engine
starts; each process appends ``start end name thread detail`` lines (``time.perf_counter``, which
is CLOCK_MONOTONIC on Linux, so the processes' lines share one clock) to ``prefix.<pid>``. Also
logs the garbage collector's passes and ``mark(name)`` calls from the caller (e.g. a request's
send and return). A diagnosis tool for benchmarks (bench_first_hits.py ``--timeline``), not
product code.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from typing import Any

_prefix = ""
_files: dict[int, Any] = {}
_gc_t0: list[float] = [0.0]


def _out() -> Any:
    pid = os.getpid()
    f = _files.get(pid)
    if f is None:
        f = _files[pid] = open(f"{_prefix}.{pid}", "a", buffering=1)  # noqa: SIM115
    return f


def span(name: str, t0: float, t1: float, detail: str = "") -> None:
    _out().write(f"{t0:.6f} {t1:.6f} {name} {threading.current_thread().name} {detail}\n")


def mark(name: str, detail: str = "") -> None:
    t = time.perf_counter()
    span(name, t, t, detail)


def _busy_ms() -> float:
    """CPU time of every process on the machine so far (all cores, ms; /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) * 1e3 / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _wrap(owner: type, attr: str, name: str, detail: Any = None, cpu: bool = False) -> None:
    """``cpu``: add this process's CPU time (all threads) and the whole machine's during the
    call (ms), to tell time spent waiting for a core from time spent working."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def probe(*a: Any, **k: Any) -> Any:
        if cpu:
            c0, b0 = time.process_time(), _busy_ms()
        t0 = time.perf_counter()
        try:
            out = fn(*a, **k)
        finally:
            t1 = time.perf_counter()
        try:
            d = detail(a, k, out) if detail else ""
        except Exception as e:  # noqa: BLE001 - a probe never breaks the run
            d = f"?{e!r}"
        if cpu:
            d += f" proc_cpu_ms={(time.process_time() - c0) * 1e3:.0f}"
            d += f" machine_cpu_ms={_busy_ms() - b0:.0f}"
        span(name, t0, t1, d)
        return out

    setattr(owner, attr, probe)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    else:
        span("gc", _gc_t0[0], time.perf_counter(),
             f"gen={info['generation']} collected={info['collected']}")


def install(prefix: str) -> None:
    """Wrap the engine's and kvplug's steps; lines go to ``prefix.<pid>``."""
    global _prefix
    _prefix = prefix
    import kvplug.pool as pool
    from kvplug.backends.posix.backend import PosixBackend
    from kvplug.connector import connector as conn
    from kvplug.connector.protocol import lookup
    from kvplug.connector.worker import load
    from kvplug.storage_manager import StorageManager
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(EngineCore, "step", "engine.step",
          lambda a, k, out: f"model_executed={out[1]} outputs={len(out[0] or {})}")
    _wrap(GPUModelRunner, "execute_model", "runner.execute_model", cpu=True)
    _wrap(GPUModelRunner, "sample_tokens", "runner.sample_tokens")
    _wrap(GPUModelRunner, "_model_forward", "runner.forward",
          lambda a, k, out: f"n={k['input_ids'].shape[0] if k.get('input_ids') is not None else '?'}",
          cpu=True)
    C = conn.KVPlugConnector
    _wrap(C, "get_num_new_matched_tokens", "sched.lookup", lambda a, k, out: f"{out}")
    _wrap(C, "build_connector_meta", "sched.build_meta")
    _wrap(C, "start_load_kv", "worker.start_load_kv")
    _wrap(C, "get_finished", "worker.get_finished", lambda a, k, out: f"{out}")
    _wrap(C, "wait_for_save", "worker.wait_for_save")
    _wrap(lookup.LookupService, "_serve", "worker.lookup_serve")
    _wrap(load.Loads, "finished", "worker.loads_finished",
          lambda a, k, out: f"over={len(out)}", cpu=True)
    _wrap(load.BackgroundLoads, "wait_idle", "worker.wait_idle")
    _wrap(load.BackgroundLoads, "start_fetch", "worker.bg_submit")
    _wrap(StorageManager, "batched_get_where", "sm.batched_get_where",
          lambda a, k, out: f"n={len(out[0])} hit={sum(o is not None for o in out[0])}",
          cpu=True)
    _wrap(StorageManager, "read_pinned", "sm.read_pinned",
          lambda a, k, out: f"n={len(out)} hit={sum(o is not None for o in out)}", cpu=True)
    _wrap(PosixBackend, "get", "posix.get")
    _wrap(pool, "populate_pages", "pool.populate", cpu=True)
    gc.callbacks.append(_on_gc)
