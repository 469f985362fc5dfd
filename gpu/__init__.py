"""kvplug.gpu: move KV pages between an engine's paged KV tensors and chunk memory objects.

Takes plain tensors and block ids (no vLLM import). ``PagedKV.from_kv_caches`` builds zero-copy
``(num_blocks, page_bytes)`` byte views per layer once; ``gather``/``scatter`` (and ``*_many``,
whose jobs are ``PageJob(block_ids, pages)`` in both directions) move whole chunks,
``layerwise_store``/``layerwise_load`` move one layer per step (CUDA: a dedicated stream and
per-layer events; CPU: plain copies). Each call resolves all its jobs into one copy plan
(``copy_plan``), so its host work per layer does not grow with the number of jobs. ``blocks``
maps tokens to pages.
"""

from .blocks import blocks_for_tokens, coalesce_runs, num_pages, pages_for_tokens
from .layerwise import LayerSteps, layerwise_load, layerwise_store
from .page_views import KVLayoutError, PagedKV, page_view
from .transfer import (
    PageJob,
    alloc_host,
    gather,
    gather_many,
    gather_many_async,
    scatter,
    scatter_many,
)

__all__ = [
    "KVLayoutError",
    "LayerSteps",
    "PageJob",
    "PagedKV",
    "alloc_host",
    "blocks_for_tokens",
    "coalesce_runs",
    "gather",
    "gather_many",
    "gather_many_async",
    "layerwise_load",
    "layerwise_store",
    "num_pages",
    "page_view",
    "pages_for_tokens",
    "scatter",
    "scatter_many",
]
