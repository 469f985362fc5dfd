"""Corruption while serving: the engine-side driver of tests/engine/test_corruption_serving.py and of
``python -m benchmarks.reliability corruption`` (the damage, the engine process, the final check).

``run_corruption`` starts one vLLM engine in a fresh process (posix tier only); see the test's
docstring for what happens in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHUNK = 256


def worker_posix_stats(worker) -> dict[str, float]:
    """Runs in the worker (``collective_rpc``): the posix tier's counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.storage.stats()["posix"]


def damage(path: str, rng, how: str) -> dict:
    """Damage one chunk file in place: ``flip`` one byte the format covers (header or a layer's
    bytes, chosen from the file's own header), or ``truncate`` it to a random shorter length."""
    import os

    from kvplug import chunkfile as cf

    size = os.path.getsize(path)
    if how == "truncate":
        new = rng.randrange(0, size)
        os.truncate(path, new)
        return {"path": path, "how": how, "at": new, "ino": os.stat(path).st_ino}
    with open(path, "r+b") as f:
        header, _ = cf.read_header_fd(f.fileno())
        regions = [(0, header.header_bytes)] + [
            (off, off + header.layer_nbytes) for off in header.data_offsets]
        lo, hi = regions[rng.randrange(len(regions))]
        at = rng.randrange(lo, hi)
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ rng.randrange(1, 256)]))
    return {"path": path, "how": how, "at": at, "ino": os.stat(path).st_ino}


def _drive(spec: dict) -> dict:
    """The engine process: cold references, damaged rounds, a final sweep; worker stats."""
    import random
    import threading
    import time
    from pathlib import Path

    from kvplug import chunkfile as cf

    from tests.support import vllm_helpers as h
    from tests.support.corruption_campaign import damage, worker_posix_stats

    rng = random.Random(spec["seed"])
    root = Path(spec["store"]) / "chunks"
    llm = h.make_llm(spec["model"], spec["kv"], max_num_batched_tokens=spec["chunk"])
    prompts = spec["prompts"]
    cold = [h.generate_full(llm, [p])[0] for p in prompts]
    rounds: list[list[dict]] = []
    damaged: list[dict] = []
    lock = threading.Lock()

    def damager(k: int, delay: float) -> None:
        time.sleep(delay)
        files = sorted(str(f) for f in root.rglob("*") if f.is_file() and cf.is_chunk_file(f.name))
        with lock:
            taken = {d["path"] for d in damaged}
        for path in rng.sample([f for f in files if f not in taken], min(k, len(files))):
            try:
                d = damage(path, rng, rng.choice(["flip", "truncate"]))
            except (FileNotFoundError, ValueError):  # quarantined or replaced meanwhile
                continue
            with lock:
                damaged.append(d)

    for r in range(spec["rounds"] + 1):
        t = None
        if r < spec["rounds"]:  # the last round only reads what is still damaged
            t = threading.Thread(target=damager, args=(rng.randint(2, 4), rng.uniform(0, 1.5)))
            t.start()
        rounds.append([h.generate_full(llm, [p])[0] for p in prompts])
        if t is not None:
            t.join()
    # one more read of every prompt: a file damaged after its read in the last damaging round
    rounds.append([h.generate_full(llm, [p])[0] for p in prompts])
    present = {}
    for d in damaged:
        try:
            present[d["path"]] = Path(d["path"]).stat().st_ino
        except FileNotFoundError:
            pass
    return {"cold": cold, "rounds": rounds, "damaged": damaged, "present": present,
            "stats": llm.collective_rpc(worker_posix_stats)[0]}


def _verify_all(root) -> dict[str, str]:
    """Every chunk file under ``root`` -> "ok" or why it does not verify (header + checksums)."""
    import os
    from pathlib import Path

    from kvplug import chunkfile as cf
    from kvplug.errors import ChunkFormatError

    out = {}
    for f in sorted(Path(root).rglob("*")):
        if not (f.is_file() and cf.is_chunk_file(f.name)):
            continue
        with open(f, "rb") as fh:
            try:
                header, _ = cf.read_header_fd(fh.fileno())
                data = os.pread(fh.fileno(), header.file_size - header.header_bytes,
                                header.header_bytes)
                ok = all(cf.checksum(data[o - header.header_bytes:
                                          o - header.header_bytes + header.layer_nbytes]) == s
                         for o, s in zip(header.data_offsets, header.checksums, strict=True))
                out[str(f)] = "ok" if ok else "checksum"
            except ChunkFormatError as exc:
                out[str(f)] = str(exc)
    return out


def run_corruption(model: str | Path, store: str | Path, prompts: list[list[int]], rounds: int,
                   seed: int, timeout: float = 1100) -> dict[str, Any]:
    """Serve ``prompts`` cold, then ``rounds`` damaged rounds and two clean ones, in one engine;
    returns the outputs, the damage, the worker's posix stats and every file's verification."""
    from tests.support.vllm_helpers import REPO, kvplug_config, run_script, transfer_config

    kv = transfer_config("kvplug", kvplug_config(store, local_cpu=False))
    spec = json.dumps({"model": str(model), "kv": kv, "store": str(store), "prompts": prompts,
                       "rounds": rounds, "seed": seed, "chunk": CHUNK})
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO)!r}); "
            "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'; "
            "from tests.support import vllm_helpers as h; from tests.support.corruption_campaign import _drive; "
            f"print(h.RESULT + json.dumps(_drive(json.loads({spec!r}))), flush=True)")
    out = run_script(code, timeout=timeout)
    out["files"] = _verify_all(Path(store) / "chunks")
    return out


def summary(out: dict[str, Any]) -> dict[str, Any]:
    """The figures of a run: outputs served, wrong ones, files damaged, quarantined, counted."""
    same = lambda a, b: a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]  # noqa: E731
    served = [(r, i) for r, outs in enumerate(out["rounds"]) for i in range(len(outs))]
    wrong = [(r, i) for r, i in served if not same(out["rounds"][r][i], out["cold"][i])]
    present = out["present"]
    unread = [d for d in out["damaged"]
              if d["path"] in present and out["files"][d["path"]] != "ok"]
    quarantined = len(out["damaged"]) - len(unread)
    return {"served": len(served) + len(out["cold"]), "wrong_outputs": len(wrong),
            "damaged": len(out["damaged"]),
            "flips": sum(d["how"] == "flip" for d in out["damaged"]),
            "truncations": sum(d["how"] == "truncate" for d in out["damaged"]),
            "quarantined": quarantined, "corrupt_counted": int(out["stats"]["corrupt"]),
            "unread_at_end": len(unread),
            "loaded_tokens": sum(o["kvplug"]["loaded_tokens"] for r in out["rounds"] for o in r),
            "failed_blocks": sum(o["kvplug"]["failed_blocks"] for r in out["rounds"] for o in r)}


