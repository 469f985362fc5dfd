"""What a stored chunk *is*: the key fields, read from vLLM's config in one place, and what
besides the tokens names a request's chunk.

:func:`build_identity` turns a ``VllmConfig`` and this worker's TP/PP ranks into plain values and
hands them to :mod:`kvplug.keys`, which computes the model namespace and the dtype token (the
one place that defines them). The KV tensor dtype is known only once the caches are registered,
so :meth:`Identity.key` takes it.

:func:`chunk_extra_keys` (the scheduler side) adds what besides the tokens identifies a chunk of a
request: multimodal inputs, LoRA adapter, prompt embeddings and cache salt, mixed into the chunk
hash by :class:`kvplug.tokens.TokenDatabase`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from kvplug.keys import (
    CacheKey,
    epoch_digest,
    kv_dtype_token,
    model_namespace,
    model_source,
    scale_token,
)

from .config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


@dataclass
class Identity:
    """The key fields every chunk of this worker carries (except the hash and tensor dtype)."""

    model: str  # readable model name
    layout: str  # e.g. "LBHNC-bs128"
    world_size: int  # TP size
    rank: int  # TP rank
    engine_id: str
    model_digest: str = ""  # kvplug.keys.model_namespace's digest
    cache_dtype: str = "auto"  # vLLM's cache_config.cache_dtype
    scales: str = ""  # k/v scale mode (kvplug.keys.scale_token)
    pp_size: int = 1
    pp_rank: int = 0
    layer_start: int = 0  # this pipeline stage's layers: [layer_start, layer_end)
    layer_end: int = 0

    @property
    def layers(self) -> str:
        return f"{self.layer_start}-{self.layer_end}" if self.layer_end > self.layer_start else ""

    def key(self, tensor_dtype: str, chunk_hash: bytes, epoch: str = "",
            tenant: str = "") -> CacheKey:
        """The key of one chunk, given the dtype of the registered KV tensors, the weights
        epoch (``""`` until the weights change in place: see :func:`kvplug.keys.epoch_digest`)
        and the request's tenant id (:func:`kvplug.policies.tenants.tenant_id`)."""
        return CacheKey(self.model, kv_dtype_token(tensor_dtype, self.cache_dtype, self.scales),
                        self.layout, self.world_size, self.rank, chunk_hash,
                        model_digest=epoch_digest(self.model_digest, epoch),
                        pp_size=self.pp_size, pp_rank=self.pp_rank, layers=self.layers,
                        tenant=tenant)


def keys_digest(ident: Identity) -> str:
    """16 hex naming everything in a chunk's key but its hash, ranks, tenant and weights epoch:
    engines with the same digest make the same key for the same chunk, rank and tenant (a
    disaggregated consumer waits only for a producer it shares keys with). The KV tensor
    dtype is left out: the model's dtype and ``cache_dtype``, which are in, decide it."""
    fields = [ident.model, ident.model_digest, ident.layout, ident.world_size, ident.cache_dtype,
              ident.scales, ident.pp_size]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    """JSON-able plain values (a callable ``hf_overrides`` becomes its qualified name)."""
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def model_settings(vllm_config: VllmConfig) -> dict[str, Any]:
    """Everything in the engine's model config that changes KV bytes, as plain values."""
    mc = vllm_config.model_config
    return _plain({
        "revision": mc.revision,
        "code_revision": mc.code_revision,
        "dtype": str(mc.dtype),
        "quantization": mc.quantization,
        "quantization_config": getattr(mc, "quantization_config", None),
        "hf_overrides": _plain(mc.hf_overrides),
        "hf_config": mc.hf_config.to_dict(),
        "load_format": str(getattr(vllm_config.load_config, "load_format", "")),
        "model_impl": str(getattr(mc, "model_impl", "")),
        "disable_sliding_window": getattr(mc, "disable_sliding_window", False),
        "runner": str(getattr(mc, "runner_type", "")),
        "drafter": drafter_settings(vllm_config),
    })


def drafter_settings(vllm_config: VllmConfig) -> dict[str, Any] | None:
    """A speculative drafter that has KV layers of its own (EAGLE, MTP, a draft model): those
    layers sit in the KV cache kvplug stores and loads with the target's, so which drafter (its
    method, weights and config) is part of what the KV is. None for drafters without KV layers
    (n-gram, suffix) and without speculative decoding: their keys are the plain model's."""
    sc = getattr(vllm_config, "speculative_config", None)
    dmc = getattr(sc, "draft_model_config", None) if sc is not None else None
    if dmc is None or str(getattr(sc, "method", "")) in ("ngram", "suffix", "ngram_gpu"):
        return None
    weights = getattr(dmc, "model_weights", "") or dmc.model
    return {"method": str(sc.method), "source": model_source(weights, dmc.revision),
            "hf_config": dmc.hf_config.to_dict()}


def model_identity(vllm_config: VllmConfig, config: ConnectorConfig) -> tuple[str, str]:
    """``(readable name, digest)`` of the model: ``model_name`` when set (an explicit name for
    the weights), else the weights' own fingerprint; never the path they sit at."""
    mc = vllm_config.model_config
    weights = getattr(mc, "model_weights", "") or mc.model
    if config.model_name:
        source: dict[str, Any] = {"model_name": config.model_name}
        name = config.model_name
    else:
        source = model_source(weights, mc.revision)
        archs = getattr(mc.hf_config, "architectures", None) or [mc.hf_config.model_type]
        name = mc.model if source["kind"] == "hub" else str(archs[0])
    return model_namespace(source, model_settings(vllm_config), name)


def build_identity(vllm_config: VllmConfig, config: ConnectorConfig, *, tp_rank: int,
                   pp_rank: int = 0, kv_cache_config: Any = None) -> Identity:
    """This worker's identity (call once per worker; reads weight-file samples)."""
    from vllm.distributed.utils import get_pp_indices

    xfer = vllm_config.kv_transfer_config
    engine_id = (xfer.engine_id if xfer is not None else None) or "default"
    cc, pc = vllm_config.cache_config, vllm_config.parallel_config
    layout = (getattr(kv_cache_config, "kv_cache_layout", None) or cc.kv_cache_layout
              or "unknown")
    model, digest = model_identity(vllm_config, config)
    pp_size = pc.pipeline_parallel_size
    start, end = get_pp_indices(vllm_config.model_config.get_total_num_hidden_layers(), pp_rank,
                                pp_size)
    return Identity(
        model=model, model_digest=digest, layout=f"{layout}-bs{cc.block_size}",
        world_size=pc.tensor_parallel_size, rank=tp_rank, engine_id=engine_id,
        cache_dtype=str(cc.cache_dtype),
        scales=scale_token(bool(getattr(cc, "calculate_kv_scales", False)),
                           getattr(cc, "kv_cache_dtype_skip_layers", None) or ()),
        pp_size=pp_size, pp_rank=pp_rank, layer_start=start, layer_end=end)


# -- what besides the tokens names a request's chunk (the scheduler mixes it into the chunk hash) --
def _embeds_digest(request: Request, start: int, end: int) -> bytes | None:
    """sha256 of the prompt embeddings of tokens ``[start, end)`` (None past them or without)."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None or start >= len(embeds):
        return None
    part = embeds[start:end].detach().contiguous().cpu()
    head = f"{part.dtype}{tuple(part.shape)}".encode()
    return hashlib.sha256(head + part.view(-1).view(torch.uint8).numpy().tobytes()).digest()


def chunk_extra_keys(request: Request, start: int, end: int) -> tuple | None:
    """What besides the tokens identifies tokens ``[start, end)``: the multimodal inputs
    overlapping them (so two images behind the same placeholder tokens never share an entry), the
    LoRA adapter (name and path, as vLLM's own block hash), the prompt embeddings (their
    positions hold placeholder ids), and the cache salt (first chunk only)."""
    keys: list[tuple] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    if (embeds := _embeds_digest(request, start, end)) is not None:
        keys.append(("prompt_embeds", embeds))
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        if pos.offset < end and pos.offset + pos.length > start:
            keys.append(("mm", f.identifier, pos.offset - start))
    salt = getattr(request, "cache_salt", None)
    if start == 0 and salt:
        keys.append(("salt", salt))
    return tuple(keys) or None
