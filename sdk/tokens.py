"""Token database: cut token ids into chunks and give each chunk a prefix-chained hash.

The hash is computed exactly as vLLM computes a block hash with ``sha256_cbor``:
``sha256(cbor2.dumps((parent_or_NONE_HASH, tuple(tokens), extra_keys), canonical=True))`` with
``NONE_HASH = sha256_cbor("vllm-none-hash")`` (vLLM's fixed seed for cryptographic hashes). It
never depends on ``PYTHONHASHSEED`` or the process, so keys are stable across processes and
machines. Nothing here imports vLLM; a test checks equality with vLLM's own function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

from .errors import ConfigError

NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj`` (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


NONE_HASH: bytes = sha256_cbor(NONE_HASH_SEED)


def hash_chunk(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
    """The hash of one chunk given its parent's hash (``None`` for the first chunk)."""
    return sha256_cbor((parent or NONE_HASH, tuple(tokens), extra_keys))


#: ``extra_keys(start, end)``: what besides the tokens identifies tokens ``[start, end)``.
ExtraKeys = Callable[[int, int], Any]


def _hash_span(parent: bytes | None, token_ids: Sequence[int], start: int, end: int,
               extra_keys: ExtraKeys | None) -> bytes:
    extra = extra_keys(start, end) if extra_keys is not None else None
    return hash_chunk(parent, token_ids[start:end], extra)


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Tokens ``[start, end)`` of a sequence and the chained hash of everything up to ``end``."""

    start: int
    end: int
    chunk_hash: bytes

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class TokenDatabase:
    """Chunks token sequences and hashes them, chaining every chunk over all earlier tokens.

    ``extra_keys(start, end)`` (optional) returns what else identifies the tokens of a chunk —
    multimodal input hashes overlapping it, a LoRA name, a cache salt — or ``None``. It is hashed
    into the chunk exactly as vLLM hashes its ``extra_keys``, so two images with the same
    placeholder tokens never share an entry.
    """

    def __init__(self, chunk_size: int = 256) -> None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ConfigError(f"chunk_size={chunk_size!r} must be a positive integer, e.g. 256")
        self.chunk_size = chunk_size

    def spans(
        self,
        token_ids: Sequence[int],
        *,
        include_partial: bool = False,
        extra_keys: ExtraKeys | None = None,
    ) -> list[ChunkSpan]:
        """Every chunk of ``token_ids`` with its chained hash.

        Full chunks only unless ``include_partial``: then a trailing partial chunk is hashed too
        (its hash differs from any full chunk's, so a later, longer prompt never mistakes it for
        a full one).
        """
        n = len(token_ids)
        stop = n if include_partial else n - n % self.chunk_size
        out: list[ChunkSpan] = []
        parent: bytes | None = None
        for start in range(0, stop, self.chunk_size):
            end = min(start + self.chunk_size, stop)
            parent = _hash_span(parent, token_ids, start, end, extra_keys)
            out.append(ChunkSpan(start, end, parent))
        return out

    def extend_hashes(
        self, token_ids: Sequence[int], hashes: list[bytes], num_chunks: int, *,
        extra_keys: ExtraKeys | None = None,
    ) -> list[bytes]:
        """The hashes of the first ``num_chunks`` full chunks of ``token_ids``.

        ``hashes`` holds those already computed for this sequence (a prefix of the result) and is
        extended in place, so a sequence that grows (a request that decodes, a lookup asked again)
        hashes each chunk once. Equal to ``chunk_hashes(token_ids)[:num_chunks]``.
        """
        chunk_size = self.chunk_size
        while len(hashes) < num_chunks:
            start = len(hashes) * chunk_size
            parent = hashes[-1] if hashes else None
            hashes.append(_hash_span(parent, token_ids, start, start + chunk_size, extra_keys))
        return hashes[:num_chunks]

    def partial_hash(
        self, token_ids: Sequence[int], end: int, hashes: list[bytes], *,
        extra_keys: ExtraKeys | None = None,
    ) -> bytes:
        """The hash of the partial chunk ending at ``end`` (not a chunk boundary), chained on the
        full chunks before it (``hashes`` as for :meth:`extend_hashes`). Equal to the last hash
        of ``chunk_hashes(token_ids[:end], include_partial=True)``."""
        k = end // self.chunk_size
        parent = self.extend_hashes(token_ids, hashes, k, extra_keys=extra_keys)[-1] if k else None
        return _hash_span(parent, token_ids, k * self.chunk_size, end, extra_keys)

    def chunk_hashes(self, token_ids: Sequence[int], **kwargs: Any) -> list[bytes]:
        """Just the hashes of :meth:`spans`."""
        return [s.chunk_hash for s in self.spans(token_ids, **kwargs)]

    def process_tokens(
        self,
        token_ids: Sequence[int],
        mask: Sequence[bool] | None = None,
        *,
        include_partial: bool = False,
        extra_keys: Any = None,
    ) -> Iterator[ChunkSpan]:
        """The chunks not already cached: ``mask[i]`` False means token ``i`` is already stored.

        The masked-out part must be a prefix whose length is a multiple of ``chunk_size`` (the
        already-cached chunks); anything else raises ``ConfigError`` naming the offending count.
        Hashes still chain over the masked prefix, so the keys match a full run's.
        """
        skip = 0
        if mask is not None:
            if len(mask) != len(token_ids):
                raise ConfigError(
                    f"mask has {len(mask)} entries but there are {len(token_ids)} tokens"
                )
            skip = next((i for i, m in enumerate(mask) if m), len(mask))
            if any(not m for m in mask[skip:]):
                raise ConfigError("mask must be False on a prefix and True after it")
            if skip % self.chunk_size:
                raise ConfigError(
                    f"mask skips {skip} tokens, which is not a multiple of chunk_size="
                    f"{self.chunk_size}"
                )
        for span in self.spans(token_ids, include_partial=include_partial, extra_keys=extra_keys):
            if span.start >= skip:
                yield span
