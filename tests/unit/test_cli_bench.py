"""``kvplug bench`` end to end: the command in a process of its own, its JSON parsed.

Real tiers (local_cpu, posix in a tmp dir, resp on a redis-server this module starts), tiny
sizes and fractions of a second per phase. Figures are never asserted, only counts: every cell
asked for is there, every loaded byte was compared (``bytes_verified == bytes``) and calls ran.
A backend that returns other bytes than it stored (``CorruptingCPU`` below, named by its import
path) must make the bench report a verification error and exit 1 (the negative control).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kvplug.backends.local_cpu import LocalCPUBackend
from kvplug.hookspecs import hookimpl
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj, heap_memory_obj

from tests.support.engine_processes import run_console_script

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--batches", "1,4", "--threads", "1,2", "--seconds", "0.05", "--max-bytes", "2MiB",
         "--max-seconds", "120"]


class CorruptingCPU(LocalCPUBackend):
    """local_cpu whose loads hand back a copy with one byte flipped (what bench must catch)."""

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        obj = super().get(key)
        if obj is None:
            return None
        bad = heap_memory_obj(obj.meta.shape, obj.meta.dtype, obj.meta.fmt, obj.meta.num_tokens)
        bad.byte_view.copy_(obj.byte_view)
        obj.ref_down()
        bad.byte_view[len(bad.byte_view) // 2] ^= 0x5A
        return bad


class SwappingCPU(LocalCPUBackend):
    """local_cpu whose loads hand back another key's (intact) value; while it holds one key only
    (a short bench on a busy machine may store just one), that value's bytes rotated by one, as
    another key's would differ (before: a miss then, and the control passed as no error, a
    flake seen in a fresh-clone run)."""

    @hookimpl
    def get(self, key: CacheKey) -> MemoryObj | None:
        with self._lock:
            other = next((k for k in self._entries if k != key), None)
        if other is not None:
            return super().get(other)
        obj = super().get(key)
        if obj is None:
            return None
        bad = heap_memory_obj(obj.meta.shape, obj.meta.dtype, obj.meta.fmt, obj.meta.num_tokens)
        bad.byte_view.copy_(obj.byte_view.roll(1))
        obj.ref_down()
        return bad


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``kvplug bench ARGS`` in a process of its own (forked: tests/support/engine_processes.py), with
    this module importable there (its broken backends)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return run_console_script(["bench", *args], env, None, timeout)


def report_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.stdout.strip(), f"no JSON on stdout; stderr:\n{proc.stderr}"
    return json.loads(proc.stdout)


def check_cells(report: dict[str, Any], raw: bool, sizes: tuple[int, ...] = (64 << 10,)) -> None:
    """Every requested cell, each phase with calls made and every loaded byte verified."""
    got = {(c["size"], c["batch"], c["threads"]) for c in report["cells"]}
    assert got == {(s, b, t) for s in sizes for b in (1, 4) for t in (1, 2)}
    assert not report["skipped"]
    for cell in report["cells"]:
        for who in ("kvplug", "raw") if raw else ("kvplug",):
            fig = cell[who]
            for phase in ("store", "lookup", "load"):
                assert fig[phase]["ops"] > 0 and fig[phase]["keys"] > 0, (who, phase, cell)
                assert fig[phase]["error_count"] == 0, (who, phase, fig[phase]["errors"])
                assert fig[phase]["misses"] == 0, (who, phase, cell)
            assert fig["store"]["bytes"] > 0
            assert fig["load"]["bytes_verified"] == fig["load"]["bytes"] > 0, (who, cell)
            assert fig["load"]["bytes_verified"] == fig["load"]["keys"] * cell["size"]
        if not raw:
            assert "raw" not in cell and "ratio" not in cell


def test_bench_local_cpu() -> None:
    proc = bench("--backend", "local_cpu", "--options", '{"capacity": "64MiB"}', "--sizes",
                 "64KiB,128KiB", *SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    report = report_of(proc)
    assert report["backend"] == "local_cpu" and "no medium" in report["raw"]
    check_cells(report, raw=False, sizes=(64 << 10, 128 << 10))
    assert report["tier_stats"]["faults"] == 0


def test_bench_posix_from_config_file(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text(f"tiers:\n  - backend: local_cpu\n  - backend: posix\n    name: disk\n"
                   f"    options: {{path: '{root}', fsync: true}}\n")
    proc = bench("--config", str(cfg), "--tier", "disk", "--sizes", "64KiB", *SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    report = report_of(proc)
    assert report["tier"] == "disk" and "fsync" in report["raw"]
    check_cells(report, raw=True)
    left = [p for p in root.rglob("*") if p.is_file()]
    assert not left, f"bench left files behind: {left[:5]}"


def test_bench_rounds_alternate_tier_and_raw(tmp_path: Path) -> None:
    """``--rounds 3``: each cell runs three times, tier and raw medium alternating; each side's
    figures add up all rounds (at least one call per thread and round), and the ratio of each
    phase is the median of the rounds' own ratios."""
    proc = bench("--backend", "posix", "--options", json.dumps({"path": str(tmp_path / "c")}),
                 "--sizes", "64KiB", *SMALL, "--rounds", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = report_of(proc)
    check_cells(report, raw=True)
    assert report["rounds"] == 3
    for cell in report["cells"]:
        assert cell["rounds"] == 3
        for who in ("kvplug", "raw"):
            assert cell[who]["store"]["ops"] >= 3 * cell["threads"], (who, cell)
        assert all(cell["ratio"][ph] > 0 for ph in ("store", "lookup", "load")), cell


def test_bench_resp_beside_redis_py(tmp_path: Path) -> None:
    from tests.support.redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis")
    try:
        proc = bench("--backend", "resp", "--options", json.dumps({"url": srv.url}), "--sizes",
                     "64KiB", *SMALL, "--json")
        assert proc.returncode == 0, proc.stderr
        report = report_of(proc)
        assert "redis-py" in report["raw"]
        check_cells(report, raw=True)
        import redis

        assert redis.Redis.from_url(srv.url).dbsize() == 0, "bench left keys in the server"
    finally:
        srv.stop()


@pytest.mark.parametrize("backend", ["CorruptingCPU", "SwappingCPU"])
def test_bench_reports_wrong_bytes(backend: str) -> None:
    """Negative control: a tier that loads other bytes than it stored (a flipped byte, another
    key's value) is an error, not a figure."""
    proc = bench("--backend", f"tests.unit.test_cli_bench:{backend}", "--sizes", "64KiB", "--batches",
                 "1", "--threads", "1", "--seconds", "0.05", "--json")
    assert proc.returncode == 1, proc.stderr
    load = report_of(proc)["cells"][0]["kvplug"]["load"]
    assert load["error_count"] > 0 and "differ" in load["errors"][0], load
    assert load["bytes_verified"] == 0
    assert "error" in proc.stderr


def test_bench_bad_options_json() -> None:
    proc = bench("--backend", "resp", "--options", '{"url": "redis://:hunter22pw@h:1/0",}')
    assert proc.returncode == 2
    assert "--options" in proc.stderr and "not valid JSON" in proc.stderr
    assert "hunter22pw" not in proc.stderr + proc.stdout, "the options (a password) were echoed"


@pytest.mark.parametrize("args, words", [
    (["--backend", "no_such_tier"], ["'no_such_tier' is not installed", "installed backends"]),
    (["--backend", "posix", "--options", "[1]"], ["not an object"]),
    (["--backend", "posix", "--options", '{"pathh": "/tmp/x"}'], ["pathh", "Allowed options"]),
    ([], ["--config FILE", "--backend NAME"]),
])
def test_bench_bad_arguments(args: list[str], words: list[str]) -> None:
    proc = bench(*args)
    assert proc.returncode == 2, proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_bench_total_bound_skips_cells() -> None:
    """--max-seconds bounds the run: cells not started by then are listed, not run."""
    proc = bench("--backend", "local_cpu", "--sizes", "64KiB", "--batches", "1,2", "--threads", "1",
                 "--max-seconds", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    report = report_of(proc)
    assert report["cells"] == [] and len(report["skipped"]) == 2


def test_bench_unreachable_server() -> None:
    proc = bench("--backend", "resp", "--options",
                 '{"url": "redis://:hunter22pw@127.0.0.1:1/0", "timeout_s": 0.5}', "--seconds",
                 "0.05")
    assert proc.returncode == 1
    assert "did not keep a test value" in proc.stderr and "reachable" in proc.stderr
    assert "127.0.0.1:1" in proc.stderr  # names where it looked
    assert "hunter22pw" not in proc.stderr + proc.stdout, "a password reached the output"
