"""Standard kernels: the plain fast PyTorch path frameworks use, kept as the measured baseline.

`F.linear` (MKL GEMM or GEMV by shape), `F.silu`, `torch.rsqrt`, scaled-dot-product attention and
`torch.log_softmax`. Each is fast and each is deterministic run to run, but their reduction
orders change with batch size, query count and memory position, which is the kernel mismatch
`parity` exists to remove. Signatures match `aligned.py` one for one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import (
    check_logprob_args,
    compute_dtype,
    eager_attention,
    gather_blocks,
    gemm_linear,
    rope,
    visible_keys,
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gemm_linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(compute_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_rope(x, weight, eps, cos, sin) -> torch.Tensor:
    return rope(rms_norm(x, weight, eps), cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, block_size: int,
              window: int = 0, softcap: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """SDPA over the valid keys, as a framework would call it; with soft-capped scores (which SDPA
    cannot do) transformers' eager attention. Shapes as in `aligned.attention`."""
    if softcap:
        return eager_attention(q, k, v, q_pos, window, softcap, scale)
    hq = q.shape[2]
    visible = visible_keys(k.shape[1], q_pos, window)  # [B,1,M,L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible,
        enable_gqa=hq != k.shape[2], scale=scale,
    )
    return out.transpose(1, 2)


def paged_attention(q, k_cache, v_cache, tables, q_pos, window: int = 0, softcap: float = 0.0,
                    scale: float | None = None) -> torch.Tensor:
    """Gather each sequence's cached keys/values, then SDPA, as a framework's cache path does:
    sequences are grouped by their number of new tokens (all decodes in one call, each prefill
    chunk length in its own), so no padded query rows are computed."""
    spec = dict(window=window, softcap=softcap, scale=scale)
    if q.shape[1] == 1:  # decode: every sequence has its one new token, known without a host sync
        return attention(q, *gather_blocks(k_cache, v_cache, tables), q_pos, k_cache.shape[-1], **spec)
    counts = (q_pos >= 0).sum(1)
    if bool((counts == q.shape[1]).all()):
        return attention(q, *gather_blocks(k_cache, v_cache, tables), q_pos, k_cache.shape[-1], **spec)
    out = q.new_zeros(q.shape)
    for n in counts.unique().tolist():
        if n == 0:
            continue
        rows = (counts == n).nonzero().flatten()
        need = -(-(int(q_pos[rows].max()) + 1) // k_cache.shape[-1])  # blocks these rows read
        k, v = gather_blocks(k_cache, v_cache, tables[rows][:, :need])
        out[rows, :n] = attention(q[rows, :n], k, v, q_pos[rows, :n], k_cache.shape[-1], **spec)
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    check_logprob_args(logits, tokens, temperature)
    lp = torch.log_softmax(logits.to(compute_dtype(logits.dtype)) / temperature, dim=-1)
    return lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    check_logprob_args(logits, None, temperature)
    return torch.log_softmax(logits.to(compute_dtype(logits.dtype)) / temperature, dim=-1)


def moe_route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing as frameworks write it: float32 softmax, `torch.topk`, optional renormalisation."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    return top, idx


def moe_combine(parts: torch.Tensor) -> torch.Tensor:
    return parts.sum(1)
