"""Kernel backends behind one switch: `get_kernels("aligned")` or `get_kernels("standard")`.

The model, the engine's sampler and the learner ask for a `Kernels` bundle and call its functions;
they never know which backend they run on, and no model, engine or learner code imports a backend
module (the tools that measure or compile one backend's kernels do: `apps/bench_*`, `apps/compile`,
and the GPU sampler, `engine/draws_triton.py`, which is a Triton kernel of its own). Everything
backend-specific is a field of the bundle: the op functions, the smallest row count token-wise
work is padded to (`token_rows`: aligned, 4-row multiples below 12 rows unless
its matrix-vector kernel serves them, the standard one not at all) and
how element-wise transcendental functions are applied (`pointwise`). Both backends can be used by
different model instances in one process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..signals import import_held
from . import aligned, gemm, moe, native, standard
from .functions import AttentionFn, RMSNormFn, SiluMulFn

BACKENDS: tuple[str, ...] = ("aligned", "standard")
"""Every kernel backend's name; configs and the CLI validate against this tuple."""


@dataclass(frozen=True)
class Kernels:
    """The op families a decoder needs; every function has the signature of `aligned.py`."""

    name: str
    token_rows: Callable[[int, torch.dtype], int]
    """`token_rows(m, dtype)`: the row count token-wise work (embeddings, projections, norms, MLP)
    of m tokens is padded to."""
    pointwise: Callable
    """`pointwise(fn, x)`: an element-wise `fn` applied so that its bits do not depend on where an
    element sits in the tensor (aligned), or simply `fn(x)` (standard)."""
    linear: Callable
    rms_norm: Callable
    rms_norm_rope: Callable
    silu_mul: Callable
    """`silu_mul(gate_up [T, 2I]) -> [T, I]`: SwiGLU, silu of the first half times the second."""
    attention: Callable
    """`attention(q [B, M, Hq, D], k, v [B, L, Hkv, D], q_pos [B, M], block_size, window=0,
    softcap=0.0, scale=None)`: causal GQA attention of each query over keys 0..its position (with
    a sliding `window` > 0, over the last `window` of them), keys read in pages of `block_size`
    (the learner's dense layout); scores q.k times `scale` (None: 1/sqrt(D)), soft-capped to
    softcap * tanh(score / softcap) when `softcap` > 0 (Gemma 2)."""
    paged_attention: Callable
    """`paged_attention(q, k_cache, v_cache, tables, q_pos, window=0, softcap=0.0, scale=None)`: the
    same, keys read through the KV cache's block tables (the engine's layout)."""
    token_logprobs: Callable
    log_softmax: Callable
    rope: Callable
    """Rotary embedding without a preceding norm (models without q/k norm)."""
    moe_route: Callable
    """`moe_route(router_logits, k, normalize) -> (weights, expert ids)`: top-k routing, the
    weights in float32 (the MoE block casts them as its family does)."""
    moe_combine: Callable
    """`moe_combine(parts [T, k, H]) -> [T, H]`: a token's weighted expert outputs summed."""
    moe_experts: Callable
    """`moe_experts(h [T, H], expert ids [T, k], gate_up [E, 2I, H], down [E, H, I]) -> [T * k, H]`:
    each slot's expert output (slot j of token i at row i * k + j), one GEMM chain per expert
    (`moe.py`)."""
    index_dtype: torch.dtype = torch.int64
    """The integer dtype attention takes block tables and query positions in (a model forward
    converts them once, not every layer): int64 on the CPU backends, int32 for Triton."""
    impl: str = "cpu"
    """Which implementation serves the backend: 'cpu' (C kernels or pure PyTorch; `standard`
    everywhere) or 'triton' (the aligned backend on CUDA, or on CPU through the interpreter)."""


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


def _aligned_silu_mul(gate_up):
    if _needs_grad(gate_up):
        return SiluMulFn.apply(gate_up)
    return aligned.silu_mul(gate_up)


def _aligned_attention(q, k, v, q_pos, block_size, window=0, softcap=0.0, scale=None):
    if _needs_grad(q, k, v):
        return AttentionFn.apply(q, k, v, q_pos, block_size, window, softcap, scale)
    return aligned.attention(q, k, v, q_pos, block_size, window, softcap, scale)


_ALIGNED = Kernels(
    name="aligned",
    token_rows=gemm.token_rows,
    pointwise=aligned.pointwise,
    linear=gemm.linear,
    rms_norm=_aligned_rms_norm,
    rms_norm_rope=_aligned_rms_norm_rope,
    silu_mul=_aligned_silu_mul,
    attention=_aligned_attention,
    paged_attention=aligned.paged_attention,
    token_logprobs=aligned.token_logprobs,
    log_softmax=aligned.log_softmax,
    rope=aligned.rope,
    moe_route=aligned.moe_route,
    moe_combine=aligned.moe_combine,
    moe_experts=moe.aligned_experts(gemm.linear, _aligned_silu_mul),
)

def _plain_pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def unpadded(m: int, dtype: torch.dtype | None = None) -> int:
    """`token_rows` of a backend whose GEMM rows never depend on M: no padding."""
    return m


_STANDARD = Kernels(
    name="standard",
    token_rows=unpadded,
    pointwise=_plain_pointwise,
    linear=standard.linear,
    rms_norm=standard.rms_norm,
    rms_norm_rope=standard.rms_norm_rope,
    silu_mul=standard.silu_mul,
    attention=standard.attention,
    paged_attention=standard.paged_attention,
    token_logprobs=standard.token_logprobs,
    log_softmax=standard.log_softmax,
    rope=standard.rope,
    moe_route=standard.moe_route,
    moe_combine=standard.moe_combine,
    moe_experts=moe.expert_loop(standard.linear, standard.silu_mul),
)


_BUNDLES = {b.name: b for b in (_ALIGNED, _STANDARD)}
assert tuple(_BUNDLES) == BACKENDS


def check_backend(name: str, what: str = "kernels") -> str:
    """`name` if it is a backend's name, else a one-line ConfigError naming `what`."""
    if name not in _BUNDLES:
        raise ConfigError(f"{what} must be one of {', '.join(repr(b) for b in BACKENDS)}, got {name!r}")
    return name


def aligned_impl(device: torch.device | str | None = None) -> str:
    """Which implementation of the aligned backend serves tensors on `device`: 'triton' on CUDA,
    'cpu' (the native C kernels or their pure-PyTorch form) elsewhere. PARITY_ALIGNED_IMPL=triton
    runs the Triton kernels on CPU tensors too, through Triton's interpreter (tests, no GPU)."""
    forced = os.environ.get("PARITY_ALIGNED_IMPL", "auto")
    if forced not in ("auto", "cpu", "triton"):
        raise ConfigError(f"PARITY_ALIGNED_IMPL must be 'auto', 'cpu' or 'triton', got {forced!r}")
    if forced != "auto":
        return forced
    return "triton" if torch.device(device or "cpu").type == "cuda" else "cpu"


def describe_aligned(device: torch.device | str | None = None) -> str:
    """Which aligned implementation runs for `device`, in words (`parity check` prints it)."""
    if aligned_impl(device) == "triton":
        from . import triton_gemm
        where = "through Triton's interpreter on CPU tensors" if triton_gemm.INTERPRET else "on CUDA"
        return f"Triton kernels {where}; {triton_gemm.describe_tiles()}"
    return f"{native.describe()}; {gemm.describe()}"


def get_kernels(name: str, device: torch.device | str | None = None) -> Kernels:
    """Return the kernel bundle called `name` (one of `BACKENDS`) for tensors on `device`
    (default CPU). `standard` is the same plain PyTorch code everywhere (cuBLAS and SDPA on
    CUDA); `aligned` is the Triton kernels on CUDA and the CPU kernels elsewhere."""
    check_backend(name)
    if name == "aligned" and aligned_impl(device) == "triton":
        import_held(f"{__name__}.triton_bundle")  # (Triton's first import: `parity/signals.py`)
        from .triton_bundle import TRITON_ALIGNED
        return TRITON_ALIGNED
    return _BUNDLES[name]


__all__ = ["BACKENDS", "Kernels", "aligned_impl", "check_backend", "describe_aligned", "get_kernels"]
