"""`Decoder`: the model-level decode API — prefill, chunks and one-token steps over a paged cache.

It drives the engine's own `ModelRunner` and its `KVPages` (no scheduler, no sampler): the
caller decides which tokens each sequence gets next. `parity check`'s prefill/decode case and the
kernel benchmark use it, so they exercise exactly the engine's KV path.

    dec = Decoder(model, max_tokens=4096)
    logits = dec.extend({0: prompt_a, 1: prompt_b})      # prefill both
    logits = dec.extend({0: [tok_a], 1: [tok_b]})        # one decode step each
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import InputError
from ..model.logprobs import as_token_tensor, check_model
from .model_runner import ModelRunner


class Decoder:
    """Incremental forward over a paged KV cache for a set of sequences of different lengths."""

    def __init__(self, model, max_tokens: int = 8192, graphs: str = "auto"):
        """`graphs`: decode steps as CUDA graphs on a GPU ('auto'), never ('off'), or their
        static padded step run eagerly ('emulate', for tests on a CPU); see `graphs.py`."""
        check_model(model, "Decoder")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError(f"Decoder max_tokens must be a positive integer, got {max_tokens!r}")
        self.model = model
        num_blocks = -(-max_tokens // model.block_size)
        # (a model with full and sliding layers: the sliding ones in blocks of their own, as many,
        # trimmed behind each sequence's window as in the engine)
        self.runner = ModelRunner(model, num_blocks, graphs, window_blocks=num_blocks)
        self.blocks = self.runner.pages
        self.lengths: dict[int, int] = {}

    @property
    def cache(self):
        return self.runner.cache

    @torch.no_grad()
    def extend(self, new_tokens: Mapping[int, Sequence[int] | torch.Tensor],
               all_logits: bool = False) -> dict[int, torch.Tensor]:
        """Append tokens to sequences (new ids start empty) and run one forward for all of them.

        Returns, per sequence id, the logits [n_new, V] of every new token if `all_logits`,
        else the logits [V] of its last new token.
        """
        if not isinstance(new_tokens, Mapping):  # (a list of lists was a TypeError inside)
            raise InputError(f"Decoder.extend takes a mapping of sequence id -> new tokens, "
                             f"got {type(new_tokens).__name__}")
        ids = list(new_tokens)
        if not ids:
            return {}
        toks = [as_token_tensor(new_tokens[s], f"sequence {s}") for s in ids]
        starts = [self.lengths.get(s, 0) for s in ids]
        limit = self.model.config.max_position_embeddings
        for s, t, st in zip(ids, toks, starts):
            if st + t.numel() > limit:
                raise InputError(f"sequence {s}: length {st + t.numel()} exceeds "
                                 f"max_position_embeddings={limit}")
            self.model.check_tokens(t, f"sequence {s}")
        for s, st in zip(ids, starts):
            self.blocks.trim(s, st)
        needs = [self.blocks.blocks_needed(s, st + t.numel()) for s, t, st in zip(ids, toks, starts)]
        for need, free in zip(map(sum, zip(*needs)), self.blocks.free_blocks):
            if need > free:
                raise InputError(f"KV cache full: this step needs {need} more blocks, "
                                 f"{free} are free (raise max_tokens)")
        tables = [self.blocks.grow(s, st + t.numel()) for s, t, st in zip(ids, toks, starts)]
        counts = [t.numel() for t in toks]
        if self.runner.graphs is not None and all(c == 1 for c in counts):  # a decode step: a graph?
            logits = self.runner.decode(torch.cat(toks).tolist(), starts, tables)  # one read, not one a row
            if logits is not None:
                for s, st in zip(ids, starts):
                    self.lengths[s] = st + 1
                return dict(zip(ids, logits.unsqueeze(1) if all_logits else logits))
        hidden = self.runner.forward(toks, starts, tables)
        for s, t, st in zip(ids, toks, starts):
            self.lengths[s] = st + t.numel()
        if all_logits:
            return dict(zip(ids, self.model.logits(hidden).split(counts)))
        last = torch.tensor(counts, device=hidden.device).cumsum(0) - 1
        return dict(zip(ids, self.model.logits(hidden[last])))

    def release(self, seq_id: int) -> None:
        """Free a finished sequence's cache blocks (an id this decoder does not hold is an
        `InputError`, as in `Engine.release`: a release twice, or of another decoder's id)."""
        if seq_id not in self.lengths and not self.blocks.owns(seq_id):
            raise InputError(f"release: sequence {seq_id!r} is not in this decoder")
        self.blocks.release(seq_id)
        self.lengths.pop(seq_id, None)
