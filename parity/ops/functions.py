"""Custom autograd functions for the learner: aligned forward, ordinary math backward.

Only forward values must match the engine bit for bit; gradients just need to be correct. Each
function's forward calls the aligned kernel unchanged (so a learner forward under autograd gives
the same bits as an inference forward). Backward is plain math: one-pass C kernels for RMSNorm
and SwiGLU on CPU float32/bfloat16 (`native.py`), PyTorch's fused attention backward fed with the
aligned forward's output and log-sum-exp, and PyTorch ops elsewhere (float64, CUDA, no compiler).
"""

from __future__ import annotations

import torch

from . import aligned, native, standard
from .common import compute_dtype, eager_attention, score_scale, visible_keys


def _native_backward(*tensors: torch.Tensor) -> bool:
    """Whether the one-pass C backward kernels serve these tensors (CPU, float32 or bfloat16). The
    tensors are looked at first: on a GPU the C library is never built (a 3 s compiler run)."""
    return native.supports(*tensors) and native.library() is not None


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return aligned.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return (*rms_norm_backward(x, weight, grad, ctx.eps), None)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of `weight * x / rms(x)` over the last dimension."""
    if _native_backward(x, weight, grad) and weight.dtype == x.dtype:
        grad_x, grad_w = native.rms_norm_backward(x, weight, grad, eps)
        return grad_x, grad_w.to(weight.dtype)
    acc = compute_dtype(x.dtype)
    xf = x.to(acc)
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = xf * inv
    g = grad.to(acc)
    grad_w = (g * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    gn = g * weight.to(acc)
    grad_x = inv * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_w


class SiluMulFn(torch.autograd.Function):
    """SwiGLU on a fused gate/up tensor [T, 2I] -> [T, I]: its gradient is one [T, 2I] tensor
    written once (slicing gate and up first would make autograd zero-fill and add two)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return aligned.silu_mul(gate_up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return swiglu_backward(gate_up, grad)


def swiglu_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of `silu(gate) * up` w.r.t. the fused [T, 2I] input, for the output gradient [T, I]."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    if _native_backward(gate_up, grad) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return native.swiglu_backward(gate, up, grad)
    acc = compute_dtype(gate_up.dtype)
    gf, uf, g = gate.to(acc), up.to(acc), grad.to(acc)
    sig = torch.sigmoid(gf)
    silu = gf * sig
    grad_gate = g * uf * (sig + silu * (1 - sig))
    return torch.cat([grad_gate, g * silu], dim=-1).to(gate_up.dtype)


class AttentionFn(torch.autograd.Function):
    """Backward is PyTorch's fused attention backward (gradients need to be right, not aligned).
    Where the native kernel ran the forward it also gave each row's log-sum-exp, so the backward
    starts from the aligned output and log-sum-exp (no second forward); elsewhere it recomputes
    attention with PyTorch's scaled-dot-product attention under autograd: on a GPU in the
    inputs' own dtype (`recompute_dtype`), so the recompute is the standard learner's own
    tensor-core SDPA forward and backward, not a float32 pass without tensor cores. Soft-capped
    scores (which neither fused backward takes) recompute transformers' eager attention."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, block_size: int, window: int = 0, softcap: float = 0.0,
                scale: float | None = None):
        out, lse = aligned.attention_with_lse(q, k, v, q_pos, block_size, window, softcap, scale)
        ctx.spec = dict(window=window, softcap=softcap, scale=scale)
        if lse is None or softcap:
            ctx.save_for_backward(q, k, v, q_pos)
        else:
            ctx.save_for_backward(q, k, v, q_pos, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors  # read once (a recomputed forward's tensors unpack only once)
        if len(saved) == 6:
            return (*_flash_backward(grad, *saved, window=ctx.spec["window"], scale=ctx.spec["scale"]),
                    *[None] * 5)
        q, k, v, q_pos = saved
        acc = recompute_dtype(q)
        # soft-capped attention recomputes eagerly, [B, Hq, rows, L] scores at a time: in query
        # chunks, so long sequences do not hold a [B, Hq, M, L] tensor (SDPA needs no chunks)
        bsz, m, hq, _ = q.shape
        rows = m if not ctx.spec["softcap"] else max(1, EAGER_SCORES // max(1, bsz * hq * k.shape[1]))
        with torch.enable_grad():
            kf = k.detach().to(acc).requires_grad_()
            vf = v.detach().to(acc).requires_grad_()
            gq, gk, gv = [], 0, 0
            for m0 in range(0, m, rows):
                qf = q[:, m0:m0 + rows].detach().to(acc).requires_grad_()
                out = standard.attention(qf, kf, vf, q_pos[:, m0:m0 + rows], 0, **ctx.spec)
                dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), grad[:, m0:m0 + rows].to(acc))
                gq.append(dq)
                gk, gv = gk + dk, gv + dv
        return torch.cat(gq, 1).to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), *[None] * 5


EAGER_SCORES = 1 << 24
"""The most attention scores (16M: 64 MiB in float32) one query chunk of the soft-capped
attention's eager backward computes at once."""


def recompute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype attention's backward recomputes in: q's own on CUDA (bf16/fp16 SDPA runs the
    tensor-core kernels the standard learner's backward runs; float32 there would run several
    times slower), float32 on CPU (its fused bf16 attention is no faster) and float64 stays."""
    return q.dtype if q.is_cuda else compute_dtype(q.dtype)


def _flash_backward(grad, q, k, v, q_pos, out, lse, window: int = 0, scale: float | None = None):
    """PyTorch's CPU flash-attention backward from a forward's output and log-sum-exp.
    q/grad/out [B, M, Hq, D], k/v [B, L, Hkv, D], lse [B, M, Hq] float32 (+inf on padding rows,
    whose probabilities are then exactly 0)."""
    acc = compute_dtype(q.dtype)
    d = q.shape[-1]
    visible = visible_keys(k.shape[1], q_pos, window)  # [B,1,M,L]
    mask = torch.zeros(visible.shape, dtype=acc).masked_fill_(~visible, float("-inf"))
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.to(acc).transpose(1, 2), q.to(acc).transpose(1, 2), k.to(acc).transpose(1, 2),
        v.to(acc).transpose(1, 2), out.to(acc).transpose(1, 2), lse.transpose(1, 2).contiguous(),
        0.0, False, attn_mask=mask, scale=score_scale(d, scale))
    return gq.transpose(1, 2).to(q.dtype), gk.transpose(1, 2).to(k.dtype), gv.transpose(1, 2).to(v.dtype)


def reference_attention(q, k, v, q_pos, window: int = 0, softcap: float = 0.0, scale: float | None = None):
    """Textbook causal GQA attention (float math, autograd-friendly). Shapes as `aligned.attention`."""
    return eager_attention(q, k, v, q_pos, window, softcap, scale)
