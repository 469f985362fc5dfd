"""Block arithmetic of kvplug.gpu.blocks: tokens -> blocks -> memory-object pages."""

from __future__ import annotations

import pytest
from kvplug.gpu import blocks_for_tokens, coalesce_runs, num_pages, pages_for_tokens

TABLE = [11, 4, 7, 30, 2, 9]  # a request's block table, block_size 4 -> 24 token slots


def test_blocks_for_whole_and_partial_spans() -> None:
    assert blocks_for_tokens(TABLE, 0, 8, 4) == [11, 4]
    assert blocks_for_tokens(TABLE, 8, 16, 4) == [7, 30]
    # end inside a block: that block is included, it holds tokens 16..17 only
    assert blocks_for_tokens(TABLE, 16, 18, 4) == [2]
    assert blocks_for_tokens(TABLE, 4, 21, 4) == [4, 7, 30, 2, 9]
    assert blocks_for_tokens(TABLE, 8, 8, 4) == []


def test_start_must_be_block_aligned() -> None:
    with pytest.raises(ValueError, match="start=5"):
        blocks_for_tokens(TABLE, 5, 12, 4)


def test_table_too_short_and_bad_spans() -> None:
    with pytest.raises(ValueError, match="block table has 6"):
        blocks_for_tokens(TABLE, 0, 25, 4)
    with pytest.raises(ValueError):
        blocks_for_tokens(TABLE, 8, 4, 4)
    with pytest.raises(ValueError):
        blocks_for_tokens(TABLE, 0, 4, 0)


def test_pages_for_tokens_skips_leading_blocks_of_a_chunk() -> None:
    # chunk of 16 tokens starting at token 16; the engine already has tokens < 24
    assert pages_for_tokens(24, 32, 4, chunk_start=16) == slice(2, 4)
    # last partial chunk: tokens [32, 37) -> pages 0 and 1 (page 1 holds one valid token)
    assert pages_for_tokens(32, 37, 4, chunk_start=32) == slice(0, 2)
    with pytest.raises(ValueError, match="in-chunk start=2"):
        pages_for_tokens(18, 32, 4, chunk_start=16)
    with pytest.raises(ValueError, match="before chunk_start"):
        pages_for_tokens(8, 32, 4, chunk_start=16)


def test_pages_and_blocks_agree() -> None:
    table = list(range(100, 110))
    block_size, chunk_start, skip, end = 4, 16, 24, 37
    pages = pages_for_tokens(skip, end, block_size, chunk_start)
    chunk_blocks = blocks_for_tokens(table, chunk_start, end, block_size)
    assert chunk_blocks[pages] == blocks_for_tokens(table, skip, end, block_size)


def test_num_pages() -> None:
    assert [num_pages(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_coalesce_runs() -> None:
    assert coalesce_runs([7, 8, 9, 2, 3, 9]) == [(0, 7, 3), (3, 2, 2), (5, 9, 1)]
    assert coalesce_runs([]) == []
    assert coalesce_runs([5, 5, 6]) == [(0, 5, 1), (1, 5, 2)]
    assert coalesce_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]
