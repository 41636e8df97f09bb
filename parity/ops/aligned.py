"""Aligned kernels: every output element's reduction order is fixed, whatever the batch.

This module is the whole invariance idea in one place. It is built on plain PyTorch CPU ops,
using only the properties that `parity check` and `tests/parity/` verify on the running machine:

- GEMM rows: for M >= 12 rows, a row of `x @ W` does not depend on the other rows, on M, on the
  row's offset or on the thread count. Below that, MKL takes a GEMV path (M < 4) or computes the
  last M mod 4 rows of a small GEMM (M = 5..11) with another order; M = 4 and 8 take the large
  GEMM's path. `gemm.linear` pads small GEMMs to 4-row multiples, or computes a float32 product
  of up to 8 rows with a C kernel in the large GEMM's own order; probes of the machine confirm
  both at first use (`gemm.py`). Where a probe finds the large GEMM's rows depending on M or the
  thread count (an Intel Xeon with AMX), GEMMs run strict (`gemm_strict.py`): one thread, fixed
  row counts, float32 in K blocks whose order the C kernel follows for decode-sized products.
- GEMM reduction length: the K-blocking of a GEMM depends on K, so a reduction over a *varying*
  length (attention over a growing context) is cut into fixed key blocks of `block_size`, each
  reduced by a GEMM of fixed K, and the blocks are combined by a fixed pairwise tree whose
  padded leaves are exact zeros (so appending empty blocks never changes a value).
- Element-wise transcendental ops (exp, silu, sigmoid, rsqrt, log) take a vectorised body and a
  scalar tail whose results differ in the last bit. `pointwise` pads the flat tensor so that no
  element ever lands in a tail (also not at the boundary between threads' chunks).
- Row sums: a contiguous row reduction depends only on the row length, except when the result has
  a single element and the input is large (ATen then splits the row across threads); `row_sum`
  cuts long rows into fixed 1024-element blocks so that never happens.
- Exact IEEE ops (+, -, *, /, sqrt, max, comparisons) are position-independent and used freely.

Forward values are what matter for parity; every function here is differentiable with autograd
(padding, slicing and the ops above), and `functions.py` wraps the hot ones in custom autograd
functions with hand-written backward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import native
from .common import check_logprob_args, compute_dtype, gather_blocks, rope, score_scale
from .gemm import MIN_GEMM_ROWS

ROW_BLOCK = 1024
"""Rows longer than this are summed in fixed blocks of this many elements, then over blocks."""

_LOG2E = 1.4426950408889634

_VEC_ALIGN = 64
"""Twice the widest vector (32 bf16 lanes of AVX-512): a body/tail boundary is a multiple of it."""


_GRAIN = 32768
"""ATen's parallel grain: a flat element-wise op over n elements is cut into k = min(threads,
ceil(n / grain)) chunks of ceil(n / k) elements, each with its own vector body and tail."""


def _padded_length(n: int) -> int:
    """Smallest length >= n whose every thread chunk is a whole number of vector pairs."""
    threads = torch.get_num_threads()
    length = -(-n // _VEC_ALIGN) * _VEC_ALIGN
    while True:
        k = max(1, min(threads, -(-length // _GRAIN)))
        padded = -(-length // (_VEC_ALIGN * k)) * _VEC_ALIGN * k
        if padded == length:
            return length
        length = padded


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply an element-wise `fn` so that every element takes the vectorised path."""
    x = x.contiguous()
    n = x.numel()
    pad = _padded_length(n) - n
    if pad == 0:
        return fn(x)
    flat = torch.cat([x.reshape(-1), x.new_zeros(pad)])
    return fn(flat)[:n].view(x.shape)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension with an order fixed by the row length alone. [..., L] -> [...]"""
    x = x.contiguous()
    length = x.shape[-1]
    if length <= ROW_BLOCK:  # one row is under the parallel grain (32768): never split
        return x.sum(-1)
    pad = (-length) % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
    blocks = x.view(*x.shape[:-1], -1, ROW_BLOCK)  # >= 2 blocks, so >= 2 partial results
    return blocks.sum(-1).sum(-1)


def _use_native(*tensors: torch.Tensor) -> bool:
    return native.library() is not None and native.supports(*tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: statistics in float32, result cast back to the input dtype, then scaled."""
    if _use_native(x, weight) and weight.dtype == x.dtype:
        return native.rms_norm(x, weight, eps)
    xf = x.to(compute_dtype(x.dtype))
    mean_sq = row_sum(xf * xf) / xf.shape[-1]
    inv = 1.0 / torch.sqrt(mean_sq + eps)  # sqrt and division are correctly rounded everywhere
    return weight * (xf * inv.unsqueeze(-1)).to(x.dtype)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """q/k head norm then RoPE; one fused native pass when available (same bits as the two)."""
    if _use_native(x, weight) and weight.dtype == x.dtype and x.shape[-1] <= 512:
        return native.rms_norm(x, weight, eps, rope=(cos, sin))
    return rope(rms_norm(x, weight, eps), cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation `silu(gate) * up` of a fused [T, 2I] gate/up tensor (gate first),
    computed in float32, returned in the input dtype. [T, 2I] -> [T, I]"""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    if _use_native(gate_up) and gate_up.dim() == 2:
        return native.silu_mul(gate, up)
    acc = compute_dtype(gate.dtype)
    return (pointwise(F.silu, gate.to(acc)) * up.to(acc)).to(gate.dtype)


def _tree_sum(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """Pairwise sum over `dim`, padded with exact zeros to a power of two leaves."""
    n = parts.shape[dim]
    leaves = 1 << max(0, (n - 1).bit_length())
    if leaves != n:
        shape = list(parts.shape)
        shape[dim] = leaves - n
        parts = torch.cat([parts, parts.new_zeros(shape)], dim=dim)
    while parts.shape[dim] > 1:
        half = parts.shape[dim] // 2
        parts = parts.narrow(dim, 0, half) + parts.narrow(dim, half, half)
    return parts.squeeze(dim)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, block_size: int,
              window: int = 0, softcap: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention (shapes as `attention_torch`); the native kernel when available."""
    if _use_native(q) and q.shape[-1] % 16 == 0 and block_size % 16 == 0:
        return native.attention(q, k, v, q_pos, block_size, window=window, softcap=softcap,
                                scale=scale).to(q.dtype)
    return attention_torch(q, k, v, q_pos, block_size, window, softcap, scale)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                       block_size: int, window: int = 0, softcap: float = 0.0,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attention` (in float32 where the native kernel runs) and, from the native kernel, each
    row's log-sum-exp [B, M, Hq] for the learner's backward; None elsewhere. Same output bits."""
    if _use_native(q) and q.shape[-1] % 16 == 0 and block_size % 16 == 0:
        return native.attention(q, k, v, q_pos, block_size, with_lse=True, window=window, softcap=softcap,
                                scale=scale)
    return attention_torch(q, k, v, q_pos, block_size, window, softcap, scale), None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    q_pos: torch.Tensor, window: int = 0, softcap: float = 0.0,
                    scale: float | None = None) -> torch.Tensor:
    """Attention reading keys through block tables: key blocks [NB, Hkv, D, bs], value blocks
    [NB, Hkv, bs, D], tables [B, nblk]. Same bits as `attention` on the gathered keys."""
    if _use_native(q, k_cache) and q.shape[-1] % 16 == 0 and k_cache.shape[-1] % 16 == 0:
        return native.paged_attention(q, k_cache, v_cache, tables, q_pos, window=window, softcap=softcap,
                                      scale=scale).to(q.dtype)
    return attention_torch(q, *gather_blocks(k_cache, v_cache, tables), q_pos, k_cache.shape[-1], window,
                           softcap, scale)


def attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, block_size: int,
                    window: int = 0, softcap: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention with a fixed key-block reduction order (pure PyTorch).

    q: [B, M, Hq, D]; k, v: [B, L, Hkv, D] (keys at absolute positions 0..L-1, L a multiple of
    `block_size`); q_pos: [B, M] absolute position of each query (key j is visible iff j <= pos;
    a negative position marks a padding row, whose output is unspecified); with a sliding
    `window` > 0 only keys j > pos - window are visible too (every block before a query's window
    is then fully masked: a zero leaf of the tree, like the blocks after its position). Scores
    are q.k times `scale` (None: 1/sqrt(D)), soft-capped when `softcap` > 0 (cap * tanh(s / cap),
    element-wise through `pointwise`).
    Returns [B, M, Hq, D] in q's dtype. Computed in float32 (float64 for float64 inputs).

    Scores are produced per key block by GEMMs of one fixed shape (rows >= MIN_GEMM_ROWS, K = D,
    N = block), in base 2 (`exp2` is exact-lane vectorised and 4x faster than `exp` on CPU).
    The row max is exact; each block's probabilities are reduced against its values by a GEMM
    with K = block; the blocks are combined by `_tree_sum`, where fully masked blocks are zeros.
    """
    bsz, m, hq, d = q.shape
    length, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    assert length % block_size == 0, "key length must be a multiple of the block size"
    q_pos = q_pos.clamp(min=0)  # padding rows attend to key 0 (kept finite, then dropped)
    nblk = length // block_size
    acc = compute_dtype(q.dtype)
    rows = rep * m
    padded = max(rows, MIN_GEMM_ROWS)
    # query rows of one KV head: [B, Hkv, R, D], in log2 units (scale folded in; soft-capped
    # scores are capped in natural units first, then turned into log2 units)
    fold = _LOG2E / math.sqrt(d) if scale is None else _LOG2E * scale
    qf = (q.to(acc) * (score_scale(d, scale) if softcap else fold)).view(bsz, m, hkv, rep, d)
    qf = qf.permute(0, 2, 3, 1, 4).reshape(bsz, hkv, rows, d)
    if padded > rows:
        qf = torch.cat([qf, qf.new_zeros(bsz, hkv, padded - rows, d)], dim=2)
    kb = k.to(acc).view(bsz, nblk, block_size, hkv, d).permute(0, 3, 1, 4, 2).contiguous()  # [B,Hkv,n,D,bs]
    scores = torch.matmul(qf.unsqueeze(2), kb)  # [B, Hkv, nblk, R', bs]
    if padded > rows:
        scores = scores[:, :, :, :rows]
    if softcap:
        scores = pointwise(torch.tanh, scores / softcap) * (softcap * _LOG2E)
    scores = scores.reshape(bsz, hkv, nblk, rep, m, block_size)
    keys = torch.arange(length, device=q.device).view(1, nblk, 1, block_size)
    hidden = keys > q_pos.view(bsz, 1, m, 1)
    if window:
        hidden = hidden | (keys <= q_pos.view(bsz, 1, m, 1) - window)
    hidden = hidden.view(bsz, 1, nblk, 1, m, block_size)
    scores = scores.masked_fill(hidden, float("-inf"))
    peak = scores.amax(dim=(2, 5), keepdim=True)  # exact, order-free
    probs = pointwise(torch.exp2, scores - peak).view(bsz, hkv, nblk, rows, block_size)
    if padded > rows:
        probs = torch.cat([probs, probs.new_zeros(bsz, hkv, nblk, padded - rows, block_size)], 3)
    vb = v.to(acc).view(bsz, nblk, block_size, hkv, d).permute(0, 3, 1, 2, 4).contiguous()  # [B,Hkv,n,bs,D]
    partial = torch.matmul(probs, vb)  # [B, Hkv, nblk, R', D]
    denom = probs.sum(-1, keepdim=True)  # fixed length `block_size` per row
    if padded > rows:
        partial, denom = partial[:, :, :, :rows], denom[:, :, :, :rows]
    out = _tree_sum(partial, dim=2) / _tree_sum(denom, dim=2)  # [B, Hkv, R, D]
    out = out.view(bsz, hkv, rep, m, d).permute(0, 3, 1, 2, 4).reshape(bsz, m, hq, d)
    return out.to(q.dtype)


def _scaled(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits * (1/T) in the compute dtype, and 1/T as a tensor of that dtype."""
    z = logits.to(compute_dtype(logits.dtype))
    inv_t = torch.tensor(1.0 / temperature, dtype=z.dtype)
    return z * inv_t, inv_t


class _NativeRowLSE(torch.autograd.Function):
    """logsumexp(logits * inv_t) per row by the native fixed-order kernel, differentiable:
    the gradient is softmax(logits * inv_t) * inv_t (plain math; only the forward needs the
    aligned bits)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, inv_t: float) -> torch.Tensor:
        lse = native.row_lse(logits, inv_t)
        ctx.save_for_backward(logits, lse)
        ctx.inv_t = inv_t
        return lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse = ctx.saved_tensors
        probs = torch.exp(logits.float() * ctx.inv_t - lse.unsqueeze(-1))
        return (grad.unsqueeze(-1) * probs * ctx.inv_t).to(logits.dtype), None


class _NativeTokenLogprobs(torch.autograd.Function):
    """`token_logprobs` on the native path: forward as `_scaled` and `_NativeRowLSE` compute it
    (same bits); backward in one pass over the logits (`native.token_logprobs_backward`), where
    autograd would take several (exp, products, and a zero-filled scatter for the picked logit)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, inv_t: float) -> torch.Tensor:
        lse = native.row_lse(logits, inv_t)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.inv_t = inv_t
        picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
        return picked * torch.tensor(inv_t, dtype=torch.float32) - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, tokens, lse = ctx.saved_tensors
        return native.token_logprobs_backward(logits, tokens, lse, grad, ctx.inv_t), None, None


def _inv_temperature(temperature: float) -> float:
    """1/T rounded to float32 once, as `_scaled` rounds it (the native kernels take this value)."""
    return float(torch.tensor(1.0 / temperature, dtype=torch.float32))


def _row_lse(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logsumexp(logits / T) per row, in the compute dtype (differentiable). [N, V] -> [N]"""
    if _use_native(logits):
        return _NativeRowLSE.apply(logits, _inv_temperature(temperature))
    z, _ = _scaled(logits, temperature)
    peak = z.amax(-1, keepdim=True)
    total = row_sum(pointwise(torch.exp, z - peak))
    return peak.squeeze(-1) + pointwise(torch.log, total)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log_softmax(logits / T)[token]` in float32. logits [N, V], tokens [N] -> [N]

    The sampled logit is picked before it is scaled (an exact per-element product, so the same
    bits as scaling the whole row first) and the row is never copied to float32."""
    check_logprob_args(logits, tokens, temperature)
    if _use_native(logits) and logits.dim() == 2:
        return _NativeTokenLogprobs.apply(logits, tokens, _inv_temperature(temperature))
    picked, _ = _scaled(logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), temperature)
    return picked - _row_lse(logits, temperature)


def log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Full `log_softmax(logits / T)` rows in float32, same bits as `token_logprobs`. [N, V]"""
    check_logprob_args(logits, None, temperature)
    z, _ = _scaled(logits, temperature)
    return z - _row_lse(logits, temperature).unsqueeze(-1)


def moe_route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-experts routing: softmax over experts in float32, the k largest (ties to the
    lower expert index: a stable sort), optionally renormalised; weights in float32 (float64 for
    float64 logits). logits [T, E] -> (weights [T, k], expert ids [T, k]). Every step is per row."""
    probs = pointwise(torch.exp, log_softmax(logits, 1.0))
    top, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, idx = top[:, :k], idx[:, :k]
    if normalize:
        top = top / row_sum(top).unsqueeze(-1)
    return top, idx


def moe_combine(parts: torch.Tensor) -> torch.Tensor:
    """Sum each token's k weighted expert outputs in rank order. [T, k, H] -> [T, H]"""
    out = parts[:, 0]
    for j in range(1, parts.shape[1]):
        out = out + parts[:, j]
    return out
