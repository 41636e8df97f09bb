"""Learner-side log-probabilities: `sequence_logprobs` scores whole sequences in one dense forward.

It is differentiable when grad is enabled. The rollout side (the engine, and the model-level
`parity.Decoder` over the same paged KV cache) records the same quantity for every token it
samples; with aligned kernels both give the same float32 bits for the same weights and tokens.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ..errors import InputError
from ..ops.common import compute_dtype, gemm_linear
from .batch import ForwardBatch
from .config import ModelConfig
from .tied import TiedGradient


def _check_tensor(seq: torch.Tensor, where: str) -> torch.Tensor:
    if seq.dtype == torch.bool or seq.is_floating_point() or seq.is_complex():
        raise InputError(f"{where}: token ids must be integers, got a {seq.dtype} tensor")
    if seq.dim() > 1:
        raise InputError(f"{where}: one sequence of token ids (1-D), got shape {tuple(seq.shape)}")
    return seq.reshape(-1)


def token_list(seq, where: str) -> list[int]:
    """The token ids of one sequence (a list of integers or a 1-D integer tensor) as a list; floats,
    bools, strings, sets, dicts and nested lists are an InputError (they were truncated, split into
    characters or flattened into one sequence)."""
    if isinstance(seq, torch.Tensor):
        return _check_tensor(seq, where).tolist()
    if isinstance(seq, (str, bytes, dict, set, frozenset)) or not hasattr(seq, "__iter__"):
        raise InputError(f"{where}: a sequence must be a list of token ids, got {type(seq).__name__}")
    ids = list(seq)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InputError(f"{where}: token ids must be integers, got {t!r}")
    return [int(t) for t in ids]


def as_token_tensor(seq, where: str) -> torch.Tensor:
    """`token_list` as an int64 tensor (an integer tensor is taken as it is, not through a list)."""
    if isinstance(seq, torch.Tensor):
        t = _check_tensor(seq, where).to(torch.long)
    else:
        ids = token_list(seq, where)
        try:
            t = torch.tensor(ids, dtype=torch.long)
        except (OverflowError, ValueError, RuntimeError):  # (a Python int past 64 bits)
            raise InputError(f"{where}: token id {max(ids, key=abs)} is outside the vocabulary") from None
    if t.numel() == 0:
        raise InputError(f"{where}: empty token sequence")
    return t


def check_model(model, who: str) -> None:
    """A one-line error when `model` is not a parity Model (was an AttributeError deep inside)."""
    if not isinstance(getattr(model, "config", None), ModelConfig) or not hasattr(model, "block_size"):
        raise InputError(f"{who} needs a parity.Model, got {type(model).__name__}")


def check_sequence(model, seq, where: str) -> torch.Tensor:
    """One sequence to score, checked: integer ids in the vocabulary, 2 to max_position_embeddings
    of them."""
    s = as_token_tensor(seq, where)
    max_len = model.config.max_position_embeddings
    if s.numel() < 2:
        raise InputError(f"{where}: needs at least 2 tokens to score one")
    if s.numel() > max_len:
        raise InputError(f"{where}: length {s.numel()} exceeds max_position_embeddings={max_len}")
    model.check_tokens(s, where)
    return s


MIN_TEMPERATURE = 0.01
"""The lowest sampling temperature above 0 (greedy): logits divided by less overflowed, and a
temperature of 1e-300 sampled NUL characters with NaN log-probs."""


def _check_temperature(temperature: float) -> None:
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not number or not MIN_TEMPERATURE <= temperature < float("inf"):
        raise InputError(f"temperature must be >= {MIN_TEMPERATURE} and finite for log-probs, "
                         f"got {temperature!r}")


def sequence_logprobs(model, sequences: Sequence, temperature: float = 1.0,
                      return_entropy: bool = False, *, head_chunk: int = 0, recompute: bool = False):
    """Learner-side log-probs: entry t of result i is `log softmax(logits_t / T)[seq_i[t+1]]`.

    `sequences` is a list of token-id lists or 1-D tensors (length >= 2). Returns float32
    tensors of length len(seq) - 1, differentiable w.r.t. the model when grad is enabled. With
    `return_entropy`, also each position's entropy of softmax(logits / T) (no grad).

    Memory (the values are the same bits either way on aligned kernels, whose rows do not depend
    on how many rows a product has): `head_chunk` > 0 runs the LM head and log-softmax over that
    many positions at a time, so no [tokens, vocab] tensor is ever whole (`ChunkedHead`: under grad
    the backward runs the head again by blocks of vocabulary rows); `recompute` keeps only each
    layer's input for the backward (activation checkpointing: `Model.forward`).
    """
    check_model(model, "sequence_logprobs")
    _check_temperature(temperature)
    if isinstance(head_chunk, bool) or not isinstance(head_chunk, numbers.Integral) or head_chunk < 0:
        raise InputError(f"head_chunk must be an integer >= 0 (0 = no chunks), got {head_chunk!r}")
    if not isinstance(recompute, bool):
        raise InputError(f"recompute must be True or False, got {recompute!r}")
    if isinstance(sequences, (torch.Tensor, str, bytes)) or not hasattr(sequences, "__iter__"):
        raise InputError(f"sequences must be a list of token-id sequences, got {type(sequences).__name__}")
    seqs = [check_sequence(model, s, f"sequence {i}") for i, s in enumerate(sequences)]
    if not seqs:
        return ([], []) if return_entropy else []
    batch = ForwardBatch.build(seqs, [0] * len(seqs), model.block_size)
    hidden = model(batch, recompute=recompute)
    lens = [s.numel() for s in seqs]
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    rows = torch.cat([torch.arange(n - 1) + st for n, st in zip(lens, starts.tolist())]).to(hidden.device)
    targets = torch.cat([s[1:] for s in seqs]).to(hidden.device)
    hidden = hidden[rows]
    entropy: list[torch.Tensor] = []
    if 0 < head_chunk < len(rows):
        tied = model._tied if model._tied_autograd() else None
        lp = ChunkedHead.apply(hidden, model.lm_head_weight, targets, model.kernels, temperature,
                               head_chunk, entropy if return_entropy else None, tied,
                               model.config.final_logit_softcapping)
    else:
        logits = model.logits(hidden)
        lp = model.kernels.token_logprobs(logits, targets, temperature)
        if return_entropy:
            entropy.append(_entropy(model.kernels, logits, temperature))
    split = [n - 1 for n in lens]
    if not return_entropy:
        return list(lp.split(split))
    return list(lp.split(split)), list(torch.cat(entropy).split(split))


def soft_cap(kernels, z: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's soft-cap of logits, c * tanh(z / c), in z's dtype as transformers computes it (tanh
    through the bundle's `pointwise`: an element's bits do not depend on where it sits); z itself
    when `cap` is None. `Model.logits` and `ChunkedHead` both cap through this one function."""
    return z if cap is None else kernels.pointwise(torch.tanh, z / cap) * cap


ENTROPY_ROWS = 256
"""Entropies are computed this many positions at a time (a float32 [rows, vocab] block each)."""


def _entropy(kernels, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        out = []
        for s in range(0, len(logits), ENTROPY_ROWS):
            logp = kernels.log_softmax(logits[s:s + ENTROPY_ROWS].detach(), temperature)
            out.append(-(logp.exp() * logp).sum(-1))
        return torch.cat(out)


class ChunkedHead(torch.autograd.Function):
    """Token log-probs through the LM head `chunk` positions at a time: [N, H] -> [N] float32.

    Forward: each chunk's logits by the kernel bundle's linear (the engine's bits: an aligned row
    does not depend on the product's row count), its log-probs (and entropies, into `entropy`),
    then the logits are dropped; each position's log-sum-exp is kept (N floats). Backward, in
    blocks of vocabulary rows as large as a chunk (N x block <= chunk x vocab): the block's logits
    for every position, its softmax from the kept log-sum-exp, the log-probs' gradient through
    it ((onehot - p) / T), then plain GEMMs as `TiedHead`'s: each row of the weight's gradient
    is one product over all N positions (rounded once, no [vocab, hidden] accumulator), the hidden
    gradient sums the blocks' products in float32. With tied embeddings the weight's gradient is
    handed to the lookup's backward (`tied.py`), not returned. Soft-capped logits (`cap`, Gemma)
    are capped by `soft_cap` in the forward; the backward caps its block by `soft_cap` too (in
    bfloat16 a cap computed otherwise rounds otherwise: its softmax would not sum to 1 against the
    forward's log-sum-exp) and multiplies the logits' gradient by the cap's derivative,
    1 - tanh(z / c)^2."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, kernels, temperature: float, chunk: int,
                entropy: list | None, tied: TiedGradient | None, cap: float | None = None) -> torch.Tensor:
        out, lse = [], []
        for s in range(0, len(hidden), chunk):
            logits = soft_cap(kernels, kernels.linear(hidden[s:s + chunk], weight), cap)
            lp = kernels.token_logprobs(logits, targets[s:s + chunk], temperature)
            out.append(lp)  # log p = logit_t / T - lse
            lse.append(logits.gather(1, targets[s:s + chunk, None])[:, 0].float() / temperature - lp)
            if entropy is not None:
                entropy.append(_entropy(kernels, logits, temperature))
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lse))
        ctx.temperature, ctx.block, ctx.tied, ctx.cap = temperature, chunk * len(weight), tied, cap
        ctx.kernels = kernels
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        n, t = len(hidden), ctx.temperature
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.tied is not None
        grad_hidden = torch.zeros(n, hidden.shape[1], dtype=compute_dtype(hidden.dtype),
                                  device=hidden.device) if want_h else None
        grad_weight = torch.empty_like(weight) if want_w else None
        scale = grad.float() / t  # d log p_i / d logit_iv = (1[v = target_i] - p_iv) / T
        rows = max(1, ctx.block // max(n, 1))
        for v0 in range(0, len(weight), rows):
            w = weight[v0:v0 + rows]
            z = gemm_linear(hidden, w)
            if ctx.cap is not None:  # capped as the forward capped (its roundings), differentiated exactly
                tanh = torch.tanh(z.float() / ctx.cap)
                z = soft_cap(ctx.kernels, z, ctx.cap)
            p = z.float().div_(t).sub_(lse[:, None]).exp_()  # [N, block]
            g = p.mul_(scale[:, None]).neg_()
            mine = (targets >= v0) & (targets < v0 + len(w))
            g[mine.nonzero()[:, 0], targets[mine] - v0] += scale[mine]
            if ctx.cap is not None:  # through the cap: d(c tanh(z / c))/dz = 1 - tanh^2
                g.mul_(1.0 - tanh * tanh)
            g = g.to(weight.dtype)
            if want_h:
                grad_hidden.add_(gemm_linear(g, w.t()))  # [N, block] @ [block, H]
            if want_w:
                grad_weight[v0:v0 + rows] = gemm_linear(g.t(), hidden.t())  # [block, N] @ [N, H]
        if ctx.tied is not None:
            slot = ctx.tied
            slot.dense = grad_weight if slot.dense is None else slot.dense.add_(grad_weight)
            grad_weight = None
        grad_hidden = grad_hidden.to(hidden.dtype) if want_h else None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


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
