"""Block manager: which KV-cache blocks each sequence owns — the one paged-KV allocator.

The engine's scheduler and the model-level `Decoder` both allocate through it. Blocks are the
aligned attention kernel's key-block size, so paging never changes a value. Block 0 of the cache
is a shared all-zero pad block and is never handed out; freed blocks are zeroed (`on_release`), so
no stale, possibly non-finite value outlives its sequence.
"""

from __future__ import annotations

from collections.abc import Callable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 on_release: Callable[[list[int]], None] | None = None):
        self.block_size = block_size
        self.on_release = on_release  # called with freed block ids (the cache zeroes them)
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks, 0, -1))
        self.tables: dict[int, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_needed(self, seq_id: int, length: int) -> int:
        """More blocks `seq_id` needs to hold `length` tokens."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-length // self.block_size) - have)

    def can_grow(self, seq_id: int, length: int) -> bool:
        return self.blocks_needed(seq_id, length) <= len(self.free)

    def grow(self, seq_id: int, length: int) -> list[int]:
        """Give `seq_id` enough blocks for `length` tokens (caller checked `can_grow`)."""
        table = self.tables.setdefault(seq_id, [])
        for _ in range(self.blocks_needed(seq_id, length)):
            table.append(self.free.pop())
        return table

    def table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def owns(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def release(self, seq_id: int) -> None:
        blocks = self.tables.pop(seq_id, [])
        if self.on_release is not None:
            self.on_release(blocks)
        self.free.extend(reversed(blocks))
