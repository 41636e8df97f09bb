"""Helpers both kernel backends share: exact element-wise math and cache layout, no reductions
whose order could differ (so sharing them cannot leak one backend's numerics into the other)."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from ..hardware import bf16_gemm_native


def gemm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, except bfloat16 on a CPU without a bf16 GEMM path: there the product runs in
    float32 and is rounded to bfloat16. Products of bf16 values are exact in float32 and a bf16
    GEMM accumulates in float32 too, so this is the same computation by another GEMM (both
    backends use it; the gradients flow through the casts, so the backward GEMMs are float32 too)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_gemm_native():
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """x [..., K], weight [N, K], bias [N] or None, as `F.linear` takes them, else a one-line
    ValueError (the native matrix-vector kernel reads through raw pointers: a weight of another
    width gave garbage, a bias too short read past it, an x too wide crashed the process)."""
    bias_fits = bias is None or bias.shape == weight.shape[:1]
    if weight.dim() != 2 or x.shape[-1:] != weight.shape[1:] or not bias_fits:
        with_bias = "" if bias is None else f" with bias {tuple(bias.shape)}"
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)}{with_bias} do not fit "
                         f"(weight is [out, in])")


def check_logprob_args(logits: torch.Tensor, tokens: torch.Tensor | None, temperature: float) -> None:
    """The arguments of a backend's `token_logprobs` / `log_softmax`: a positive finite temperature
    (0 was a ZeroDivisionError) and one target per row of logits [..., V] (logits [2, V] with one
    target broadcast it to both rows, silently), integer targets in the vocabulary. On an
    accelerator, shapes and a number only: no device sync (the range is checked on CPU only)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not 0 < temperature < float("inf"):
        raise ValueError(f"log-probs need a positive finite temperature, got {temperature!r}")
    if tokens is not None and (logits.dim() < 1 or tuple(tokens.shape) != tuple(logits.shape[:-1])):
        raise ValueError(f"log-probs need one target per row of logits: logits {tuple(logits.shape)}, "
                         f"targets {tuple(tokens.shape)}")
    if tokens is not None and (tokens.is_floating_point() or tokens.dtype == torch.bool):
        raise ValueError(f"log-prob targets must be integer token ids, got {tokens.dtype}")
    if tokens is not None and tokens.device.type == "cpu" and tokens.numel() \
            and not 0 <= int(tokens.min()) <= int(tokens.max()) < logits.shape[-1]:  # (torch's index error)
        raise ValueError(f"log-prob targets must be token ids in [0, {logits.shape[-1]}), got "
                         f"{int(tokens.min())}..{int(tokens.max())}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32/bfloat16/float16 inputs; float64 stays float64 (gradient checks)."""
    return torch.promote_types(dtype, torch.float32)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) in float32: x [T, H, D], cos/sin [T, D] float32."""
    xf = x.to(compute_dtype(x.dtype))
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


def gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys/values in order, [B, nblk * bs, Hkv, D], from the cache layout."""
    bsz, nblk = tables.shape
    _, hkv, d, bs = k_cache.shape
    k = k_cache[tables].permute(0, 1, 4, 2, 3).reshape(bsz, nblk * bs, hkv, d)
    v = v_cache[tables].permute(0, 1, 3, 2, 4).reshape(bsz, nblk * bs, hkv, d)
    return k, v


def visible_keys(length: int, q_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[B, 1, M, L] bool: which of keys 0..L-1 each query at q_pos [B, M] attends to — keys up to
    its own position, and with a sliding `window` (> 0) only the last `window` of them (key j with
    pos - window < j <= pos, as transformers masks). Padding rows (pos < 0) see key 0."""
    keys = torch.arange(length, device=q_pos.device).view(1, 1, length)
    pos = q_pos.clamp(min=0).unsqueeze(-1)
    seen = keys <= pos
    if window:
        seen = seen & (keys > pos - window)
    return seen.unsqueeze(1)


def score_scale(d: int, scale: float | None) -> float:
    """The factor attention scores q.k are multiplied by: `scale`, or 1/sqrt(d) when None."""
    return 1.0 / d ** 0.5 if scale is None else float(scale)


def eager_attention(q, k, v, q_pos, window: int = 0, softcap: float = 0.0, scale: float | None = None):
    """Causal GQA attention as transformers' eager path computes it, in q's dtype: scores q.k times
    `scale`, soft-capped (`softcap` > 0: cap * tanh(score / cap), Gemma 2) before the mask, a
    softmax in float32 rounded to q's dtype, then its product with the values. Shapes as
    `aligned.attention` (q [B, M, Hq, D], k/v [B, L, Hkv, D], q_pos [B, M])."""
    bsz, m, hq, d = q.shape
    length, rep = k.shape[1], hq // k.shape[2]
    kr, vr = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bmhd,blhd->bhml", q, kr) * score_scale(d, scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible_keys(length, q_pos, window), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=compute_dtype(q.dtype)).to(q.dtype)
    return torch.einsum("bhml,blhd->bmhd", probs, vr)
