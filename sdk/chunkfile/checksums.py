"""Checksums of chunk files: xxh3_64 per layer (a layer-wise read verifies only what it read),
or, for an authenticated chunk (its header carries a :class:`~.auth.ChunkMac`), a MAC per layer."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import xxhash

CHECKSUM_ALGO = "xxh3_64"


def checksum(data) -> str:  # noqa: ANN001 - any buffer
    """xxh3_64 of a buffer as 16 lowercase hex digits (releases the GIL on large buffers)."""
    return xxhash.xxh3_64_hexdigest(data)


def split_layers(data, num_layers: int) -> list[memoryview]:  # noqa: ANN001 - any buffer
    """``data`` (all layers, back to back) cut into ``num_layers`` equal zero-copy views."""
    view = memoryview(data).cast("B")
    n = len(view) // num_layers if num_layers else 0
    return [view[s] for s in _layer_slices(n, num_layers)]


def layer_sums(views: Sequence, mac=None) -> list[str]:  # noqa: ANN001 - ChunkMac | None
    """The ``checksums`` of a chunk's layers: xxh3 each, or with ``mac`` their tags."""
    if mac is None:
        digest = xxhash.xxh3_64_hexdigest  # called directly: 32+ layers a chunk, per call cost
        return [digest(v) for v in views]
    return [mac.layer_tag(i, v) for i, v in enumerate(views)]


def verify_layer(header, index: int, data) -> bool:  # noqa: ANN001 - ChunkHeader, any buffer
    """Whether ``data`` (one layer's bytes) matches the header's checksum for layer ``index``
    (its MAC, for an authenticated chunk: a mismatch is counted as an auth failure). For an
    encrypted chunk ``data`` is its ciphertext, decrypted **in place** when writable (what a
    reader then serves), and its GCM tag checked."""
    if not 0 <= index < header.num_layers:
        return False
    view = memoryview(data).cast("B")
    if len(view) != header.layer_nbytes:
        return False
    if header.mac is not None:
        return header.mac.verify_layer(index, view, header.checksums[index])
    return checksum(view) == header.checksums[index]


def verify_layers(header, first_layer: int, data) -> bool:  # noqa: ANN001 - ChunkHeader, buffer
    """Verify consecutive layers starting at ``first_layer`` held contiguously in ``data`` (each
    layer as :func:`verify_layer` does, so an encrypted chunk's are decrypted in place; the
    ranges checked once, not per layer: a chunk of 256 KiB
    has 32 layers of 8 KiB, whose per-layer calls cost more than hashing them)."""
    view = memoryview(data).cast("B")
    n = header.layer_nbytes
    if n == 0:
        return len(view) == 0
    count, rest = divmod(len(view), n)
    if rest or first_layer < 0 or first_layer + count > header.num_layers:
        return False
    sums = header.checksums
    if header.mac is not None:
        verify = header.mac.verify_layer
        return all(verify(first_layer + i, view[i * n : (i + 1) * n], sums[first_layer + i])
                   for i in range(count))
    digest = xxhash.xxh3_64_hexdigest  # one list compared at once: no per-layer generator step
    return [digest(view[s]) for s in _layer_slices(n, count)] == \
        sums[first_layer : first_layer + count]


@functools.lru_cache(maxsize=64)
def _layer_slices(layer_nbytes: int, count: int) -> tuple[slice, ...]:
    """The byte ranges of ``count`` layers back to back (the same for every chunk of one layout:
    made once, not per layer per read)."""
    return tuple(slice(i * layer_nbytes, (i + 1) * layer_nbytes) for i in range(count))
