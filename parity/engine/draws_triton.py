"""Gumbel-max sampling with counter-based noise in one Triton pass: the GPU sampler's hot loop.

`draws.py` defines the noise: uniform j of a request's draw number c is SplitMix64 of
(request key, c * V + j), turned into Gumbel noise -log(-log(u)) in float64 and added to the
row's float32 log-probs; the token is the first index of the row's maximum. Written as PyTorch
ops that is some twenty-five full passes over a [rows, V] int64/float64 tensor a step (at
Qwen3's 151,936-token vocabulary and batch 256, ~17 GB of memory traffic, milliseconds of GPU
time, more than the model's decode step). Here each program hashes, transforms and reduces one
chunk of one row in registers and writes its chunk's best (value, first index); the chunks are
combined in vocabulary order on the host side of the launch (`argmax` over a [rows, chunks]
tensor returns the first chunk holding the maximum, whose index is that chunk's first), so the
token is the PyTorch path's: the same integer hash, the same float64 operations (a float32 to
float64 widening, one addition, two logs) and the same first-maximum rule. The two logs are the
device's math library's (libdevice here, numpy's in the interpreter, PyTorch's own there), which
may round a value an ulp apart, so a token could differ only at a near-tie of ~1e-16. Rows never interact,
so a row's token depends on its request, draw and log-probs alone.
"""

from __future__ import annotations

import torch

from ..ops.triton_kernels import INTERPRET, LAUNCH, _cdiv, _on, tl, triton
from . import draws as counter

CHUNK_V = 1024 if INTERPRET else 8192
"""Vocabulary entries per program (a fixed split: exactness does not depend on it)."""

_BLOCK = 1024
"""Entries hashed at a time inside a program."""


@triton.jit
def _mix(z, m1, m2):
    """SplitMix64's finaliser on uint64 values (logical shifts, products modulo 2^64)."""
    z = (z ^ (z >> 30)) * m1
    z = (z ^ (z >> 27)) * m2
    return z ^ (z >> 31)


@triton.jit(do_not_specialize=["R"])
def _gumbel_argmax_kernel(lp_ptr, key_ptr, cnt_ptr, val_ptr, idx_ptr, R, V, s_lp, n_chunks,
                          golden, m1, m2, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    gold = golden.to(tl.uint64, bitcast=True)
    k1 = m1.to(tl.uint64, bitcast=True)
    k2 = m2.to(tl.uint64, bitcast=True)
    base = _mix(tl.load(key_ptr + row).to(tl.uint64, bitcast=True), k1, k2)
    first = tl.load(cnt_ptr + row).to(tl.uint64, bitcast=True) * V.to(tl.uint64) + 1
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float64)  # per lane: its best so far
    best_idx = chunk * CHUNK + lanes.to(tl.int64)  # and the first index that reached it
    for c0 in range(0, CHUNK, BLOCK):
        j = (chunk * CHUNK + c0 + lanes).to(tl.int64)
        live = j < V
        lp = tl.load(lp_ptr + row * s_lp + j, mask=live, other=float("-inf")).to(tl.float64)
        z = _mix(base + (first + j.to(tl.uint64)) * gold, k1, k2)
        u = ((z >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53
        val = tl.where(live, lp + -tl.log(-tl.log(u)), float("-inf"))
        better = val > best  # strictly: a lane keeps the earlier index of a tie
        best = tl.where(better, val, best)
        best_idx = tl.where(better, j, best_idx)
    top = tl.max(best, axis=0)
    first_idx = tl.min(tl.where(best == top, best_idx, V), axis=0)  # the first index of the maximum
    tl.store(val_ptr + row * n_chunks + chunk, top)
    tl.store(idx_ptr + row * n_chunks + chunk, first_idx)


def gumbel_argmax(logp: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """argmax(logp + Gumbel(uniforms(keys, counts, V))) per row, the token `draws.uniforms` and
    PyTorch's first-maximum argmax give. logp [n, V] float32 rows (last dim contiguous), keys and
    counts int64 [n] on logp's device -> int64 [n]."""
    n, vocab = logp.shape
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logp.device)
    if logp.stride(-1) != 1 or logp.data_ptr() % 16:
        logp = logp.contiguous()
    keys, counts = keys.to(torch.long).contiguous(), counts.to(torch.long).contiguous()
    chunks = _cdiv(vocab, CHUNK_V)
    vals = torch.empty(n, chunks, dtype=torch.float64, device=logp.device)
    idx = torch.empty(n, chunks, dtype=torch.long, device=logp.device)
    with _on(logp):
        _gumbel_argmax_kernel[(n, chunks)](
            logp, keys, counts, vals, idx, n, vocab, logp.stride(0), chunks,
            counter.GOLDEN, counter._M1, counter._M2, CHUNK=CHUNK_V, BLOCK=min(_BLOCK, CHUNK_V), **LAUNCH)
    return idx.gather(1, vals.argmax(1, keepdim=True)).squeeze(1)
