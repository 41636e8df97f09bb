"""Kernel backends behind one switch: `get_kernels("aligned")` or `get_kernels("standard")`.

The model asks for a `Kernels` bundle and calls its functions; it never knows which backend it
runs on. Both backends can be used by different model instances in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import aligned, standard
from .functions import AttentionFn, RMSNormFn, SiluMulFn

BACKENDS = ("aligned", "standard")


@dataclass(frozen=True)
class Kernels:
    """The op families a decoder needs; every function has the signature of `aligned.py`."""

    name: str
    linear: Callable
    rms_norm: Callable
    silu_mul: Callable
    attention: Callable
    token_logprobs: Callable
    log_softmax: Callable


def _aligned_rms_norm(x, weight, eps):
    return RMSNormFn.apply(x, weight, eps)


def _aligned_attention(q, k, v, q_pos, block_size):
    return AttentionFn.apply(q, k, v, q_pos, block_size)


_ALIGNED = Kernels(
    name="aligned",
    linear=aligned.linear,
    rms_norm=_aligned_rms_norm,
    silu_mul=SiluMulFn.apply,
    attention=_aligned_attention,
    token_logprobs=aligned.token_logprobs,
    log_softmax=aligned.log_softmax,
)

_STANDARD = Kernels(
    name="standard",
    linear=standard.linear,
    rms_norm=standard.rms_norm,
    silu_mul=standard.silu_mul,
    attention=standard.attention,
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
