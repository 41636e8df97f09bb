"""Gradient clipping whose norm does not overflow: huge but finite gradients are clipped, not zeroed.

`torch.nn.utils.clip_grad_norm_` sums squares in float32. Gradients each finite, of ~1e19 or more (a
live token with log w of ~44..88 under the unclipped REINFORCE Zero objective can give them), have a
sum of squares past float32's range: the norm came back inf, every gradient was multiplied by
max_norm / inf = 0, and AdamW still moved the weights on its momentum, with no skip reported. Here
such a norm is measured again in float64, where finite float32 gradients cannot overflow, and the
gradients are scaled down to `max_norm` as clipping means to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` in place so their total 2-norm is at most `max_norm`;
    return the norm before clipping (the same bits as `clip_grad_norm_` whenever its norm is finite)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if grads and not bool(torch.isfinite(norm)):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
