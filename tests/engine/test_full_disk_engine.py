"""A real vLLM engine storing onto a real full disk
(tests/faults/test_full_disk.py with an engine).

The engine's process enters a private mount namespace (``unshare(CLONE_NEWNS)``: root only, so
the test is skipped otherwise) and mounts a 6 MiB tmpfs as its posix tier's directory, with a
capacity far above that. Six prompts of four chunks each need about 12 MiB, so the disk fills
while the engine stores. Served again: every output equals its cold reference, the chunks that
were stored load (hits go on), the failed stores are counted, and what is on the disk is whole:
no temporary file, every chunk file verifies.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.vllm_helpers import REPO, kvplug_config, prompt, run_script, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)

DISK = 6 << 20
PROMPTS = [prompt(1100, 700 + i) for i in range(6)]


def _drive(spec: dict) -> dict:
    """The engine process: its own mount namespace and tmpfs, then cold and warm passes."""
    import ctypes
    import subprocess
    from pathlib import Path

    from tests.support import vllm_helpers as h
    from tests.support.corruption_campaign import _verify_all, worker_posix_stats
    from tests.support.crash_campaign import _files

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        return {"skip": f"unshare(CLONE_NEWNS) refused: errno {ctypes.get_errno()}"}
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    mnt = spec["mnt"]
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['disk']}", "kvplug-full", mnt],
                   check=True)
    llm = h.make_llm(spec["model"], spec["kv"], max_num_batched_tokens=256)
    cold = [h.generate_full(llm, [p])[0] for p in spec["prompts"]]
    warm = [h.generate_full(llm, [p])[0] for p in spec["prompts"]]
    stats = llm.collective_rpc(worker_posix_stats)[0]
    st = os.statvfs(mnt)
    chunks, temps = _files(Path(mnt) / "chunks")
    return {"cold": cold, "warm": warm, "stats": stats, "disk_size": st.f_blocks * st.f_frsize,
            "disk_free": st.f_bavail * st.f_frsize, "temps": len(temps),
            "files": _verify_all(Path(mnt) / "chunks"), "chunk_files": len(chunks)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    if os.geteuid() != 0:
        pytest.skip("the engine's own mount namespace needs root")
    model = make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")
    mnt = tmp_path_factory.mktemp("full-disk-mnt")
    kv = transfer_config("kvplug", kvplug_config(mnt, local_cpu=False))
    kv["kv_connector_extra_config"]["tiers"][0]["options"]["capacity"] = "1GiB"
    spec = json.dumps({"model": str(model), "kv": kv, "mnt": str(mnt), "disk": DISK,
                       "prompts": PROMPTS})
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO)!r}); "
            "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'; "
            "from tests.support import vllm_helpers as h; from tests.engine.test_full_disk_engine import _drive; "
            f"print(h.RESULT + json.dumps(_drive(json.loads({spec!r}))), flush=True)")
    out = run_script(code, timeout=850)
    if "skip" in out:
        pytest.skip(out["skip"])
    print("FIGURES full-disk-engine", json.dumps({  # for docs/reliability.md (pytest -s)
        "served": 2 * len(PROMPTS), "wrong": sum(w["tokens"] != c["tokens"] or w["logprobs"] !=
                                                 c["logprobs"] for w, c in zip(out["warm"],
                                                                               out["cold"])),
        "writes": out["stats"]["writes"], "failed_puts": out["stats"]["failed_puts"],
        "loaded_tokens": sum(w["kvplug"]["loaded_tokens"] for w in out["warm"]),
        "disk_free": out["disk_free"], "temps": out["temps"], "files": len(out["files"])}))
    return out


def test_engine_on_a_full_disk(run):
    same = lambda a, b: a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]  # noqa: E731
    assert run["disk_size"] == DISK
    assert all(same(w, c) for w, c in zip(run["warm"], run["cold"], strict=True))  # 0 wrong
    s = run["stats"]
    assert s["failed_puts"] > 0 and s["writes"] > 0  # the disk filled while the engine stored
    assert run["disk_free"] < 600 << 10  # not one more chunk file (~516 KiB) fits
    loaded = sum(w["kvplug"]["loaded_tokens"] for w in run["warm"])
    assert loaded > 0  # hits go on from what was stored before the disk filled
    assert sum(w["kvplug"]["failed_blocks"] for w in run["warm"]) == 0
    assert run["temps"] == 0 and run["chunk_files"] == s["writes"]
    assert set(run["files"].values()) == {"ok"}
