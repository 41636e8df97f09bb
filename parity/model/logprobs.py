"""Learner-side log-probabilities: `sequence_logprobs` scores whole sequences in one dense forward.

It is differentiable when grad is enabled. The rollout side (the engine, and the model-level
`parity.Decoder` over the same paged KV cache) records the same quantity for every token it
samples; with aligned kernels both give the same float32 bits for the same weights and tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from .batch import ForwardBatch


def as_token_tensor(seq, where: str) -> torch.Tensor:
    t = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
    if t.numel() == 0:
        raise InputError(f"{where}: empty token sequence")
    return t


MIN_TEMPERATURE = 0.01
"""The lowest sampling temperature above 0 (greedy): logits divided by less overflowed, and a
temperature of 1e-300 sampled NUL characters with NaN log-probs."""


def _check_temperature(temperature: float) -> None:
    if not temperature >= MIN_TEMPERATURE:
        raise InputError(f"temperature must be >= {MIN_TEMPERATURE} for log-probs, got {temperature!r}")


def sequence_logprobs(model, sequences: Sequence, temperature: float = 1.0,
                      return_entropy: bool = False):
    """Learner-side log-probs: entry t of result i is `log softmax(logits_t / T)[seq_i[t+1]]`.

    `sequences` is a list of token-id lists or 1-D tensors (length >= 2). Returns float32
    tensors of length len(seq) - 1, differentiable w.r.t. the model when grad is enabled. With
    `return_entropy`, also each position's entropy of softmax(logits / T) (no grad).
    """
    _check_temperature(temperature)
    seqs = [as_token_tensor(s, f"sequence {i}") for i, s in enumerate(sequences)]
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
    rows = torch.cat([torch.arange(n - 1) + st for n, st in zip(lens, starts.tolist())]).to(hidden.device)
    targets = torch.cat([s[1:] for s in seqs]).to(hidden.device)
    logits = model.logits(hidden[rows])
    lp = model.kernels.token_logprobs(logits, targets, temperature)
    split = [n - 1 for n in lens]
    if not return_entropy:
        return list(lp.split(split))
    with torch.no_grad():
        logp = model.kernels.log_softmax(logits.detach(), temperature)
        entropy = -(logp.exp() * logp).sum(-1)
    return list(lp.split(split)), list(entropy.split(split))


def scored_routing(model, sequences: Sequence) -> list[torch.Tensor] | None:
    """Right after `sequence_logprobs(model, sequences)` on an MoE model: for each sequence, the
    experts of every scored position [len - 1, moe layers, k] (the forward of token t produced
    the log-prob of token t + 1), or None for a dense model."""
    routing = model.last_routing
    if routing is None:
        return None
    lens = [len(s) for s in sequences]
    starts = torch.tensor([0] + lens[:-1]).cumsum(0).tolist()
    return [routing[st:st + n - 1] for st, n in zip(starts, lens)]
