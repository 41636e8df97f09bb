"""Log-probabilities on both sides: `sequence_logprobs` (learner) and `Decoder` (rollout).

`sequence_logprobs` runs whole sequences in one batched dense forward (differentiable when grad
is enabled). `Decoder` runs the same model incrementally over a paged KV cache: prefill, chunked
prefill and one-token decode steps for many sequences at once, each sequence at its own length.
With aligned kernels both give the same float32 bits for the same weights and tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import InputError
from .batch import ForwardBatch
from .kv_cache import KVCache, SimpleAllocator


def _as_tokens(seq, where: str) -> torch.Tensor:
    t = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
    if t.numel() == 0:
        raise InputError(f"{where}: empty token sequence")
    return t


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise InputError(f"temperature must be > 0 for log-probs, got {temperature!r}")


def sequence_logprobs(model, sequences: Sequence, temperature: float = 1.0,
                      return_entropy: bool = False):
    """Learner-side log-probs: entry t of result i is `log softmax(logits_t / T)[seq_i[t+1]]`.

    `sequences` is a list of token-id lists or 1-D tensors (length >= 2). Returns float32
    tensors of length len(seq) - 1, differentiable w.r.t. the model when grad is enabled. With
    `return_entropy`, also each position's entropy of softmax(logits / T) (no grad).
    """
    _check_temperature(temperature)
    seqs = [_as_tokens(s, f"sequence {i}") for i, s in enumerate(sequences)]
    if not seqs:
        return ([], []) if return_entropy else []
    max_len = model.config.max_position_embeddings
    for i, s in enumerate(seqs):
        if s.numel() < 2:
            raise InputError(f"sequence {i}: needs at least 2 tokens to score one")
        if s.numel() > max_len:
            raise InputError(f"sequence {i}: length {s.numel()} exceeds max_position_embeddings={max_len}")
        model.check_tokens(s, f"sequence {i}")
    batch = ForwardBatch.build(seqs, [0] * len(seqs), model.block_size)
    hidden = model(batch)
    lens = [s.numel() for s in seqs]
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    rows = torch.cat([torch.arange(n - 1) + st for n, st in zip(lens, starts.tolist())])
    targets = torch.cat([s[1:] for s in seqs])
    logits = model.logits(hidden[rows])
    lp = model.kernels.token_logprobs(logits, targets, temperature)
    split = [n - 1 for n in lens]
    if not return_entropy:
        return list(lp.split(split))
    with torch.no_grad():
        logp = model.kernels.log_softmax(logits.detach(), temperature)
        entropy = -(logp.exp() * logp).sum(-1)
    return list(lp.split(split)), list(entropy.split(split))


class Decoder:
    """Incremental forward over a paged KV cache for a set of sequences of different lengths.

    >>> dec = Decoder(model, max_tokens=4096)
    >>> logits = dec.extend({0: prompt_a, 1: prompt_b})     # prefill both
    >>> logits = dec.extend({0: [tok_a], 1: [tok_b]})       # one decode step each
    """

    def __init__(self, model, max_tokens: int = 8192):
        self.model = model
        nblocks = -(-max_tokens // model.block_size)
        self.cache = KVCache(model.config, nblocks, model.block_size, model.dtype)
        self.alloc = SimpleAllocator(self.cache)
        self.lengths: dict[int, int] = {}

    @torch.no_grad()
    def extend(self, new_tokens: Mapping[int, Sequence[int] | torch.Tensor],
               all_logits: bool = False) -> dict[int, torch.Tensor]:
        """Append tokens to sequences (new ids start empty) and run one forward for all of them.

        Returns, per sequence id, the logits [n_new, V] of every new token if `all_logits`,
        else the logits [V] of its last new token.
        """
        ids = list(new_tokens)
        if not ids:
            return {}
        toks = [_as_tokens(new_tokens[s], f"sequence {s}") for s in ids]
        starts = [self.lengths.get(s, 0) for s in ids]
        limit = self.model.config.max_position_embeddings
        for s, t, st in zip(ids, toks, starts):
            if st + t.numel() > limit:
                raise InputError(f"sequence {s}: length {st + t.numel()} exceeds "
                                 f"max_position_embeddings={limit}")
            self.model.check_tokens(t, f"sequence {s}")
        bs = self.model.block_size
        need = sum(max(0, -(-(st + t.numel()) // bs) - len(self.alloc.tables.get(s, ())))
                   for s, t, st in zip(ids, toks, starts))
        if need > len(self.alloc.free):
            raise InputError(f"KV cache full: this step needs {need} more blocks, "
                             f"{len(self.alloc.free)} are free (raise max_tokens)")
        tables = [self.alloc.ensure(s, st + t.numel()) for s, t, st in zip(ids, toks, starts)]
        batch = ForwardBatch.build(toks, starts, self.model.block_size, tables)
        hidden = self.model(batch, self.cache)
        for s, t, st in zip(ids, toks, starts):
            self.lengths[s] = st + t.numel()
        out: dict[int, torch.Tensor] = {}
        offset = 0
        if all_logits:
            logits = self.model.logits(hidden)
        else:
            last = torch.tensor([0] + batch.seq_lens).cumsum(0)[1:] - 1
            logits = self.model.logits(hidden[last])
        for j, (s, t) in enumerate(zip(ids, toks)):
            if all_logits:
                out[s] = logits[offset:offset + t.numel()]
                offset += t.numel()
            else:
                out[s] = logits[j]
        return out

    def release(self, seq_id: int) -> None:
        """Free a finished sequence's cache blocks."""
        self.alloc.release(seq_id)
        self.lengths.pop(seq_id, None)
