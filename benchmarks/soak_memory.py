"""Where a process's memory goes, for the soak (``benchmarks/soak.py``); runs in the engine's
worker through ``collective_rpc``.

Three views, to tell a leak from allocator behaviour: the RSS (``/proc/self/status``); glibc's
own account (``mallinfo2``: bytes malloc has handed out and not got back, against bytes it holds
free in its arenas), optionally the RSS again after ``malloc_trim(0)`` hands free pages back to
the kernel; and Python's (``tracemalloc``, started once traffic is warm, so the growth sites are
those of live objects allocated since). A leak grows "in use" (and, if it is Python's, the traced
memory); fragmentation grows "free" and the RSS that ``malloc_trim`` gives back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import tracemalloc
from typing import Any

_BASE: list[tracemalloc.Snapshot] = []  # the snapshot growth is measured from (this process)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``RssAnon``...), 0 if absent."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def malloc_kib() -> dict[str, int]:
    """glibc's heap in KiB: in use (handed out, not freed; mmapped blocks included) and free
    (held in its arenas). Empty where there is no ``mallinfo2`` (not glibc, or glibc < 2.33)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    return {"malloc_used_kib": (mi.uordblks + mi.hblkhd) // 1024,
            "malloc_free_kib": mi.fordblks // 1024, "malloc_mmap_kib": mi.hblkhd // 1024}


def start_tracing(_worker: Any = None, frames: int = 1) -> bool:
    """Start ``tracemalloc`` in this process (a no-op if it runs already)."""
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    return True


def mark_base(_worker: Any = None) -> bool:
    """Take the snapshot that :func:`growth` compares with (once traffic has run traced a while:
    objects that only churn are then in both)."""
    if tracemalloc.is_tracing():
        _BASE[:] = [tracemalloc.take_snapshot()]
    return bool(_BASE)


def growth(_worker: Any = None, top: int = 15) -> list[dict[str, Any]]:
    """The ``top`` sites (file:line) whose live traced memory grew most since :func:`mark_base`."""
    if not _BASE or not tracemalloc.is_tracing():
        return []
    now = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)])
    diff = now.compare_to(_BASE[0], "lineno")
    diff.sort(key=lambda d: d.size_diff, reverse=True)
    return [{"site": f"{d.traceback[0].filename}:{d.traceback[0].lineno}",
             "size_diff_kib": round(d.size_diff / 1024, 1), "count_diff": d.count_diff,
             "size_kib": round(d.size / 1024, 1)} for d in diff[:top]]


def memory_probe(trim: bool = False) -> dict[str, Any]:
    """RSS, glibc's heap, Python's traced memory; with ``trim``, the RSS again after
    ``malloc_trim(0)`` (what remains once glibc has returned its free pages)."""
    out: dict[str, Any] = {"rss_kib": proc_status("VmRSS"), **malloc_kib()}
    if trim:
        libc = _libc()
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
            out["rss_trimmed_kib"] = proc_status("VmRSS")
    if tracemalloc.is_tracing():
        cur, _peak = tracemalloc.get_traced_memory()
        out.update(traced_kib=cur // 1024,
                   tracemalloc_overhead_kib=tracemalloc.get_tracemalloc_memory() // 1024)
    return out


def curve(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per memory column: first, last, max, and the least-squares slope in KiB per 1,000
    requests over ``samples`` (from the warm-up on), and over their second half (still rising?)."""
    import statistics

    out: dict[str, Any] = {}
    cols = ("rss_kib", "rss_trimmed_kib", "malloc_used_kib", "malloc_free_kib", "traced_kib")
    for col in cols:
        rows = [(s["requests"], s[col]) for s in samples if col in s]
        if len(rows) < 3:
            continue
        xs, ys = zip(*rows)

        def slope(a: tuple, b: tuple) -> float | None:
            if len(set(a)) < 2:
                return None
            return round(1000 * statistics.linear_regression(a, b).slope, 1)

        h = len(rows) // 2
        out[col] = {"first": ys[0], "last": ys[-1], "max": max(ys), "per_1k_requests": slope(xs, ys),
                    "per_1k_requests_second_half": slope(xs[h:], ys[h:])}
    return out
