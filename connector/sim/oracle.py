"""The KV oracle: what every (rank, model layer, token position) slot must hold.

The simulated forward pass writes, per computed token and model layer, ``SLOT`` bytes that are a
hash of the rank, the layer, the token prefix and (layer >= 1) the bytes *actually present* in the
slots the previous layer attends to (all earlier positions for full attention, the window for a
sliding-window layer). So KV computed over a stale, foreign or poisoned block differs from the
oracle's, which is the same function over the oracle's own slots.

The simulated model samples its next token from the KV it read (:func:`token_of`: the last
layer's slots the position attends to, on every rank, as logits would), so a request whose
forward read wrong KV is handed a token the oracle (:meth:`Oracle.token`) would not produce.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

SLOT = 8  # bytes of one token's KV in one layer


def prefix_hashes(tokens: Sequence[int]) -> list[bytes]:
    """A chained hash per position: ``ph[p]`` names ``tokens[: p + 1]``."""
    out, h = [], b""
    for t in tokens:
        h = hashlib.blake2b(h + int(t).to_bytes(4, "little"), digest_size=12).digest()
        out.append(h)
    return out


def slot_value(rank: int, layer: int, ph: bytes, attended: bytes) -> bytes:
    return hashlib.blake2b(bytes([rank, layer]) + ph + attended, digest_size=SLOT).digest()


def digest(slots: list[bytes]) -> bytes:
    return hashlib.blake2b(b"".join(slots), digest_size=12).digest()


def token_of(reads: Sequence[bytes]) -> int:
    """The token the simulated model samples after a position: a function of what its logits
    read on every rank (``reads``: per rank, the :func:`digest` of the last layer's slots the
    position attends to)."""
    h = hashlib.blake2b(b"".join(reads), digest_size=4).digest()
    return 3 + int.from_bytes(h, "little") % 997


class Oracle:
    """Memoised oracle slots; ``attends(layer, p)`` gives the positions layer ``layer`` reads
    for token ``p`` (the simulated model's attention pattern)."""

    def __init__(self, num_layers: int, attends: Callable[[int, int], range]) -> None:
        self.num_layers = num_layers
        self.attends = attends
        self._memo: dict[tuple[int, int, bytes], bytes] = {}

    def slots(self, rank: int, layer: int, tokens: Sequence[int], end: int | None = None,
              ph: list[bytes] | None = None) -> list[bytes]:
        """The oracle slots of positions ``[0, end)`` of ``layer``."""
        ph = ph if ph is not None else prefix_hashes(tokens)
        end = len(tokens) if end is None else end
        memo = self._memo
        out: list[bytes] = []
        prev: list[bytes] | None = None
        for p in range(end):
            k = (rank, layer, ph[p])
            v = memo.get(k)
            if v is None:
                if layer == 0:
                    v = slot_value(rank, 0, ph[p], b"")
                else:
                    if prev is None:
                        prev = self.slots(rank, layer - 1, tokens, end, ph)
                    v = slot_value(rank, layer, ph[p],
                                   digest([prev[q] for q in self.attends(layer - 1, p)]))
                memo[k] = v
            out.append(v)
        return out

    def token(self, ranks: int, tokens: Sequence[int], p: int,
              ph: list[bytes] | None = None) -> int:
        """The token the model samples after position ``p`` of ``tokens`` over the oracle's KV
        (:func:`token_of`; ``ph``: :func:`prefix_hashes` of at least ``tokens[: p + 1]``)."""
        last = self.num_layers - 1
        ph = ph if ph is not None else prefix_hashes(tokens[: p + 1])
        reads = []
        for rank in range(ranks):
            slots = self.slots(rank, last, tokens, p + 1, ph)
            reads.append(digest([slots[q] for q in self.attends(last, p)]))
        return token_of(reads)
