"""Blocks vLLM counts as computed that hold no KV: a failed load's, until something writes them.

vLLM (0.32 and 0.33) with its default ``kv_load_failure_policy="recompute"`` keeps the blocks of a
failed synchronous load in its prefix cache (their hashes were registered when they were
allocated) and expects the request to recompute them in its next step. If the request is aborted
or preempted first, the blocks go back to the free queue still hashed, and the next request with
that prefix gets them as a prefix-cache hit: its forward reads KV nobody wrote. (Found by the
simulation: a chunk lost between lookup and load, then the client aborts; kvplug.connector.sim.)

The scheduler side follows those blocks from the failure (``invalid_block_ids``) until steps
have written every slot of them (a forward computing tokens in them, or a load into them), slot by
slot: a recompute that stops inside a block leaves the slots after it as the failed step computed
them, over the missing KV, and vLLM's prefix cache still serves the block whole (its hash was
registered when that step filled it; simulation seed 135003121). A step that reads an unwritten
slot (a request scheduled with it among its computed tokens) names its block in the metadata; the
workers report it as a load error of that step, so vLLM drops that step's output of the request
and recomputes from the block. One KV cache group only: vLLM maps block ids to requests only then.
"""

from __future__ import annotations

from collections.abc import Iterable


class UnwrittenBlocks:
    """Blocks a load failed to write that nothing has written since."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: set[int] = set()
        #: of a followed block, how many leading slots steps have written since it failed (the
        #: rest hold no KV or KV computed over a failed load); absent: none
        self.written: dict[int, int] = {}

    def failed(self, block_ids: Iterable[int], tables: Iterable[list[int]] = ()) -> None:
        """vLLM was told these blocks hold no valid KV (a step's load errors). ``tables``: the
        block tables of the live requests; in each, every block after the first failed one is
        followed too. A forward computed those over the failed KV (the failing step's tokens, and
        under asynchronous scheduling the steps that ran ahead), and vLLM, which leaves a block
        shared by two requests to the first to recompute, lets the second read them if the
        first is aborted before its recompute gets there (simulation seed 95036104)."""
        failed = set(block_ids)
        followed = set(failed)
        for table in tables:
            first = next((i for i, b in enumerate(table) if b in failed), None)
            if first is not None:
                followed.update(table[first:])
        self.blocks.update(followed)
        for b in followed:
            self.written.pop(b, None)

    def loading(self, table: list[int], start: int, end: int) -> None:
        """A load sent this step writes the blocks of tokens ``[start, end)`` (if it fails, they
        come back through :meth:`failed`)."""
        if self.blocks:
            self._write(table, start, end)

    def _write(self, table: list[int], start: int, end: int) -> None:
        """Tokens ``[start, end)`` of ``table`` are written: a followed block's written slots grow
        when the write starts at or before the first unwritten one (a write after a gap is
        computed over that gap: the step reads it); a block written to its last slot is
        forgotten."""
        block_size = self.block_size
        for i in range(start // block_size, -(-end // block_size)):
            b = table[i] if i < len(table) else None
            if b not in self.blocks:
                continue
            lo, hi = max(0, start - i * block_size), min(block_size, end - i * block_size)
            done = self.written.get(b, 0)
            if lo <= done:
                done = max(done, hi)
            if done >= block_size:
                self.blocks.discard(b)
                self.written.pop(b, None)
            else:
                self.written[b] = done

    def step(self, work: Iterable[tuple[list[int], int, int]]) -> list[int]:
        """``work``: each scheduled request's block table, its tokens computed before this step
        and the tokens this step computes. Returns the blocks whose unwritten slots the step reads
        (among a request's computed tokens); the slots the step writes are written."""
        if not self.blocks:
            return []
        work = list(work)
        block_size = self.block_size
        # A block some request computes whole in this same step is written before it is read:
        # a layer's KV of the whole batch is stored before its attention runs, and vLLM gives a
        # later request of the batch a prefix hit on the full blocks an earlier one computes in
        # the step. Reporting it would send two running requests through vLLM's recovery for
        # nothing, which under asynchronous scheduling (a step already run ahead) is itself
        # unsafe (simulation seed 95001878).
        whole = {b for table, done, n in work for b in table[-(-done // block_size):(done + n) // block_size]}
        read = {b for table, done, _ in work for i, b in enumerate(table[:-(-done // block_size)])
                if b in self.blocks and b not in whole
                and done > i * block_size + self.written.get(b, 0)}
        for table, done, n in work:
            self._write(table, done, done + n)
        return sorted(read)
