"""SIGKILL-mid-write campaign for the file tiers (posix with ``fsync: true``, fsspec ``file://``).

Used by tests/faults/test_crash_durability.py (a bounded number of kills) and benchmarks/crash_soak.py
(``--kills N``). :func:`child` (``python -m tests.support.crash_campaign child KIND ROOT SEED``) is the child, a process
of its own (tests/support/engine_processes.py: from the forkserver, not importing torch again): it stores
chunks as fast as it can, flushes every few, and prints ``ok <i> <i>...`` for each batch its
tier's ``flush`` reported done (``put <i>...`` before submitting them), until it is killed.

A chunk's bytes are a function of its key (``payload_for``), and a key names the child's seed
and the store's index (``key_for``/``ids_of``), so the parent can check any file it finds
without the child's help.
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHAPE = (4, 2, 130000)  # 4 layers of 260000 bytes (padded to 262144): ~1 MiB files
BATCH = 3  # stores per flush


def key_for(seed: int, i: int):
    from kvplug.keys import CacheKey

    tail = struct.pack(">II", seed, i)
    return CacheKey("org/crash", "bfloat16", "LBHNC-bs16", 1, 0,
                    hashlib.sha256(tail).digest()[:24] + tail)


def ids_of(key) -> tuple[int, int]:
    return struct.unpack(">II", key.chunk_hash[-8:])


def _payload(key):
    import torch

    gen = torch.Generator().manual_seed(int.from_bytes(key.chunk_hash[:8], "big") >> 1)
    return torch.randint(0, 256, (SHAPE[0] * SHAPE[1] * SHAPE[2],), dtype=torch.uint8,
                         generator=gen)


def payload_bytes(key) -> bytes:
    """The bytes a chunk of ``key`` holds (a function of the key alone)."""
    return _payload(key).numpy().tobytes()


def payload_for(key):
    import torch
    from kvplug.memory import MemoryFormat, heap_memory_obj

    obj = heap_memory_obj(SHAPE, torch.uint8, MemoryFormat.KV_PAGES, 64)
    obj.byte_view.copy_(_payload(key))
    return obj


def make_tier(kind: str, root: Path):
    from kvplug.backends.fsspec import FsspecBackend
    from kvplug.backends.posix import PosixBackend
    from kvplug.hookspecs import TierContext
    from kvplug.memory import heap_memory_obj

    if kind == "posix":
        opts = PosixBackend.Options(path=str(root), fsync=True, io_threads=2)
        tier = PosixBackend(TierContext("disk", opts, heap_memory_obj))
        assert tier.wait_indexed(60), "startup scan hung"  # the index is compared with the files
        return tier
    # a capacity (so the tier keeps an index to compare) far above what a campaign stores: an
    # evicted chunk would read as a lost one
    opts = FsspecBackend.Options(url=f"file://{root}", namespace_dirs=False, capacity="1TiB",
                                 io_threads=2, negative_cache_s=0)
    return FsspecBackend(TierContext("remote", opts, heap_memory_obj))


def child(kind: str, root: str, seed: int) -> None:
    tier = make_tier(kind, Path(root))
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    i = 0
    while True:
        keys = [key_for(seed, i + j) for j in range(BATCH)]
        objs = [payload_for(k) for k in keys]
        out.write("put " + " ".join(str(i + j) for j in range(BATCH)) + "\n")
        out.flush()
        tier.batched_submit_put(keys, objs)
        for o in objs:
            o.ref_down()
        if tier.flush(60):
            out.write("ok " + " ".join(str(i + j) for j in range(BATCH)) + "\n")
            out.flush()
        i += BATCH


def _files(root: Path) -> tuple[list[Path], list[Path]]:
    from kvplug import chunkfile as cf

    chunks, temps = [], []
    for d, _, names in os.walk(root):
        for n in names:
            (chunks if cf.is_chunk_file(n) else temps if cf.is_temp(n) else []).append(Path(d, n))
    return chunks, temps


def check_file(path: Path) -> str | None:
    """None if ``path`` is a whole chunk file holding exactly its key's bytes, else why not."""
    from kvplug import chunkfile as cf
    from kvplug.errors import ChunkFormatError

    with open(path, "rb") as f:
        try:
            header, _ = cf.read_header_fd(f.fileno())
        except ChunkFormatError as exc:
            return f"header: {exc}"
        if cf.relative_chunk_path(header.key) != "/".join(path.parts[-2:]):
            return "file name does not match its key"
        want = payload_bytes(header.key)
        n = header.layer_nbytes
        for layer, off in enumerate(header.data_offsets):
            got = os.pread(f.fileno(), n, off)
            if not cf.verify_layer(header, layer, got):
                return f"layer {layer} checksum"
            if got != want[layer * n:(layer + 1) * n]:
                return f"layer {layer} holds other bytes"
    return None


def _read_until(proc: subprocess.Popen, until: float, line: str | None = None,
                count: int = 1) -> str:
    """What the child wrote until ``until`` or EOF (with ``line``: until ``count`` lines that
    start with it have come)."""
    buf = b""
    fd = proc.stdout.fileno()
    want = line.encode() if line else None

    def seen() -> bool:
        return sum(1 for x in buf.split(b"\n")[:-1] if x.startswith(want)) >= count

    while time.monotonic() < until and not (want and seen()):
        r, _, _ = select.select([fd], [], [], max(0.0, until - time.monotonic()))
        if not r:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
    return buf.decode()


def run_campaign(kind: str, root: Path, kills: int, seed: int = 0,
                 max_delay_s: float = 1.5) -> dict[str, Any]:
    """Kill a storing child ``kills`` times at random moments; check the store after each kill.
    Returns the figures (lists of problems are empty when all is well)."""
    import torch  # noqa: F401 - imported before the children start (their import is timed)

    from tests.support.engine_processes import start_python  # a fresh process, without importing torch again

    rng = random.Random(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    acked: set[tuple[int, int]] = set()
    fig: dict[str, Any] = {"kind": kind, "kills": 0, "acknowledged": 0, "files_checked": 0,
                           "bad_files": [], "lost_acknowledged": [], "index_mismatch": [],
                           "kills_with_temp_left": 0, "temps_left": 0, "stale_temps_left": 0,
                           "kills_in_flight": 0, "seconds": 0.0}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]),
                                                          os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    for k in range(kills):
        # half the incarnations store keys an earlier one stored (overwrites under a kill)
        child_seed = k if k % 2 == 0 else rng.randrange(0, k)
        proc = start_python(f"from tests.support import crash_campaign; crash_campaign.child({kind!r}, "
                            f"{str(root)!r}, {child_seed})", env, str(HERE))
        try:
            # the random moment counts from the first store, not from the child's start (on a
            # busy machine its first store can come later than the longest delay)
            text = _read_until(proc, time.monotonic() + 300, line="put ")
            if "put " not in text:
                raise RuntimeError(f"child did not start storing: {text[-500:]!r}")
            if k % 3 == 2:  # a kill right after a submit: a store in flight, whatever the speed
                text += _read_until(proc, time.monotonic() + 60, line="put ",
                                    count=rng.randint(1, 3))
            else:
                text += _read_until(proc, time.monotonic() + rng.uniform(0.05, max_delay_s))
        finally:
            proc.send_signal(signal.SIGKILL)
            rest = proc.communicate(timeout=60)[0].decode()
        text += rest
        lines = text.split("\n")[:-1]  # a line the kill cut short has no newline: not counted
        done = [int(x) for line in lines if line.startswith("ok ") for x in line.split()[1:]]
        acked.update((child_seed, i) for i in done)
        fig["kills"] += 1
        puts = [line[4:] for line in lines if line.startswith("put ")]
        oks = [line[3:] for line in lines if line.startswith("ok ")]
        fig["kills_in_flight"] += int(bool(puts) and (not oks or oks[-1] != puts[-1]))
        _check_restart(kind, root, acked, fig)
    fig["acknowledged"] = len(acked)
    fig["seconds"] = round(time.monotonic() - start, 1)
    return fig


def _check_restart(kind: str, root: Path, acked: set[tuple[int, int]], fig: dict) -> None:
    from kvplug import chunkfile as cf

    chunks, temps = _files(root)
    fig["kills_with_temp_left"] += int(bool(temps))
    fig["temps_left"] += len(temps)
    for p in chunks:
        why = check_file(p)
        fig["files_checked"] += 1
        if why:
            fig["bad_files"].append(f"{p}: {why}")
    on_disk = {"/".join(p.parts[-2:]) for p in chunks}
    for seed, i in sorted(acked):
        if cf.relative_chunk_path(key_for(seed, i)) not in on_disk:
            fig["lost_acknowledged"].append((seed, i))
    # temporary files of a crashed writer are stale once old enough: age them, then restart
    old = time.time() - cf.TEMP_MAX_AGE_S - 60
    for t in temps:
        os.utime(t, (old, old))
    tier = make_tier(kind, root)
    try:
        entries = tier.stats().get("entries")
        if entries != len(chunks):
            fig["index_mismatch"].append((len(chunks), entries))
        sample = random.Random(len(acked)).sample(sorted(acked), min(5, len(acked)))
        for seed, i in sample:  # acknowledged stores load through a fresh tier, verified
            key = key_for(seed, i)
            obj = tier.get(key)
            if obj is None or bytes(obj.byte_view.numpy()) != payload_bytes(key):
                fig["lost_acknowledged"].append(("load", seed, i))
            if obj is not None:
                obj.ref_down()
    finally:
        tier.close()
    fig["stale_temps_left"] += len([t for t in temps if t.exists()])


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
