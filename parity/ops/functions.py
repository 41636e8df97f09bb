"""Custom autograd functions for the learner: aligned forward, ordinary PyTorch math backward.

Only forward values must match the engine bit for bit; gradients just need to be correct. Each
function's forward calls the aligned kernel unchanged (so a learner forward under autograd gives
the same bits as an inference forward) and saves only its inputs; backward is plain math.
"""

from __future__ import annotations

import math

import torch

from . import aligned, standard
from .common import compute_dtype


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return aligned.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        acc = compute_dtype(x.dtype)
        xf = x.to(acc)
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        normed = xf * inv
        g = grad.to(acc)
        grad_w = (g * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gn = g * weight.to(acc)
        grad_x = inv * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return aligned.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        acc = compute_dtype(gate.dtype)
        gf, uf, g = gate.to(acc), up.to(acc), grad.to(acc)
        sig = torch.sigmoid(gf)
        silu = gf * sig
        grad_gate = g * uf * (sig + silu * (1 - sig))
        grad_up = g * silu
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


class AttentionFn(torch.autograd.Function):
    """Backward recomputes attention with PyTorch's fused scaled-dot-product attention under
    autograd (saves only q, k, v): gradients need to be right, not bitwise-aligned."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, block_size: int):
        ctx.save_for_backward(q, k, v, q_pos)
        return aligned.attention(q, k, v, q_pos, block_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, q_pos = ctx.saved_tensors
        with torch.enable_grad():
            acc = compute_dtype(q.dtype)
            qf = q.detach().to(acc).requires_grad_()
            kf = k.detach().to(acc).requires_grad_()
            vf = v.detach().to(acc).requires_grad_()
            out = standard.attention(qf, kf, vf, q_pos, 0)
            gq, gk, gv = torch.autograd.grad(out, (qf, kf, vf), grad.to(acc))
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None


def reference_attention(q, k, v, q_pos):
    """Textbook causal GQA attention (float math, autograd-friendly). Shapes as `aligned.attention`."""
    bsz, m, hq, d = q.shape
    length, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    kr = k.repeat_interleave(rep, dim=2)
    vr = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bmhd,blhd->bhml", q, kr) / math.sqrt(d)
    keys = torch.arange(length, device=q.device)
    visible = (keys.view(1, 1, length) <= q_pos.clamp(min=0).unsqueeze(-1)).unsqueeze(1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhml,blhd->bmhd", probs, vr)
