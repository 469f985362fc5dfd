"""Disaggregated prefill over kvplug's own tiers: what a producer names, what a consumer waits for.

A prefill engine (``kv_role: kv_producer``) stores every prompt it computes into a shared tier; a
proxy sends the same prompt to the decode engine (``kv_consumer``) the moment the prefill
returns, usually before the producer's asynchronous store has landed. So the producer's
``request_finished`` returns, in ``kv_transfer_params`` (what vLLM's disaggregated proxies copy
from the prefill's response into the decode request), a *hand-off* under :data:`HANDOFF_KEY`:

* ``tokens``: the leading tokens of the prompt it stores (what a consumer with the same prompt
  looks up: every block but the one holding the last token),
* ``hash``: the chained hash of the chunk ending there (hex), which names the whole prefix: a
  consumer whose own hash of its prompt differs (another prompt, salt, adapter, chunk size) has
  nothing to wait for,
* ``keys``: a digest of the key identity it stores under (model, layout, parallelism, KV dtype,
  weights epoch: :func:`..protocol.identity.keys_digest`): a consumer whose keys differ could
  never find the chunks,
* ``ttl_s``: how long a consumer should wait for them, ``tiers``: where it stores (for people).

A consumer given a hand-off that matches waits without ever blocking an engine step:
``get_num_new_matched_tokens`` answers ``None`` (vLLM skips the request this step and asks
again) until a lookup finds every named chunk or the wait (the smaller of ``ttl_s`` and its own
``handoff_wait_s``, from when it first saw the request) is over; then the request loads what is
there and computes the rest, exactly as after any lookup. Its lookups skip every miss a tier
remembers (``Lookup.fresh``), so a negative cache never hides a chunk the producer named. Lookups
are spaced :data:`POLL_FIRST_S`, doubling up to :data:`POLL_MAX_S`.

A hand-off speaks of the request alone (its own prompt's chunks, from tokens the client sent;
nothing about what other requests stored), so it is returned whatever ``report_to_client``
says. On the consumer it is untrusted input: one that does not parse is ignored (counted), and
no hand-off makes a request wait past the consumer's own bound.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

#: the key of ``kv_transfer_params`` a hand-off travels under
HANDOFF_KEY = "kvplug_handoff"
#: the hand-off's format; a consumer ignores any other
VERSION = 1
#: the first lookups of a waiting request are this far apart; each gap doubles up to POLL_MAX_S
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05
#: the most tokens a hand-off may name (a consumer ignores more: no prompt is that long)
MAX_TOKENS = 1 << 31


def keys_identity(keys_digest: str, epoch: str) -> str:
    """What a hand-off's ``keys`` says: the engine's key digest under its weights epoch (an
    engine that drew a fresh epoch stores under keys no other engine makes)."""
    return hashlib.sha256(f"{keys_digest}\0{epoch}".encode()).hexdigest()[:16]


def offer(tokens: int, last_hash: bytes, keys: str, ttl_s: float,
          tiers: list[str]) -> dict[str, Any]:
    """A producer's ``kv_transfer_params`` for a request whose first ``tokens`` it stores (the
    chunk ending there hashed ``last_hash``). The request's tenant is its ``cache_salt``, which
    a proxy sends to both engines with the request (and which is in the hash)."""
    return {HANDOFF_KEY: {"v": VERSION, "tokens": tokens, "hash": last_hash.hex(), "keys": keys,
                          "ttl_s": ttl_s, "tiers": tiers}}


@dataclass(frozen=True)
class Named:
    """What a hand-off names, parsed and checked for shape (:func:`named_in`)."""

    tokens: int
    last_hash: bytes
    keys: str
    ttl_s: float


def named_in(params: dict[str, Any] | None) -> Named | str | None:
    """The hand-off in a request's ``kv_transfer_params``: :class:`Named`, ``None`` when there
    is none, or why it is unusable (a string; it came from a client: never trusted)."""
    raw = (params or {}).get(HANDOFF_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        return "not a kvplug hand-off of this version"
    tokens, digest, keys, ttl = (raw.get(k) for k in ("tokens", "hash", "keys", "ttl_s"))
    if type(tokens) is not int or not 0 < tokens < MAX_TOKENS:
        return "no usable token count"
    if not isinstance(digest, str) or len(digest) != 64:
        return "no usable chunk hash"
    try:
        last_hash = bytes.fromhex(digest)
    except ValueError:
        return "no usable chunk hash"
    if not isinstance(keys, str) or len(keys) > 64:
        return "no usable key digest"
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) \
            or ttl < 0:
        return "no usable ttl_s"
    return Named(tokens, last_hash, keys, float(ttl))


@dataclass
class HandoffWait:
    """A consumer's wait for the chunks a producer named: until a lookup finds ``target``
    tokens, or the clock passes ``deadline``."""

    target: int  # tokens to find (the named ones this request can load)
    started: float  # clock time the consumer first saw the request
    deadline: float
    outcome: str = ""  # "" while waiting; then "ready" (all found) or "expired"
    next_poll: float = 0.0  # no lookup before this clock time
    gap: float = POLL_FIRST_S  # until the poll after the next one
    misses: int = 0  # lookups that found less than the target

    @property
    def waiting(self) -> bool:
        return not self.outcome

    def due(self, now: float) -> bool:
        """Whether a lookup is due (the first one always is)."""
        return now >= self.next_poll

    def missed(self, now: float) -> None:
        """A lookup found less than the target: the next one a gap later (doubling)."""
        self.next_poll = now + self.gap
        self.gap = min(POLL_MAX_S, self.gap * 2)
        self.misses += 1

    def end(self, outcome: str, now: float) -> dict[str, Any]:
        """The wait is over (``ready`` or ``expired``); what the per-request report says."""
        self.outcome = outcome
        return {"outcome": outcome, "tokens": self.target, "misses": self.misses,
                "waited_ms": round(max(0.0, now - self.started) * 1000, 3)}
