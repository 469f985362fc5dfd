"""What the scheduler side remembers about one live request (:mod:`.scheduler`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..protocol.metadata import LoadSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class RequestTracker:
    """What the scheduler side remembers about one live request."""

    request: Request
    prompt_len: int
    can_load: bool
    can_save: bool
    hashes: list[bytes] = field(default_factory=list)  # full-chunk hashes computed so far
    lookup_tokens: int = 0  # last lookup's hit (tokens stored, counted from 0)
    usable_tokens: int = 0  # of it, what vLLM is told (less the last block: drop_last_block)
    stored_tokens: int = 0  # [0, stored_tokens) is in storage or being stored (chunk aligned)
    saved_end: int = 0  # [0, saved_end) is stored or being stored (block aligned)
    refine: tuple[int, int] | None = None  # (num_tokens, chunk) of a second lookup not answered
    pending_load: LoadSpec | None = None
    load_background: bool = False  # the last lookup's hit needs a tier that may block
    slow_chunks: frozenset[int] = frozenset()  # the last hit's chunks only a blocking tier holds
    asking: bool = False  # a lookup is in flight (answered None)
    sent_save: bool = False  # a save went to the workers (async saves: blocks held at finish)
    block_ids: list[int] = field(default_factory=list)  # fallback when vLLM gives no block state
    tables: tuple[list[int], ...] = ()  # every KV cache group's block table (hybrid models)
    report: dict[str, Any] = field(default_factory=dict)  # returned in kv_transfer_params
    #: its KV may predate a weights reset: no load nor store until it starts over (see reset)
    stale: bool = False
    #: its tenant id (cache_salt, else kv_transfer_params["tenant"]; hashed: never the value)
    tenant: str = ""
