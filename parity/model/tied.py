"""The tied embedding / LM-head weight under autograd: one dense gradient, written once.

With `tie_word_embeddings` one [vocab, hidden] weight is both the embedding table and the LM
head. Left to autograd, its two gradients are a dense one from the head and a dense (or sparse)
one from the lookup, combined into a third [vocab, hidden] tensor: at a 150k vocabulary that
zero-fill and copy cost as much as a few of the layer GEMMs per learner step. Here the head's
backward hands its dense gradient to the lookup's backward (which always runs later: the lookup
feeds everything the head sees), which adds the looked-up rows into it in place and returns it
as the weight's only gradient — the same bits as autograd's sum (each row's lookups summed from
zero, then added once), so training is unchanged bit for bit, only faster. Forward values are
the kernels' own, so the learner's log-probs keep the engine's bits; only grad-enabled forwards
come here. On a GPU the looked-up rows are summed by a sort (deterministic, where atomics are
not), so gradients repeat run to run there too, though not in autograd's own order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..ops.common import gemm_linear


class TiedGradient:
    """The head's dense weight gradient, waiting for the lookup's backward (one per forward)."""

    def __init__(self) -> None:
        self.dense: torch.Tensor | None = None


class TiedLookup(torch.autograd.Function):
    """`F.embedding(ids, weight)`; backward adds the rows into the head's gradient."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, slot: TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.slot, ctx.shape, ctx.dtype = slot, weight.shape, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        dense, ctx.slot.dense = ctx.slot.dense, None
        if dense is None:  # the head took no part in this backward
            dense = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        # autograd's own bits: each looked-up row's gradients summed from zero in lookup order (as
        # the embedding backward's index_add does), then added once to the head's gradient
        uniq, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.zeros(len(uniq), grad.shape[-1], dtype=dense.dtype, device=grad.device)
        if rows.is_cuda:  # index_add_ sums repeated rows with atomics there (run to run, other bits);
            rows.index_put_((inverse,), grad.to(dense.dtype), accumulate=True)  # this sorts: deterministic
        else:
            rows.index_add_(0, inverse, grad.to(dense.dtype))
        return None, dense.index_add_(0, uniq, rows), None


class TiedHead(torch.autograd.Function):
    """`linear(hidden, weight)` by the kernel bundle (the engine's bits); backward is plain GEMMs
    and leaves the weight's gradient to `TiedLookup`."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, linear: Callable,
                slot: TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        ctx.slot = slot
        return linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        grad_hidden = gemm_linear(grad, weight.t())  # [N, V] @ [V, H]
        dense = gemm_linear(grad.t(), hidden.t())  # [V, N] @ [N, H]
        ctx.slot.dense = dense if ctx.slot.dense is None else ctx.slot.dense.add_(dense)
        return grad_hidden.to(hidden.dtype), None, None, None
