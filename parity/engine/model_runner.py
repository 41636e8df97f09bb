"""Model runner: the one paged-KV driver — it turns a step's new tokens into one model forward.

The engine feeds it scheduled sequences (`run`), the model-level `Decoder` feeds it raw token
chunks (`forward`); both go through the same `ForwardBatch` layout, the same KV cache and the
block tables of the same `BlockManager`, so `parity check` and the engine exercise one path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model import ForwardBatch, KVCache
from .block_manager import BlockManager
from .sequence import Sequence as Request


class ModelRunner:
    def __init__(self, model, num_blocks: int):
        self.model = model
        self.cache = KVCache(model.config, num_blocks, model.block_size, model.dtype, model.device)

    @torch.no_grad()
    def forward(self, new_tokens: Sequence[torch.Tensor], starts: Sequence[int],
                tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Sequence i's `new_tokens[i]` at positions `starts[i]...`, its keys in blocks
        `tables[i]` (already grown to hold them); returns the final hidden states [T, H] of all
        new tokens, packed in order."""
        fb = ForwardBatch.build(list(new_tokens), list(starts), self.model.block_size, list(tables))
        return self.model(fb, self.cache)

    @torch.no_grad()
    def run(self, batch: list[tuple[Request, int]],
            blocks: BlockManager) -> tuple[list[Request], torch.Tensor, torch.Tensor | None]:
        """Feed each scheduled request its next `n` tokens; return the requests whose pending
        tokens are now all in the cache (they sample next), their last-token logits [N, V] and,
        for MoE models, the experts their last token was routed to [N, moe layers, k]."""
        tokens = [torch.tensor(s.token_ids[s.num_computed:s.num_computed + n]) for s, n in batch]
        hidden = self.forward(tokens, [s.num_computed for s, _ in batch],
                              [blocks.table(s.request_id) for s, _ in batch])
        ends = torch.tensor([n for _, n in batch]).cumsum(0) - 1
        ready, rows = [], []
        for i, (s, n) in enumerate(batch):
            s.num_computed += n
            if s.num_pending == 0:
                ready.append(s)
                rows.append(int(ends[i]))
        if not ready:
            return [], hidden.new_zeros(0, self.model.config.vocab_size), None
        index = torch.tensor(rows, device=hidden.device)
        routing = self.model.last_routing
        return ready, self.model.logits(hidden[index]), None if routing is None else routing[index].cpu()
