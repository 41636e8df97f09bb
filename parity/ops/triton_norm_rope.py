"""The q/k head norm and RoPE in one Triton kernel (Qwen3's `q_norm`/`k_norm`, then rotate-half).

A row is one head vector of one token, read in place from the fused q/k/v projection's output.
Its sum of squares is reduced exactly as `triton_kernels.rms_norm` reduces a row (same block,
same rows per program), so the fused kernel's norm is that kernel's; RoPE follows in float32
from the token's cos/sin. One launch instead of a norm kernel plus RoPE's half-dozen PyTorch
ops and the copy of the strided head rows. Rows are independent: a row's bits never depend on
how many tokens or heads share the launch.
"""

from __future__ import annotations

import torch

from .triton_kernels import _ROWS, LAUNCH, _cdiv, _on, _pow2, tl, triton


@triton.jit(do_not_specialize=["R"])
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, R, HEADS, D, stt, sth, sct, eps,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr):
    """Rows of [T, HEADS, D] head vectors (row r: token r // HEADS, head r % HEADS): the RMSNorm
    of `_rms_norm_kernel` (the same row sum, laid out the same), then rotate-half RoPE in float32
    from the token's cos/sin, in one pass."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live = rows < R
    tok = rows // HEADS
    base = tok * stt + (rows % HEADS) * sth
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=live[:, None] & (cols[None, :] < D),
                other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    half = tl.arange(0, HALF)
    hmask = live[:, None] & (half[None, :] < D // 2)
    lo = tl.load(x_ptr + base[:, None] + half[None, :], mask=hmask, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + base[:, None] + D // 2 + half[None, :], mask=hmask, other=0.0).to(tl.float32)
    w_lo = tl.load(w_ptr + half, mask=half < D // 2, other=0.0).to(tl.float32)
    w_hi = tl.load(w_ptr + D // 2 + half, mask=half < D // 2, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    y_lo = (w_lo[None, :] * (lo * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y_hi = (w_hi[None, :] * (hi * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    c = cos_ptr + tok[:, None] * sct + half[None, :]
    s = sin_ptr + tok[:, None] * sct + half[None, :]
    cos_lo = tl.load(c, mask=hmask, other=0.0)
    cos_hi = tl.load(c + D // 2, mask=hmask, other=0.0)
    sin_lo = tl.load(s, mask=hmask, other=0.0)
    sin_hi = tl.load(s + D // 2, mask=hmask, other=0.0)
    o = out_ptr + rows[:, None] * D + half[None, :]
    tl.store(o, (y_lo * cos_lo - y_hi * sin_lo).to(dt), mask=hmask)
    tl.store(o + D // 2, (y_hi * cos_hi + y_lo * sin_hi).to(dt), mask=hmask)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm of each head vector, then rotate-half RoPE, in one kernel: x [T, H, D] (heads may
    be strided views of a fused projection, the last dimension contiguous), cos/sin [T, D]
    float32; result [T, H, D] contiguous in x's dtype."""
    t, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    rows = t * heads
    if rows:
        with _on(x, weight):
            _rms_norm_rope_kernel[(_cdiv(rows, _ROWS),)](
                x, weight, cos, sin, out, rows, heads, d, x.stride(0), x.stride(1), cos.stride(0), eps,
                ROWS=_ROWS, BLOCK=_pow2(d), HALF=_pow2(d // 2), **LAUNCH)
    return out
