"""``ConnectorConfig``: the core config plus what only the vLLM connector reads.

The same YAML file (or ``kv_connector_extra_config`` dict, or ``KVPLUG_*`` variable) sets both:
``chunk_size`` and ``tiers`` go to the core, the keys below to the connector. A bare
:class:`~kvplug.storage_manager.StorageManager` given this file ignores these keys; a typo in any
key is still an error that names it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from kvplug.config import KVPlugConfig, load_config
from pydantic import ByteSize, Field

#: the default ``in_step_load_bytes``: the longest a step (and every decode batched in it) waits for
#: disk hits is about this over the read-and-verify speed, ~1.5 GB/s measured for posix on a
#: 2-core VM: ~11 ms. A 2k-token hit of a small model (12 MiB) fits; Llama-3-8B's 128 KiB/token
#: fits 128 tokens. Measured: benchmarks/RESULTS.md, bench_anchor.py's restart row, kvplug against
#: kvplug-bg (budget 0) in one run
IN_STEP_LOAD_BYTES = 16 << 20


class ConnectorConfig(KVPlugConfig):
    """Everything kvplug reads inside vLLM: the core settings and the connector's own."""

    deprecated_keys: ClassVar[Mapping[str, str]] = {
        "inline_load_bytes": "in_step_load_bytes",
        "inline_load_deadline_s": "in_step_load_deadline_s",
    }

    layerwise: bool = Field(default=False, description="move KV layer by layer (else in bulk)")
    save_partial_chunk: bool = Field(
        default=True,
        description="store block-aligned partial chunks (a prompt's end, a request's last full "
        "block), so hits are block granular as vLLM's own prefix cache; off: chunk granular",
    )
    save_decode: bool = Field(
        default=True,
        description="store KV produced while decoding (the answer: a chat's next turn reuses it)",
    )
    async_save: bool | None = Field(
        default=None,
        description="copy stored KV off the engine step (CUDA: a side stream ordered by an "
        "event, put by a completion thread; CPU: copied and put on a thread), holding a "
        "finished request's blocks until its copy is done; unset: on for CUDA, on CPU as "
        "measured (kvplug.connector.protocol.config.CPU_DEFAULT)",
    )
    lookup_timeout_s: float = Field(
        default=2.0, gt=0, description="scheduler->worker lookup; past it, a miss"
    )
    in_step_load_bytes: ByteSize = Field(
        default=ByteSize(IN_STEP_LOAD_BYTES), ge=0,
        description="per engine step, the KV bytes (per worker) of hits found only on a local "
        "medium (posix, gds: a tier whose class sets local_medium) that load inside the step, "
        "as hits from RAM do; a hit past it loads in the background, a step later. 0: every "
        "such hit in the background. Hits on remote tiers always load in the background",
    )
    in_step_load_deadline_s: float = Field(
        default=0.5, gt=0,
        description="the longest an engine step waits, in all, on the reads of its in-step "
        "loads from a local medium (posix, gds): one allowance per step, not per call; what is "
        "not read by then is a load error (vLLM recomputes those blocks). RAM hits never wait",
    )
    model_name: str | None = Field(
        default=None, description="the model name used in keys (default: vLLM's model)"
    )
    log_every_load: bool = Field(default=True, description="one INFO line per request that loads")
    kv_events: bool = Field(
        default=True,
        description="with vLLM's --kv-events-config on, publish BlockStored/BlockRemoved for "
        "what enters and leaves each tier (medium = the tier's name) for KV-aware routers",
    )
    kv_events_max_chunks: int = Field(
        default=16384, gt=0,
        description="chunks per tier the KV events track (past it the oldest is announced "
        "removed and forgotten)",
    )
    fresh_epoch_at_start: bool = Field(
        default=False,
        description="key this engine's entries under a weights epoch drawn at start-up, so "
        "nothing any earlier run stored is served to it: for weights that do not come from the "
        "model files (load_format=dummy then synced by a trainer); every reset_cache draws a "
        "new epoch either way",
    )
    require_cache_salt: bool = Field(
        default=False,
        description="multi-tenant: a request without a cache_salt is neither loaded nor stored "
        "(vLLM computes it; counted as refused_no_salt), so salt-less requests of different "
        "tenants never share KV",
    )
    kv_events_salted_tokens: bool = Field(
        default=False,
        description="KV events of a request with a cache_salt carry its token ids (off: an "
        "empty token list; the block hashes, a keyed hash of the salt and of its multimodal "
        "ids only)",
    )
    management_key_env: str | None = Field(
        default=None,
        description="the NAME of an environment variable holding the bearer key of kvplug's "
        "management API (/kvplug/v1: lookup, clear, status) on the API server; unset: vLLM's "
        "--api-key guards it, which every API client has. Set it where clients are tenants, so "
        "only operators and routers can clear or look up",
    )
    handoff_wait_s: float = Field(
        default=10.0, ge=0,
        description="disaggregated prefill: how long a consumer waits (in the background, never "
        "an engine step) for the chunks a producer's hand-off names before it computes what is "
        "missing. A kv_producer offers it with every request's hand-off (kv_transfer_params); a "
        "kv_consumer waits the smaller of the offered and its own, from when it sees the "
        "request. 0: a consumer never waits",
    )
    report_to_client: bool = Field(
        default=False,
        description="return the per-request report (hit tokens, tiers) in kv_transfer_params; "
        "off because every API client would see what others cached",
    )


def load_connector_config(
    source: KVPlugConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> ConnectorConfig:
    """:func:`kvplug.config.load_config` with the connector's schema (same sources, same errors)."""
    return load_config(source, env=env, schema=ConnectorConfig)


#: ``async_save`` unset on CPU (see ``benchmarks/bench_async_save.py`` and RESULTS.md).
CPU_DEFAULT = True


def async_save_enabled(cfg: ConnectorConfig, device_type: str) -> bool:
    """Whether saves run asynchronously: ``async_save`` if set, else on for CUDA and
    :data:`CPU_DEFAULT` elsewhere. The scheduler and the workers must agree (the scheduler then
    holds every finished request's blocks until the workers report its saves done)."""
    if cfg.async_save is not None:
        return cfg.async_save
    return device_type == "cuda" or CPU_DEFAULT
