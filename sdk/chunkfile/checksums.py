"""Checksums of chunk files: xxh3_64 per layer (a layer-wise read verifies only what it read)."""

from __future__ import annotations

import xxhash

from ..memory import MemoryObj

CHECKSUM_ALGO = "xxh3_64"


def checksum(data) -> str:  # noqa: ANN001 - any buffer
    """xxh3_64 of a buffer as 16 lowercase hex digits (releases the GIL on large buffers)."""
    return xxhash.xxh3_64_hexdigest(data)


def split_layers(data, num_layers: int) -> list[memoryview]:  # noqa: ANN001 - any buffer
    """``data`` (all layers, back to back) cut into ``num_layers`` equal zero-copy views."""
    view = memoryview(data).cast("B")
    n = len(view) // num_layers if num_layers else 0
    return [view[i * n : (i + 1) * n] for i in range(num_layers)]


def layer_checksums(obj: MemoryObj) -> list[str]:
    """One checksum per layer of ``obj`` (a CPU object)."""
    from .format import chunk_layout

    return [checksum(v) for v in split_layers(obj.byte_view.numpy(), chunk_layout(obj.meta)[0])]


def verify_layer(header, index: int, data) -> bool:  # noqa: ANN001 - ChunkHeader, any buffer
    """Whether ``data`` (one layer's bytes) matches the header's checksum for layer ``index``."""
    if not 0 <= index < header.num_layers:
        return False
    view = memoryview(data).cast("B")
    return len(view) == header.layer_nbytes and checksum(view) == header.checksums[index]


def verify_layers(header, first_layer: int, data) -> bool:  # noqa: ANN001 - ChunkHeader, buffer
    """Verify consecutive layers starting at ``first_layer`` held contiguously in ``data``."""
    view = memoryview(data).cast("B")
    n = header.layer_nbytes
    if n == 0:
        return len(view) == 0
    if len(view) % n:
        return False
    return all(
        verify_layer(header, first_layer + i, view[i * n : (i + 1) * n])
        for i in range(len(view) // n)
    )
