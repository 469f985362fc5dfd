"""Block arithmetic: which engine blocks and which memory-object pages hold which tokens.

The unit of transfer is a *page*: the bytes of one block of one layer. A request's block table
``block_ids`` maps token ``t`` to block ``block_ids[t // block_size]`` at slot ``t % block_size``.
A chunk's memory object ``[layers, pages, page_bytes]`` that starts at token ``chunk_start`` holds
in page ``j`` the tokens ``[chunk_start + j*block_size, chunk_start + (j+1)*block_size)``.

Tokens not on block boundaries are handled at block granularity, never by masking inside a page:

* The *start* of a transfer (a chunk boundary, or the end of the engine's own prefix-cache hit
  that must be skipped) must be a multiple of ``block_size``. vLLM's prefix-cache hits are whole
  blocks, so this always holds; a start inside a block is refused (``ValueError``) instead of
  rounded, because rounding down would write into a block the engine may share with other
  requests, and rounding up would silently drop tokens.
* The *end* may be partial (the last chunk of a prompt). The last page then holds only
  ``end - start - (pages-1)*block_size`` valid tokens (``end % block_size`` when ``start`` is
  block aligned); its remaining slots are copied as-is (whatever the engine's block held) and are
  never read back beyond the promised token count: a load writes the whole page, and the engine
  computes the slots past the promised count before attention reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["blocks_for_tokens", "coalesce_runs", "num_pages", "pages_for_tokens"]


def _check_span(start: int, end: int, block_size: int, what: str) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start < 0 or end < start:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    if start % block_size:
        raise ValueError(
            f"{what} start={start} is not a multiple of block_size={block_size}; transfers "
            "begin on block boundaries (only the end may be partial)"
        )


def num_pages(num_tokens: int, block_size: int) -> int:
    """Pages needed for ``num_tokens`` tokens starting on a block boundary (ceil division)."""
    if block_size <= 0 or num_tokens < 0:
        raise ValueError(f"bad num_tokens={num_tokens} / block_size={block_size}")
    return -(-num_tokens // block_size)


def blocks_for_tokens(
    block_ids: Sequence[int], start: int, end: int, block_size: int
) -> list[int]:
    """Block ids holding tokens ``[start, end)`` of a request whose block table is ``block_ids``.

    ``start`` must be a multiple of ``block_size`` (``ValueError`` naming it otherwise); ``end``
    may be partial, then the last block holds only ``end % block_size`` of the tokens (see the
    module docstring for what happens to the rest of that page). Raises ``ValueError`` when the
    table is too short for ``end``.
    """
    _check_span(start, end, block_size, "token")
    first, last = start // block_size, num_pages(end, block_size)
    if last > len(block_ids):
        raise ValueError(
            f"tokens [{start}, {end}) need {last} blocks of {block_size} tokens, "
            f"the block table has {len(block_ids)}"
        )
    return [int(b) for b in block_ids[first:last]]


def pages_for_tokens(start: int, end: int, block_size: int, chunk_start: int = 0) -> slice:
    """Pages of a memory object beginning at token ``chunk_start`` that hold ``[start, end)``.

    Used to skip leading tokens of a chunk (already present in the engine) at block granularity:
    ``obj[:, pages_for_tokens(skip, chunk_end, block_size, chunk_start)]`` pairs with
    ``blocks_for_tokens(table, skip, chunk_end, block_size)``. ``start - chunk_start`` must be a multiple
    of ``block_size`` and ``start >= chunk_start``.
    """
    if start < chunk_start:
        raise ValueError(f"start={start} lies before chunk_start={chunk_start}")
    _check_span(start - chunk_start, end - chunk_start, block_size, "in-chunk")
    first = (start - chunk_start) // block_size
    return slice(first, num_pages(end - chunk_start, block_size))


def coalesce_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``block_ids`` into runs of consecutive ids: ``(position, first_block, length)``.

    ``[7, 8, 9, 2, 3, 9]`` -> ``[(0, 7, 3), (3, 2, 2), (5, 9, 1)]``. One run is one slice of the
    page view, so it moves with one ``copy_`` (one memcpy when blocks are adjacent in memory).
    """
    runs: list[tuple[int, int, int]] = []
    pos = 0
    n = len(block_ids)
    while pos < n:
        first = int(block_ids[pos])
        length = 1
        while pos + length < n and int(block_ids[pos + length]) == first + length:
            length += 1
        runs.append((pos, first, length))
        pos += length
    return runs
