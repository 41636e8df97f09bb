"""Model runner: turns a scheduled batch into one model forward over the paged KV cache."""

from __future__ import annotations

import torch

from ..model import ForwardBatch, KVCache
from .block_manager import BlockManager
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model, num_blocks: int):
        self.model = model
        self.cache = KVCache(model.config, num_blocks, model.block_size, model.dtype)

    @torch.no_grad()
    def run(self, batch: list[tuple[Sequence, int]],
            blocks: BlockManager) -> tuple[list[Sequence], torch.Tensor]:
        """Feed each sequence its next tokens; return the sequences whose pending tokens are now
        all in the cache (they sample next) and their last-token logits [N, V]."""
        tokens = [torch.tensor(s.token_ids[s.num_computed:s.num_computed + n]) for s, n in batch]
        starts = [s.num_computed for s, _ in batch]
        tables = [blocks.table(s) for s, _ in batch]
        fb = ForwardBatch.build(tokens, starts, self.model.block_size, tables)
        hidden = self.model(fb, self.cache)
        ends = torch.tensor([n for _, n in batch]).cumsum(0) - 1
        ready, rows = [], []
        for i, (s, n) in enumerate(batch):
            s.num_computed += n
            if s.num_pending == 0:
                ready.append(s)
                rows.append(int(ends[i]))
        if not ready:
            return [], hidden.new_zeros(0, self.model.config.vocab_size)
        return ready, self.model.logits(hidden[torch.tensor(rows)])
