"""Child steps of the full-disk and read-only tests (tests/faults/test_full_disk.py), run inside a
private mount namespace on a small real tmpfs: ``python -m tests.support.disk_faults STEP DIR``.

Each step prints one ``RESULT <json>`` line. Chunks and their bytes come from crash_campaign
(``key_for``/``payload_for``/``check_file``), so any file can be checked without the writer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.crash_campaign import _files, check_file, key_for, payload_bytes, payload_for

RESULT = "RESULT "
HERE = Path(__file__).resolve().parent
CHUNK_FILE = 4096 + 4 * 262144  # crash_campaign's chunk file size


class DiskFaultsUnavailable(Exception):
    """This machine cannot mount a private tmpfs (no unshare, or the kernel refused)."""


def _namespace_cmd() -> list[str]:
    if shutil.which("unshare") is None:
        raise DiskFaultsUnavailable("no unshare(1) on this machine: cannot mount a private tmpfs")
    if os.geteuid() == 0:
        return ["unshare", "--mount", "--propagation", "private"]
    return ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]


def run_disk_faults(disk_bytes: int, stores: int = 30) -> dict:
    """Mount a ``disk_bytes`` tmpfs in a private mount namespace (nothing is mounted on the
    machine; the mount dies with the namespace) and run the steps below in it, in order: fill,
    evict (capacity half the disk), read-only for user ``nobody`` (root only), then the mount
    remounted read-only. Returns each step's result by name."""
    mnt = Path(tempfile.mkdtemp(prefix="kvplug-fulldisk-", dir="/tmp"))
    mnt.chmod(0o755)  # the unprivileged step must reach it
    py, me = sys.executable, "-m tests.support.disk_faults"
    root = f"{mnt}/chunks"
    user_step = (f"setpriv --reuid 65534 --regid 65534 --clear-groups {py} {me} readonly {root}"
                 if os.geteuid() == 0 and shutil.which("setpriv") else "echo RESULT null")
    script = "\n".join([
        "set -e",
        f"mount -t tmpfs -o size={disk_bytes},mode=0755 kvplug-fulldisk {mnt}",
        "echo MOUNTED",
        f"{py} {me} fill {root} {stores}",
        f"{py} {me} evict {root} {disk_bytes // 2}",
        user_step,
        f"mount -o remount,ro {mnt}",
        f"{py} {me} readonly {root}",
    ])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]),
                                                          os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([*_namespace_cmd(), "sh", "-c", script], capture_output=True,
                              text=True, timeout=540, env=env)
    finally:
        shutil.rmtree(mnt, ignore_errors=True)
    if "MOUNTED" not in proc.stdout:
        raise DiskFaultsUnavailable(
            f"mounting a tmpfs in a private namespace was refused: {proc.stderr[-300:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"a disk-fault step failed:\n{proc.stderr[-4000:]}")
    found = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines()
             if line.startswith(RESULT)]
    return dict(zip(["fill", "evict", "user", "readonly_fs"], found, strict=True))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _tier(root: str, capacity: str):
    from kvplug.backends.posix import PosixBackend
    from kvplug.hookspecs import TierContext
    from kvplug.memory import heap_memory_obj

    # world-readable on purpose: the ``nobody`` step reads what root stored (files are private,
    # 0600 in 0700 directories, unless the operator shares them like this)
    opts = PosixBackend.Options(path=root, capacity=capacity, io_threads=2, file_mode="0644")
    tier = PosixBackend(TierContext("disk", opts, heap_memory_obj))
    assert tier.wait_indexed(60), "startup scan hung"
    return tier


def _loads(tier, keys) -> dict[str, int]:
    """Load every key; how many came back exact, missing, or wrong."""
    out = {"exact": 0, "missing": 0, "wrong": 0}
    for k in keys:
        obj = tier.get(k)
        if obj is None:
            out["missing"] += 1
            continue
        out["exact" if bytes(obj.byte_view.numpy()) == payload_bytes(k) else "wrong"] += 1
        obj.ref_down()
    return out


def _disk(root: str) -> dict[str, int]:
    st = os.statvfs(root)
    return {"disk_size": st.f_blocks * st.f_frsize, "disk_free": st.f_bavail * st.f_frsize}


def _on_disk(root: str) -> dict:
    chunks, temps = _files(Path(root))
    return {"files": len(chunks), "temps": len(temps),
            "bad": [str(p) for p in chunks if check_file(p)],
            "bytes": sum(p.stat().st_size for p in chunks)}


def step_fill(root: str, stores: int) -> dict:
    """Capacity far above the disk: store one by one until the disk is full and beyond, loading
    what was stored between stores; then check what is on disk."""
    warn = _Warnings()
    logging.getLogger("kvplug").addHandler(warn)
    tier = _tier(root, "1GiB")
    stored, failed, loads_while_full = [], 0, {"exact": 0, "missing": 0, "wrong": 0}
    for i in range(stores):
        key = key_for(1, i)
        before = tier.stats()["failed_puts"]
        obj = payload_for(key)
        tier.batched_submit_put([key], [obj])
        obj.ref_down()
        assert tier.flush(60)
        if tier.stats()["failed_puts"] > before:
            failed += 1
            for k, v in _loads(tier, stored).items():  # loads go on while the disk is full
                loads_while_full[k] += v
        else:
            stored.append(key)
    stats = tier.stats()
    disk = _disk(root)
    tier.close()
    store_warnings = [w for w in warn.lines if "store into" in w]
    return {"stored": len(stored), "failed": failed, "failed_puts": stats["failed_puts"],
            "store_warnings": len(store_warnings), "warning": store_warnings[:1],
            "loads_while_full": loads_while_full, **disk, **_on_disk(root)}


def step_evict(root: str, capacity: int) -> dict:
    """Capacity below the disk's size on the same (full) disk: the restart trims to capacity,
    then every store succeeds, evicting older chunks."""
    tier = _tier(root, str(capacity))
    after_restart = _disk(root)["disk_free"]
    keys = [key_for(2, i) for i in range(20)]
    for key in keys:
        obj = payload_for(key)
        tier.batched_submit_put([key], [obj])
        obj.ref_down()
        assert tier.flush(60)
    stats = tier.stats()
    loads = _loads(tier, keys[-3:])  # the newest survive eviction
    tier.close()
    return {"free_after_restart": after_restart, "failed_puts": stats["failed_puts"],
            "writes": stats["writes"], "evictions": stats["evictions"],
            "tier_bytes": stats["bytes"], "capacity": capacity, "loads_newest": loads,
            **_disk(root), **_on_disk(root)}


def step_readonly(root: str) -> dict:
    """A directory this process cannot write (read-only mount, or another user's directory):
    stores are dropped and counted, a warning once, loads go on."""
    warn = _Warnings()
    logging.getLogger("kvplug").addHandler(warn)
    before = _on_disk(root)
    existing = []
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(".safetensors"):
                from kvplug import chunkfile as cf

                with open(os.path.join(d, n), "rb") as f:
                    existing.append(cf.read_header_fd(f.fileno())[0].key)
    tier = _tier(root, "1GiB")
    for i in range(5):
        key = key_for(3, i)
        obj = payload_for(key)
        tier.batched_submit_put([key], [obj])
        obj.ref_down()
    assert tier.flush(60)
    stats = tier.stats()
    loads = _loads(tier, existing)
    tier.close()
    return {"uid": os.geteuid(), "writable": stats["writable"], "dropped": stats["dropped_puts"],
            "failed": stats["failed_puts"], "warnings": len(warn.lines), "warning": warn.lines[:2],
            "loads": loads, "files_before": before["files"], **_on_disk(root)}


if __name__ == "__main__":
    step, root = sys.argv[1], sys.argv[2]
    if step == "fill":
        res = step_fill(root, int(sys.argv[3]))
    elif step == "evict":
        res = step_evict(root, int(sys.argv[3]))
    else:
        res = step_readonly(root)
    print(RESULT + json.dumps(res), flush=True)
