"""KV cache block allocator and per-request block tables.

A request's token at position p lives in slot `block_table[p // block_size] * block_size + p % block_size`
of every layer's K and V cache ([num_blocks * block_size, nKV, D]):

    block_size = 4, block_table = [7, 2]
    positions  0  1  2  3 | 4  5
    slots     28 29 30 31 | 8  9

Blocks are granted in whole and returned the step a request finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque

from loraplex.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list of KV cache blocks. Says no by returning False, never by raising."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks to add so that `req` can hold `num_computed_tokens + num_new_tokens` tokens."""
        needed = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(req.block_table))

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow `req.block_table` for `num_new_tokens` more tokens; False (nothing taken) if short."""
        n = self.num_blocks_needed(req, num_new_tokens)
        if n > self.num_free_blocks:
            return False
        req.block_table.extend(self.free_block_ids.popleft() for _ in range(n))
        return True

    def free(self, req: Request) -> None:
        """Return all of `req`'s blocks to the pool (most recently freed are reused last)."""
        self.free_block_ids.extend(req.block_table)
        req.block_table = []

    def slot(self, req: Request, position: int) -> int:
        """KV cache slot of `req`'s token at `position`."""
        return req.block_table[position // self.block_size] * self.block_size + position % self.block_size
