"""Model runner: the one paged-KV driver — it turns a step's new tokens into one model forward.

The engine feeds it scheduled sequences (`run`), the model-level `Decoder` feeds it raw token
chunks (`forward`); both go through the same `ForwardBatch` layout, the same KV cache and the
block tables of the same `KVPages`, so `parity check` and the engine exercise one path.
A decode step (every sequence one new token) is replayed from a CUDA graph when the model is on
a GPU (`graphs.py`); anything else, and any step a graph cannot serve, runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from ..model import ForwardBatch, KVCache
from .block_manager import KVPages
from .graphs import DecodeGraphs, mode_for
from .memory import available_memory
from .sequence import Sequence as Request


class ModelRunner:
    def __init__(self, model, num_blocks: int, graphs: str = "auto", window_blocks: int | None = None):
        """`graphs`: 'auto' (decode steps as CUDA graphs on a GPU, for dense models), 'off', or
        'emulate' (the graphs' static padded step run eagerly: tests on a CPU). `window_blocks`:
        the sliding layers' own blocks (`KVCache`), for a model with full and sliding layers."""
        self.model = model
        size = KVCache.bytes_for(model.config, model.dtype, model.block_size, num_blocks, window_blocks)
        free = available_memory(model.device)
        if size > free:  # (was the allocator's own error, or the out-of-memory killer)
            tokens = num_blocks * model.block_size
            raise InputError(f"a KV cache of {tokens:,} tokens takes {size / 2**30:,.1f} GiB; "
                             f"{free / 2**30:,.1f} GiB are available on {model.device}")
        self.cache = KVCache(model.config, num_blocks, model.block_size, model.dtype, model.device,
                             window_blocks)
        self.pages = KVPages(self.cache, model.config.max_position_embeddings)
        """The cache's block managers (the engine's and the Decoder's one allocator)."""
        mode = mode_for(model, graphs)
        self.graphs = DecodeGraphs(model, self.cache, mode) if mode else None

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """Logits [n, V] of a decode step from a graph, or None when it must run eagerly."""
        if self.graphs is None:
            return None
        return self.graphs.run(list(tokens), list(positions), list(tables))

    @torch.no_grad()
    def forward(self, new_tokens: Sequence[torch.Tensor | Sequence[int]], starts: Sequence[int],
                tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Sequence i's `new_tokens[i]` at positions `starts[i]...`, its keys in blocks
        `tables[i]` (already grown to hold them); returns the final hidden states [T, H] of all
        new tokens, packed in order."""
        tables = list(tables)
        window = None
        if self.cache.num_groups > 1:  # ((full layers' table, sliding layers' table) per sequence)
            tables, window = [t[0] for t in tables], [t[1] for t in tables]
        fb = ForwardBatch.build(list(new_tokens), list(starts), self.model.block_size, tables, window)
        return self.model(fb, self.cache)

    @torch.no_grad()
    def run(self, batch: list[tuple[Request, int]],
            blocks: KVPages) -> tuple[list[Request], torch.Tensor, torch.Tensor | None]:
        """Feed each scheduled request its next `n` tokens; return the requests whose pending
        tokens are now all in the cache (they sample next), their last-token logits [N, V] and,
        for MoE models, the experts their last token was routed to [N, moe layers, k]."""
        if self.graphs is not None and all(n == 1 and s.num_pending == 1 for s, n in batch):  # a graph?
            logits = self.decode([s.token_ids[s.num_computed] for s, _ in batch],
                                 [s.num_computed for s, _ in batch],
                                 [blocks.table(s.request_id) for s, _ in batch])
            if logits is not None:
                for s, _ in batch:
                    s.num_computed += 1
                return [s for s, _ in batch], logits, None
        tokens = [s.token_ids[s.num_computed:s.num_computed + n] for s, n in batch]  # lists: one tensor
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
