"""The aligned backend on CUDA: the Triton kernels behind the same `Kernels` fields as the CPU form.

`get_kernels("aligned", device)` returns this bundle for CUDA tensors (and for CPU tensors under
PARITY_ALIGNED_IMPL=triton, through Triton's interpreter). The learner's forward is these same
kernels under autograd: each op with a gradient is a custom autograd function whose forward is
the Triton kernel and whose backward is ordinary PyTorch math (gradients must be right, not
bitwise-aligned). Element-wise PyTorch ops on a GPU do not depend on an element's position, so
`pointwise` is plain application there; on CPU tensors it keeps the CPU backend's padding.
"""

from __future__ import annotations

import torch

from . import Kernels, aligned, unpadded
from . import triton_attention as ta
from . import triton_gemm as tg
from . import triton_kernels as tk
from . import triton_norm_rope as norm_rope
from .common import check_logprob_args, compute_dtype, rope
from .functions import AttentionFn, RMSNormFn, SiluMulFn, rms_norm_backward
from .moe import expert_loop


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` on a GPU (and when compiling for one: `parity compile` mirrors the GPU's ops); on
    CPU tensors in interpreter runs the CPU backend's tail-free padding."""
    return aligned.pointwise(fn, x) if tk.INTERPRET and not x.is_cuda else fn(x)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return tg.matmul(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` by the fixed-tile Triton GEMM. [..., K] -> [..., N]"""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if _needs_grad(x, weight, bias):
        y = _LinearFn.apply(x2, weight, bias)
    else:
        y = tg.matmul(x2, weight, bias)
    return y.view(*lead, weight.shape[0])


class _RMSNormFn(RMSNormFn):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return tk.rms_norm(x, weight, eps)


def _silu_mul(gate_up):
    half = gate_up.shape[-1] // 2
    return tk.silu_mul(gate_up[..., :half], gate_up[..., half:])


class _SiluMulFn(SiluMulFn):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _silu_mul(gate_up)


class _AttentionFn(AttentionFn):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, block_size, window=0, softcap=0.0, scale=None):
        ctx.save_for_backward(q, k, v, q_pos)
        ctx.spec = dict(window=window, softcap=softcap, scale=scale)
        return ta.attention(q, k, v, q_pos, block_size, **ctx.spec)


def rms_norm(x, weight, eps):
    return _RMSNormFn.apply(x, weight, eps) if _needs_grad(x, weight) else tk.rms_norm(x, weight, eps)


class _RMSNormRopeFn(torch.autograd.Function):
    """q/k head norm + RoPE by the fused kernel; backward: RoPE's transpose, then RMSNorm's."""

    @staticmethod
    def forward(ctx, x, weight, eps, cos, sin):
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.eps = eps
        return norm_rope.rms_norm_rope(x, weight, eps, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        x, weight, cos, sin = ctx.saved_tensors
        g = grad.to(compute_dtype(grad.dtype))
        half = g.shape[-1] // 2
        gs = g * sin.unsqueeze(1)  # out_lo = y_lo cos - y_hi sin, out_hi = y_hi cos + y_lo sin
        grad_y = g * cos.unsqueeze(1) + torch.cat([gs[..., half:], -gs[..., :half]], dim=-1)
        grad_x, grad_w = rms_norm_backward(x, weight, grad_y.to(x.dtype), ctx.eps)
        return grad_x, grad_w, None, None, None


def rms_norm_rope(x, weight, eps, cos, sin):
    """RMSNorm of each q/k head vector then RoPE: one kernel (one launch instead of a norm and
    the half-dozen PyTorch ops of RoPE). x [T, H, D], cos/sin [T, D] float32."""
    if x.shape[-1] % 2:
        return rope(rms_norm(x, weight, eps), cos, sin)
    if _needs_grad(x, weight):
        return _RMSNormRopeFn.apply(x, weight, eps, cos, sin)
    return norm_rope.rms_norm_rope(x, weight, eps, cos, sin)


def silu_mul(gate_up):
    return _SiluMulFn.apply(gate_up) if _needs_grad(gate_up) else _silu_mul(gate_up)


def attention(q, k, v, q_pos, block_size, window=0, softcap=0.0, scale=None):
    if _needs_grad(q, k, v):
        return _AttentionFn.apply(q, k, v, q_pos, block_size, window, softcap, scale)
    return ta.attention(q, k, v, q_pos, block_size, window=window, softcap=softcap, scale=scale)


class _RowLSEFn(torch.autograd.Function):
    """logsumexp(logits * inv_t) per row by the fixed-chunk kernel; gradient softmax * inv_t."""

    @staticmethod
    def forward(ctx, logits, inv_t: float):
        lse = tk.row_lse(logits, inv_t)
        ctx.save_for_backward(logits, lse)
        ctx.inv_t = inv_t
        return lse

    @staticmethod
    def backward(ctx, grad):
        logits, lse = ctx.saved_tensors
        probs = torch.exp(logits.float() * ctx.inv_t - lse.unsqueeze(-1))
        return (grad.unsqueeze(-1) * probs * ctx.inv_t).to(logits.dtype), None


def _inv_temperature(temperature: float) -> float:
    """1/T rounded to float32 once: the value the kernel and every product use."""
    return float(torch.tensor(1.0 / temperature, dtype=torch.float32))


def _row_lse(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    inv = _inv_temperature(temperature)
    return _RowLSEFn.apply(logits, inv) if _needs_grad(logits) else tk.row_lse(logits, inv)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log_softmax(logits / T)[token]` in float32. logits [N, V], tokens [N] -> [N]. The sampled
    logit is picked, then scaled (an exact product: the same bits as scaling the row first)."""
    check_logprob_args(logits, tokens, temperature)
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(compute_dtype(logits.dtype))
    return picked * _inv_temperature(temperature) - _row_lse(logits, temperature)


def log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Full `log_softmax(logits / T)` rows in float32, same bits as `token_logprobs`. [N, V]"""
    check_logprob_args(logits, None, temperature)
    z = logits.to(compute_dtype(logits.dtype)) * _inv_temperature(temperature)
    return z - _row_lse(logits, temperature).unsqueeze(-1)


def moe_route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing as `aligned.moe_route`: softmax by the fixed-chunk log-sum-exp, a stable sort,
    the top k renormalised by a sum in rank order. Every step is per row."""
    probs = pointwise(torch.exp, log_softmax(logits, 1.0))
    top, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, idx = top[:, :k], idx[:, :k]
    if normalize:
        total = top[:, 0]
        for j in range(1, k):
            total = total + top[:, j]
        top = top / total.unsqueeze(-1)
    return top, idx


TRITON_ALIGNED = Kernels(
    name="aligned",
    token_rows=unpadded,
    pointwise=pointwise,
    linear=linear,
    rms_norm=rms_norm,
    rms_norm_rope=rms_norm_rope,
    silu_mul=silu_mul,
    attention=attention,
    paged_attention=ta.paged_attention,
    token_logprobs=token_logprobs,
    log_softmax=log_softmax,
    rope=rope,
    moe_route=moe_route,
    moe_combine=aligned.moe_combine,
    moe_experts=expert_loop(linear, silu_mul),
    index_dtype=torch.int32,
    impl="triton",
)
"""The aligned bundle on CUDA (no row padding: the Triton GEMM's row bits never depend on M)."""
