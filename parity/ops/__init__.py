"""Kernel backends behind one switch: `get_kernels("aligned")` or `get_kernels("standard")`.

The model asks for a `Kernels` bundle and calls its functions; it never knows which backend it
runs on. Both backends can be used by different model instances in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import aligned, standard
from .functions import AttentionFn, RMSNormFn, SiluMulFn

BACKENDS = ("aligned", "standard")


@dataclass(frozen=True)
class Kernels:
    """The op families a decoder needs; every function has the signature of `aligned.py`."""

    name: str
    linear: Callable
    rms_norm: Callable
    rms_norm_rope: Callable
    silu_mul: Callable
    attention: Callable
    paged_attention: Callable
    token_logprobs: Callable
    log_softmax: Callable


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# The autograd functions' forward *is* the aligned kernel, so calling the kernel directly when
# nothing needs a gradient gives the same bits without the autograd bookkeeping.
def _aligned_rms_norm(x, weight, eps):
    if _needs_grad(x, weight):
        return RMSNormFn.apply(x, weight, eps)
    return aligned.rms_norm(x, weight, eps)


def _aligned_rms_norm_rope(x, weight, eps, cos, sin):
    if _needs_grad(x, weight):
        return aligned.rope(RMSNormFn.apply(x, weight, eps), cos, sin)
    return aligned.rms_norm_rope(x, weight, eps, cos, sin)


def _aligned_silu_mul(gate, up):
    if _needs_grad(gate, up):
        return SiluMulFn.apply(gate, up)
    return aligned.silu_mul(gate, up)


def _aligned_attention(q, k, v, q_pos, block_size):
    if _needs_grad(q, k, v):
        return AttentionFn.apply(q, k, v, q_pos, block_size)
    return aligned.attention(q, k, v, q_pos, block_size)


_ALIGNED = Kernels(
    name="aligned",
    linear=aligned.linear,
    rms_norm=_aligned_rms_norm,
    rms_norm_rope=_aligned_rms_norm_rope,
    silu_mul=_aligned_silu_mul,
    attention=_aligned_attention,
    paged_attention=aligned.paged_attention,
    token_logprobs=aligned.token_logprobs,
    log_softmax=aligned.log_softmax,
)

_STANDARD = Kernels(
    name="standard",
    linear=standard.linear,
    rms_norm=standard.rms_norm,
    rms_norm_rope=standard.rms_norm_rope,
    silu_mul=standard.silu_mul,
    attention=standard.attention,
    paged_attention=standard.paged_attention,
    token_logprobs=standard.token_logprobs,
    log_softmax=standard.log_softmax,
)


def get_kernels(name: str) -> Kernels:
    """Return the kernel bundle called `name` ('aligned' or 'standard')."""
    if name == "aligned":
        return _ALIGNED
    if name == "standard":
        return _STANDARD
    raise ValueError(f"unknown kernels {name!r}: expected one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Kernels", "aligned", "get_kernels", "standard"]
