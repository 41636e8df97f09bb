"""Block manager: which KV-cache blocks each running sequence owns.

Blocks are the aligned attention kernel's key-block size, so paging never changes a value.
Block 0 of the cache is a shared all-zero pad block and is never handed out.
"""

from __future__ import annotations

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, on_release=None):
        self.block_size = block_size
        self.on_release = on_release  # called with freed block ids (the cache zeroes them)
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks, 0, -1))
        self.tables: dict[int, list[int]] = {}

    def blocks_needed(self, seq: Sequence, length: int) -> int:
        have = len(self.tables.get(seq.request_id, ()))
        return max(0, -(-length // self.block_size) - have)

    def can_grow(self, seq: Sequence, length: int) -> bool:
        return self.blocks_needed(seq, length) <= len(self.free)

    def grow(self, seq: Sequence, length: int) -> list[int]:
        """Give `seq` enough blocks for `length` tokens (caller checked `can_grow`)."""
        table = self.tables.setdefault(seq.request_id, [])
        for _ in range(self.blocks_needed(seq, length)):
            table.append(self.free.pop())
        return table

    def table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.request_id]

    def release(self, seq: Sequence) -> None:
        blocks = self.tables.pop(seq.request_id, [])
        if self.on_release is not None:
            self.on_release(blocks)
        self.free.extend(reversed(blocks))
