"""Block manager: which KV-cache blocks each sequence owns — the one paged-KV allocator.

The engine's scheduler and the model-level `Decoder` both allocate through it. Blocks are the
aligned attention kernel's key-block size, so paging never changes a value. Block 0 of the cache
is a shared all-zero pad block and is never handed out; freed blocks are zeroed (`on_release`), so
no stale, possibly non-finite value outlives its sequence.

A cache with a window group (`KVCache`: a model's sliding layers in blocks of their own) has one
manager per group behind `KVPages`; the window group's `trim` gives back, as a sequence advances,
the blocks every later query's window has passed (their table entries become the pad block).

Prefix caching: a block whose keys and values are computed, from the first token on, under the
weights loaded now is entered in an index under (the serial of the block before it, its tokens);
a new request whose prompt starts with the same tokens takes those blocks (`share`, counted in
`refs`) instead of computing them again, and prefills the rest (a block goes back to the free
list when no sequence holds it). The serial names a whole prefix and is never reused, so a key
cannot match a block that was freed and handed to other tokens; the index is emptied when the
weights change (`forget`). Shared blocks are full and never written again (a request always
computes its prompt's last token and everything after it), so no block is copied on write. With
aligned kernels a request that shares a prefix records the same log-prob bits as one that
computes it (`tests/engine/test_prefix_cache.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 on_release: Callable[[list[int]], None] | None = None, window: int = 0):
        self.block_size = block_size
        self.on_release = on_release  # called with freed block ids (the cache zeroes them)
        self.num_blocks = num_blocks
        self.window = window
        """Blocks whose keys lie wholly before the window of a sequence's next query are trimmed
        (0: never, the full layers' blocks)."""
        self.free: list[int] = list(range(num_blocks, 0, -1))
        self.tables: dict[int, list[int]] = {}
        self.trimmed: dict[int, int] = {}  # per sequence: how many leading entries trim cleared
        self.refs: dict[int, int] = {}  # per block handed out: how many sequences hold it
        self.index: dict[tuple, int] = {}  # (serial of the block before, tokens) -> a computed block
        self.keys: dict[int, tuple[tuple, int]] = {}  # indexed block -> (its key, its serial)
        self.serials = itertools.count(1)  # (0: the start of every prompt)
        self.entered: dict[int, tuple[int, int]] = {}  # per sequence: blocks looked at, last serial

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
            block = self.free.pop()
            self.refs[block] = 1
            table.append(block)
        return table

    # ------------------------------------------------------------------ prefix caching
    def enter(self, seq_id: int, tokens: list[int], computed: int) -> None:
        """Index `seq_id`'s full blocks among its first `computed` tokens (their keys and values
        are in the cache, computed under the weights loaded now, from the first token on)."""
        table = self.tables.get(seq_id)
        done, serial = self.entered.get(seq_id, (0, 0))
        if table is None or serial < 0:
            return
        bs = self.block_size
        for i in range(done, min(computed // bs, len(table))):
            block = table[i]
            if not block:  # (trimmed: what follows has no indexed block before it)
                self.entered[seq_id] = (i, -1)
                return
            key = (serial, tuple(tokens[i * bs:(i + 1) * bs]))
            known = self.index.get(key)
            if known is None:  # (else the same tokens were computed twice: the first block stands)
                self.index[key], known = block, block
                self.keys[block] = (key, next(self.serials))
            serial = self.keys[known][1]
            self.entered[seq_id] = (i + 1, serial)

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The indexed blocks that hold the keys and values of `tokens`' first full blocks, at
        most `limit` of them."""
        blocks, serial, bs = [], 0, self.block_size
        for i in range(limit):
            block = self.index.get((serial, tuple(tokens[i * bs:(i + 1) * bs])))
            if block is None:
                break
            blocks.append(block)
            serial = self.keys[block][1]
        return blocks

    def share(self, seq_id: int, blocks: list[int]) -> None:
        """`seq_id` (holding no blocks) starts with `blocks`, indexed ones from `match`."""
        self.tables[seq_id] = list(blocks)
        for b in blocks:
            self.refs[b] += 1
        if blocks:
            self.entered[seq_id] = (len(blocks), self.keys[blocks[-1]][1])

    def forget(self) -> None:
        """Empty the index (new weights: no block computed before holds what they would compute);
        the sequences keep their blocks."""
        self.index.clear()
        self.keys.clear()
        self.entered.clear()

    def trim(self, seq_id: int, start: int) -> None:
        """With a window: free `seq_id`'s blocks whose keys no query at position `start` or later
        sees (every key j <= start - window), their entries pointed at the pad block."""
        table = self.tables.get(seq_id)
        if not self.window or not table:
            return
        first = min(len(table), max(0, start - self.window + 1) // self.block_size)
        done = self.trimmed.get(seq_id, 0)  # (entries before it are the pad block already)
        if first > done:
            dead = [b for b in table[done:first] if b]
            table[done:first] = [0] * (first - done)
            self.trimmed[seq_id] = first
            self._give_back(dead)

    def table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def owns(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def release(self, seq_id: int) -> None:
        self.trimmed.pop(seq_id, None)
        self.entered.pop(seq_id, None)
        self._give_back([b for b in self.tables.pop(seq_id, []) if b])  # (trimmed entries: the pad block)

    def _give_back(self, blocks: list[int]) -> None:
        """Drop one hold on each block; those no sequence holds any more are zeroed and freed."""
        freed = []
        for b in blocks:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                freed.append(b)
                key = self.keys.pop(b, None)
                if key is not None and self.index.get(key[0]) == b:
                    del self.index[key[0]]
        if self.on_release is not None:
            self.on_release(freed)
        self.free.extend(reversed(freed))


class KVPages:
    """The block managers of a `KVCache`'s groups as one: a sequence grows, and is released, in
    every group at once; `table` is its block table (one list), or with a window group the tuple
    of its tables, in group order (what `ForwardBatch.build` takes)."""

    def __init__(self, cache, max_tokens: int = 1 << 62):
        self.block_size = cache.block_size
        self.max_tokens = max_tokens
        """The longest sequence the model takes (max_position_embeddings)."""
        self.groups = [BlockManager(n, cache.block_size, partial(cache.zero_blocks, group=g), window=w)
                       for g, (n, w) in enumerate(zip(cache.group_blocks, cache.windows))]

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the cache holds: the full layers' blocks (a window group is sized
        to hold every running sequence's window: `memory.plan_cache`); with every layer sliding,
        any length, once the blocks hold a window and a block more."""
        first = self.groups[0]
        if first.window and first.num_blocks >= -(-first.window // self.block_size) + 2:
            return self.max_tokens
        return first.capacity_tokens

    @property
    def num_blocks(self) -> int:
        """The full layers' allocatable blocks (every layer's, with one group)."""
        return self.groups[0].num_blocks

    @property
    def tables(self) -> dict[int, list[int]]:
        """The full layers' block tables (every layer's, with one group)."""
        return self.groups[0].tables

    @property
    def free(self) -> list[int]:
        """The full layers' free blocks (every layer's, with one group)."""
        return self.groups[0].free

    @property
    def free_blocks(self) -> list[int]:
        """Free blocks per group."""
        return [len(g.free) for g in self.groups]

    def blocks_needed(self, seq_id: int, length: int) -> list[int]:
        """More blocks per group `seq_id` needs to hold `length` tokens."""
        return [g.blocks_needed(seq_id, length) for g in self.groups]

    def holds(self, seq_id: int, length: int) -> bool:
        """Whether `seq_id`'s blocks hold `length` tokens already (every group's table has the
        same number of entries)."""
        return len(self.groups[0].tables.get(seq_id, ())) * self.block_size >= length

    def room(self, seq_id: int) -> int:
        """The longest `seq_id` could grow to with the blocks free now."""
        return min(len(g.tables.get(seq_id, ())) + len(g.free) for g in self.groups) * self.block_size

    def can_grow(self, seq_id: int, length: int) -> bool:
        return all(g.can_grow(seq_id, length) for g in self.groups)

    def grow(self, seq_id: int, length: int):
        for g in self.groups:
            g.grow(seq_id, length)
        return self.table(seq_id)

    def trim(self, seq_id: int, start: int) -> None:
        """Free the window groups' blocks no query of `seq_id` from position `start` on sees."""
        for g in self.groups:
            g.trim(seq_id, start)

    def enter(self, seq_id: int, tokens: list[int], computed: int) -> None:
        """Index `seq_id`'s computed full blocks in every group (`BlockManager.enter`)."""
        for g in self.groups:
            g.enter(seq_id, tokens, computed)

    def share_prefix(self, seq_id: int, tokens: list[int], limit: int) -> int:
        """Give `seq_id` (holding no blocks) the indexed blocks of its first full blocks, the
        same count in every group, at most `limit` tokens' worth; returns the tokens they hold."""
        found = [g.match(tokens, limit // self.block_size) for g in self.groups]
        n = min(map(len, found))
        if n:
            for g, blocks in zip(self.groups, found):
                g.share(seq_id, blocks[:n])
        return n * self.block_size

    def forget(self) -> None:
        """New weights: no indexed block may be shared any more."""
        for g in self.groups:
            g.forget()

    def table(self, seq_id: int):
        if len(self.groups) == 1:
            return self.groups[0].tables[seq_id]
        return tuple(g.tables[seq_id] for g in self.groups)

    def owns(self, seq_id: int) -> bool:
        return self.groups[0].owns(seq_id)

    def release(self, seq_id: int) -> None:
        for g in self.groups:
            g.release(seq_id)
