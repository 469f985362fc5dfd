"""Blocks vLLM counts as computed that hold no KV: a failed load's, until something writes them.

vLLM (0.32 and 0.33) with its default ``kv_load_failure_policy="recompute"`` keeps the blocks of a
failed synchronous load in its prefix cache (their hashes were registered when they were
allocated) and expects the request to recompute them in its next step. If the request is aborted
or preempted first, the blocks go back to the free queue still hashed, and the next request with
that prefix gets them as a prefix-cache hit: its forward reads KV nobody wrote. (Found by the
simulation: a chunk lost between lookup and load, then the client aborts; kvplug.connector.sim.)

The scheduler side follows those blocks from the failure (``invalid_block_ids``) until a step
writes them (a forward computing tokens in them, or a load into them). A step that reads one (a
request scheduled with it among its computed blocks) names it in the metadata; the workers report
it as a load error of that step, so vLLM drops that step's output of the request and recomputes
from the block. One KV cache group only: vLLM maps block ids to requests only then.
"""

from __future__ import annotations

from collections.abc import Iterable


class UnwrittenBlocks:
    """Blocks a load failed to write that nothing has written since."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.blocks: set[int] = set()

    def failed(self, block_ids: Iterable[int]) -> None:
        """vLLM was told these blocks hold no valid KV (this step's load errors)."""
        self.blocks.update(block_ids)

    def loading(self, table: list[int], start: int, end: int) -> None:
        """A load sent this step writes the blocks of tokens ``[start, end)`` (if it fails, they
        come back through :meth:`failed`)."""
        if self.blocks:
            self.blocks.difference_update(table[start // self.bs:-(-end // self.bs)])

    def step(self, work: Iterable[tuple[list[int], int, int]]) -> list[int]:
        """``work``: each scheduled request's block table, its tokens computed before this step
        and the tokens this step computes. Returns the unwritten blocks the step reads (among a
        request's computed blocks); those the step writes are forgotten."""
        if not self.blocks:
            return []
        work = list(work)
        read = {b for table, done, _ in work for b in table[:-(-done // self.bs)]
                if b in self.blocks}
        for table, done, n in work:
            self.blocks.difference_update(table[done // self.bs:-(-(done + n) // self.bs)])
        return sorted(read)
