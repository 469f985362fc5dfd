"""Which requests may use the cache at all, so that one tenant is never served another's KV.

Chunk keys hold the request's ``cache_salt``, LoRA adapter, prompt-embedding digests and
multimodal identifiers (:func:`..protocol.identity.chunk_extra_keys`), so requests with different salts never share an
entry. Two kinds of request would still share, or be served KV computed for other inputs, on a
persistent or shared tier; :class:`TenantGate` refuses them (neither loaded nor stored: vLLM
computes them as usual), counts each refusal in the stats and logs each reason once:

* ``require_cache_salt: true`` and the request has no ``cache_salt`` (``refused_no_salt``): a
  salt-less request shares with every other salt-less one, of any tenant;
* a multimodal input whose identifier is not a content hash (``refused_mm_ids``):
  - vLLM's per-process counter (``renderer<rank>-mm-<n>-<modality>-<i>``, what vLLM uses when
    its prefix cache is off and ``mm_processor_cache_gb=0``): the same identifier names another
    image after a restart or in another engine, so it is refused with or without a salt;
  - a client-chosen ``multi_modal_uuids`` entry (anything else) on a request without a salt: the
    client could name its image after someone else's. With a salt it only reaches that tenant's
    own entries, and is kept.

A content hash is what vLLM's multimodal hasher gives (64 or 128 lowercase hex digits: blake3,
sha256, sha512), optionally behind the request's LoRA name (``<lora>:<hash>``, vLLM's tower
connector LoRA). A client uuid shaped exactly like one cannot be told apart: ``cache_salt`` per
tenant (``require_cache_salt``) is what confines it (docs/security.md).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from kvplug.logs import LogOnce

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("kvplug.connector")

_CONTENT_HASH = re.compile(r"[0-9a-f]{64}|[0-9a-f]{128}")
_COUNTER = re.compile(r"renderer\d+-mm-\d+-\w+-\d+")

#: stats key -> what the log line says once per process.
REASONS = {
    "refused_no_salt": "a request without cache_salt is neither loaded nor stored "
                       "(require_cache_salt: true); vLLM computes it",
    "refused_mm_ids": "a multimodal request whose identifiers are not content hashes (vLLM's "
                      "per-process counter ids, or client multi_modal_uuids without a cache_salt) "
                      "is neither loaded nor stored; vLLM computes it",
}


def mm_identifier_kind(identifier: Any, lora_name: str | None = None) -> str:
    """``"content"`` (vLLM's content hash), ``"counter"`` (vLLM's per-process counter) or
    ``"client"`` (anything else: a client's ``multi_modal_uuids`` entry)."""
    ident = str(identifier)
    if lora_name and ident.startswith(lora_name + ":"):
        ident = ident[len(lora_name) + 1:]
    if _CONTENT_HASH.fullmatch(ident):
        return "content"
    if _COUNTER.fullmatch(ident):
        return "counter"
    return "client"


def refusal(request: Request, require_salt: bool) -> str | None:
    """Why ``request`` may not use the cache (a :data:`REASONS` key), or None."""
    salt = getattr(request, "cache_salt", None)
    if require_salt and not salt:
        return "refused_no_salt"
    lora = getattr(request, "lora_request", None)
    lora_name = getattr(lora, "lora_name", None) if lora is not None else None
    for f in getattr(request, "mm_features", None) or ():
        kind = mm_identifier_kind(f.identifier, lora_name)
        if kind == "counter" or (kind == "client" and not salt):
            return "refused_mm_ids"
    return None


class TenantGate:
    """The scheduler's check of each request (module docstring); ``stats``: anything with
    ``add(key)`` (the connector's :class:`~..protocol.stats.StatsRecorder`)."""

    def __init__(self, require_salt: bool, stats: Any) -> None:
        self.require_salt = require_salt
        self.stats = stats
        self._log_once = LogOnce(logger)

    def admits(self, request: Request) -> bool:
        """Whether ``request`` may load and store; a refusal is counted and logged once."""
        why = refusal(request, self.require_salt)
        if why is None:
            return True
        self.stats.add(why)
        self._log_once(why, "kvplug: %s (counted in stats as %s; logged once)", REASONS[why], why)
        return False
