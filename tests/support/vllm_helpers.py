"""Helpers for tests that run a real vLLM engine on CPU (tiny local model, token-id prompts).

Everything is importable from spawned processes (vLLM on CPU forces ``spawn``), and nothing here
copies vLLM's own test code.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvplug.hookspecs import hookimpl

REPO = Path(__file__).resolve().parents[2]
RESULT = "KVPLUG-TEST-RESULT "
Output = tuple[list[int], list[float]]  # generated token ids and their logprobs


def engine_env() -> None:
    """Environment every engine in the tests uses (set before vLLM is imported).

    vLLM's multi-process layout by default. A test module that sets ``ENGINES_IN_PROCESS = True``
    runs its engines in-process instead (tests/conftest.py sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for it: vLLM's in-process client and single-process
    executor, scheduler and worker side by side as in vLLM's one-GPU ``UniProcExecutor``). On CPU
    the default spawns two more processes (engine core, then a worker), each importing torch and
    vLLM again: most of a ~20 s start-up on 2 cores. Not for a module whose engine must step on
    its own while the caller waits (test_connector_engine_async.py) or that imports moto/Flask
    into the engine's process (test_reliability_outage.py: vLLM's CPU kernel registration trips
    over Flask's proxies)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for need in (str(REPO),):  # test-only tiers/hooks in every process
        if need not in parts:
            parts.insert(0, need)
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def kvplug_config(cache_dir: str | os.PathLike[str], *, local_cpu: bool = True,
                  posix: bool = True, **extra: Any) -> dict[str, Any]:
    """A kvplug config dict with explicit tiers under ``cache_dir``."""
    tiers: list[dict[str, Any]] = []
    if local_cpu:
        tiers.append({"backend": "local_cpu", "options": {"capacity": "256MiB"}})
    if posix:
        tiers.append({"backend": "posix",
                      "options": {"path": str(Path(cache_dir) / "chunks"), "capacity": "2GiB"}})
    return {"tiers": tiers, **extra}


def transfer_config(kind: str, extra: dict[str, Any] | None = None, role: str = "kv_both",
                    policy: str = "recompute") -> dict[str, Any] | None:
    """``kv_transfer_config`` for "kvplug", "example" (vLLM's ExampleConnector) or "none".
    kvplug's per-request report is on (``report_to_client``) unless ``extra`` says otherwise."""
    if kind == "none":
        return None
    if kind == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": extra or {}}
    return {"kv_connector": "KVPlugConnector", "kv_connector_module_path": "kvplug.connector",
            "kv_role": role, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"report_to_client": True, **(extra or {})}}


def make_llm(model: str | os.PathLike[str], kv: dict[str, Any] | None = None, **kw: Any):
    """A small CPU engine: eager, no tokenizer, vLLM's own prefix cache off unless asked."""
    engine_env()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args: dict[str, Any] = dict(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                                enable_prefix_caching=False, max_model_len=4096,
                                max_num_batched_tokens=4096, max_num_seqs=8, dtype="bfloat16",
                                seed=0)
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = KVTransferConfig(**kv)
    return LLM(**args)


def prompt(n: int, seed: int, vocab: int = 4096) -> list[int]:
    """``n`` random token ids (ids 3.. so no special token), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 8,
             params: list[dict[str, Any] | None] | None = None) -> list[Output]:
    """Greedy generation; returns (token ids, logprobs of those tokens) per prompt."""
    return [(o["tokens"], o["logprobs"]) for o in generate_full(llm, prompts, max_tokens, params)]


def generate_full(llm: Any, prompts: list[list[int]], max_tokens: int = 8,
                  params: list[dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
    """Greedy generation with everything a test checks: tokens, logprobs, kvplug's report.
    ``params[i]`` is prompt ``i``'s ``kv_transfer_params``, but for a ``cache_salt`` entry: the
    prompt's salt (its tenant)."""
    from vllm import SamplingParams, TokensPrompt

    sps, salts = [], []
    for extra in params or [None] * len(prompts):
        extra = dict(extra or {})
        salts.append(extra.pop("cache_salt", None))
        sps.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0,
                                  ignore_eos=True,
                                  extra_args={"kv_transfer_params": extra} if extra else None))
    inputs = [TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {}))
              for p, salt in zip(prompts, salts, strict=True)]
    outs = llm.generate(inputs, sps, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
        result.append({"tokens": list(c.token_ids), "logprobs": lps,
                       "cached": o.num_cached_tokens,
                       "kvplug": (o.kv_transfer_params or {}).get("kvplug")})
    return result


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two :func:`generate_full` results are the same generation: equal tokens and
    bit-equal logprobs (what a cache hit must never change)."""
    return (a["tokens"], a["logprobs"]) == (b["tokens"], b["logprobs"])


def run_script(code: str, timeout: float = 600, env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in a fresh process (a fresh engine; tests/support/engine_processes.py); it prints
    ``RESULT`` + JSON. ``env``: extra environment variables for that process only."""
    from tests.support.engine_processes import StillRunning, run_python

    engine_env()
    try:
        proc = run_python(code, {**os.environ, **(env or {})}, str(REPO), timeout)
    except StillRunning as exc:  # say where the engine stood: its log so far
        raise RuntimeError(f"engine subprocess still running after {timeout} s (killed):\n"
                           f"{exc.stderr[-6000:]}\n-- stdout (vLLM's log) --\n"
                           f"{exc.stdout[-6000:]}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"subprocess failed ({proc.returncode}):\n{proc.stderr[-6000:]}\n"
                           f"-- stdout (vLLM's log) --\n{proc.stdout[-6000:]}")
    at = proc.stdout.rfind(RESULT)
    if at >= 0:  # other processes' log lines may follow on the same line: decode one value
        return json.JSONDecoder().raw_decode(proc.stdout[at + len(RESULT):])[0]
    raise RuntimeError(f"no result line in the subprocess output:\n{proc.stdout[-3000:]}")


def run_scenario(model: str | os.PathLike[str], kv: dict[str, Any] | None,
                 steps: list[tuple], engine: dict[str, Any] | None = None,
                 timeout: float = 900, env: dict[str, str] | None = None) -> list[Any]:
    """Start one engine in a fresh process and run ``steps`` in order; returns one result per
    step. Steps: ``("gen", prompt, params|None)`` -> generate_full's dict;
    ``("write", path, text)``; ``("corrupt", dir)`` flips bytes in the middle of every file
    under ``dir`` (returns how many); ``("reload", model_dir)`` loads other weights in place
    through vLLM's own loading path (``reload_weights``); ``("reset", reset_connector)`` is
    ``LLM.reset_prefix_cache`` (returns its answer); ``("spec_metrics",)``: vLLM's speculative
    decoding counters so far (drafts, draft tokens, accepted tokens)."""
    spec = json.dumps({"model": str(model), "kv": kv, "steps": steps, "engine": engine or {}})
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); "
            "from tests.support import vllm_helpers as h; "
            f"print(h.RESULT + json.dumps(h._scenario(json.loads({spec!r}))), flush=True)")
    return run_script(code, timeout=timeout, env=env)


def _scenario(spec: dict[str, Any]) -> list[Any]:
    llm = make_llm(spec["model"], spec["kv"], **spec["engine"])
    out: list[Any] = []
    for step in spec["steps"]:
        if step[0] == "gen":
            n = step[3] if len(step) > 3 else 8  # ("gen", prompt, params[, max_tokens])
            out.append(generate_full(llm, [step[1]], max_tokens=n, params=[step[2]])[0])
        elif step[0] == "write":
            Path(step[1]).write_text(step[2])
            out.append(None)
        elif step[0] == "corrupt":
            n = 0
            for f in sorted(Path(step[1]).rglob("*")):
                if f.is_file() and f.stat().st_size > 8192:
                    with open(f, "r+b") as fh:
                        fh.seek(f.stat().st_size // 2)
                        b = fh.read(64)
                        fh.seek(f.stat().st_size // 2)
                        fh.write(bytes(x ^ 0xFF for x in b))
                    n += 1
            out.append(n)
        elif step[0] == "reload":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": step[1]})
            out.append(None)
        elif step[0] == "reset":
            out.append(llm.reset_prefix_cache(reset_connector=step[1]))
        elif step[0] == "spec_metrics":  # speculative decoding counters so far (needs stats on)
            got: dict[str, float] = {}
            for m in llm.get_metrics():
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
                    name = m.name.removeprefix("vllm:spec_decode_")
                    got[name] = got.get(name, 0) + m.value
            out.append(got)
    return out


def stored_chunks(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every chunk file under ``root``, read from its header: the parallel key fields
    (``world_size``/``rank``, ``pp_size``/``pp_rank``/``layers``, ``chunk_hash`` in hex),
    ``num_layers``, ``num_tokens``, ``path`` and a sha256 of the payload (what each TP rank or
    PP stage stored)."""
    import hashlib

    from kvplug.chunkfile import is_chunk_file, read_header_fd

    out = []
    for f in sorted(Path(root).rglob("*")):
        if not (f.is_file() and is_chunk_file(f.name)):
            continue
        with open(f, "rb") as fh:
            header, _ = read_header_fd(fh.fileno())
            fh.seek(header.header_bytes)
            payload = hashlib.sha256(fh.read()).hexdigest()
        k = header.key
        out.append({"chunk_hash": k.hex, "world_size": k.world_size, "rank": k.rank,
                    "pp_size": k.pp_size, "pp_rank": k.pp_rank, "layers": k.layers,
                    "num_layers": header.num_layers, "num_tokens": header.num_tokens,
                    "path": str(f), "payload": payload})
    return out


# -- test-only pieces loaded by the engines' worker processes -----------------------------------

#: how long a stalled FaultTier call sleeps: 8x the 1 s timeouts the fault tests set
STALL_S = 8.0


class FaultTier:
    """A test-only tier (kept in memory) whose ``get``/``contains`` misbehave on demand.

    The mode is read from the file ``options["control"]`` at every call: ``ok``; ``vanish`` (the
    chunk disappears between lookup and load); ``raise``; ``stall`` (``get`` sleeps past the tier
    timeout); ``stall_lookup`` (``contains`` sleeps past the lookup timeout); ``truncate`` (a chunk
    covering fewer tokens than promised).
    """

    def __init__(self, ctx: Any) -> None:
        import threading

        self.ctx = ctx
        self.control = Path(ctx.options["control"])
        self.data: dict[Any, Any] = {}
        self.lock = threading.Lock()

    def _mode(self) -> str:
        try:
            return self.control.read_text().strip() or "ok"
        except OSError:
            return "ok"

    @hookimpl
    def batched_submit_put(self, keys: Any, objs: Any) -> None:
        with self.lock:
            for k, o in zip(keys, objs, strict=True):
                self.data[k] = (o.tensor.clone(), o.meta)

    @hookimpl
    def contains(self, keys: Any) -> list[bool]:
        import time

        if self._mode() == "stall_lookup":
            time.sleep(STALL_S)
        with self.lock:
            return [k in self.data for k in keys]

    @hookimpl
    def evict(self, keys: Any, nbytes: int) -> int:
        with self.lock:
            gone = [self.data.pop(k, None) for k in (list(self.data) if keys is None else keys)]
        return sum(g[0].numel() for g in gone if g is not None)

    @hookimpl
    def get(self, key: Any) -> Any:
        import time

        mode = self._mode()
        if mode == "raise":
            raise RuntimeError("FaultTier: injected failure")
        if mode == "stall":
            time.sleep(STALL_S)
        with self.lock:
            item = self.data.pop(key, None) if mode == "vanish" else self.data.get(key)
        if item is None or mode == "vanish":
            return None
        t, meta = item
        tokens = meta.num_tokens // 2 if mode == "truncate" else meta.num_tokens
        obj = self.ctx.allocate(meta.shape, meta.dtype, meta.fmt, tokens)
        if obj is None:
            return None
        obj.tensor.copy_(t)
        return obj


# -- driving vLLM's Scheduler directly (no engine, no workers) ----------------------------------

def make_scheduler(model_dir: str | os.PathLike[str], extra: dict[str, Any] | None = None,
                   role: str = "kv_both", block_size: int = 128, num_blocks: int = 200,
                   max_num_batched_tokens: int = 4096, prefix_caching: bool = False,
                   policy: str = "recompute", groups: list[Any] | None = None,
                   pipeline_parallel_size: int = 1, async_scheduling: bool = False,
                   scheduling_policy: str = "fcfs") -> Any:
    """A real vLLM ``Scheduler`` whose SCHEDULER-role connector is kvplug's. Saves are
    synchronous unless ``extra`` says otherwise: with asynchronous saves vLLM holds every
    finished request that saved until a worker reports it, and no worker runs here.
    ``groups``: vLLM ``KVCacheGroupSpec``s (hybrid models); one full-attention group if None.
    ``pipeline_parallel_size``, ``async_scheduling``: what vLLM's config says (the engine core's
    batch queue; the scheduler itself is the plain one either way)."""
    engine_env()
    extra = {"async_save": False, **(extra or {})}
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=4096)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cache.num_gpu_blocks = num_blocks
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=4096, enable_chunked_prefill=True,
                            is_encoder_decoder=False, policy=scheduling_policy)
    vllm_config = VllmConfig(
        model_config=model, cache_config=cache, scheduler_config=sched,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
        kv_transfer_config=KVTransferConfig(**transfer_config("kvplug", extra, role, policy)))
    if async_scheduling:  # VllmConfig resolves it off on CPU; a CUDA engine's default
        vllm_config.scheduler_config.async_scheduling = True
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=groups or [KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                     block_size=block_size,
                     structured_output_manager=StructuredOutputManager(vllm_config))



def worker_connector(w: Any) -> Any:
    """kvplug's connector object in the WORKER role around a ``WorkerSide`` (its hooks, not a
    copy of them; built without vLLM's distributed state, which only ``__init__`` reads)."""
    from kvplug.connector import KVPlugConnector

    c = KVPlugConnector.__new__(KVPlugConnector)
    c._worker, c._sched, c._watch, c._book = w, None, None, None
    c._connector_metadata = None
    c._events_on = False
    return c


@contextlib.contextmanager
def transfer_group(c: Any) -> Iterator[None]:
    """``c`` is this process's KV transfer group (what vLLM's workers reach through
    ``get_kv_transfer_group()``) inside the block."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state._KV_CONNECTOR_AGENT = c
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None


def runner_connector(vllm_config: Any, c: Any, kv_caches: dict[str, Any]) -> Any:
    """vLLM's V2 model runner connector (``ActiveKVConnector``) around ``c``, built as vLLM
    builds it: ``c`` is the KV transfer group while it registers the KV caches."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    with transfer_group(c):
        return ActiveKVConnector(vllm_config, kv_caches)

def make_request(req_id: str, tokens: list[int], max_tokens: int = 4,
                 kv_transfer_params: dict[str, Any] | None = None, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                        extra_args={"kv_transfer_params": kv_transfer_params}
                        if kv_transfer_params else None)
    return Request(req_id, list(tokens), sp, None, **kw)


class FakeLookup:
    """Stands in for the worker lookup: a set of stored chunk hashes, with a call log."""

    def __init__(self) -> None:
        self.stored: set[bytes] = set()
        self.calls: list[tuple[str, int]] = []
        self.released: list[str] = []
        self.fresh: list[bool] = []  # per call: whether the tiers were told to forget misses

    def lookup(self, req_id: str, hashes: list[bytes], tails: list[tuple[int, bytes]],
               tenant: str = "", fresh: bool = False) -> int:
        self.calls.append((req_id, len(hashes)))
        self.fresh.append(fresh)
        n = next((i for i, h in enumerate(hashes) if h not in self.stored), len(hashes))
        if n == len(hashes):
            for end, h in tails:
                if h in self.stored:
                    return end
        return n * 256

    def release(self, req_ids: list[str]) -> None:
        self.released.extend(req_ids)

    def close(self) -> None:
        pass


def model_runner_output(scheduler_output: Any, token: int = 5) -> Any:
    """A ModelRunnerOutput sampling ``token`` for every request that finished its prefill."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids])
