"""Counter-based uniforms for sampling: the same bits on every device, from integer arithmetic.

A GPU engine cannot take its sampling noise from per-request CPU generators: Gumbel-max needs one
float64 uniform per vocabulary entry, so at Qwen3's 151,936-token vocabulary a batch of 64 costs
78 MB of uniforms a step made on the host, and the host's sampling step took 247 ms here (AMD
EPYC, AVX-512) against a millisecond or two of GPU work for the model's step. Here uniform j of a
request's draw number c is a hash of (request key, c * V + j): SplitMix64 — the stream
`mix(base + i * golden)` with the request's `base = mix(key)` — written in int64 tensor ops
(multiplication wraps modulo 2^64 on every device, shifts made logical by masking). The noise is
made where the logits are, for all rows in one pass, and depends on the request and its draw
index alone: not on the batch, the device or the other requests.
"""

from __future__ import annotations

import torch


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
CHUNK = 1 << 24
"""Elements hashed at a time (a few int64 temporaries of this size; the sampler chunks by it too)."""


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's `>>` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (bit for bit the unsigned 64-bit one)."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def mix_int(z: int) -> int:
    """`mix` on one Python int, unsigned (no tensor: the sampler's per-request seeds, every step)."""
    mask = (1 << 64) - 1
    z &= mask
    z = ((z ^ (z >> 30)) * (_M1 & mask)) & mask
    z = ((z ^ (z >> 27)) * (_M2 & mask)) & mask
    return z ^ (z >> 31)


def request_key(seed: int) -> int:
    """A request's key (int64) from its seed, any Python int."""
    return _signed(seed % (1 << 64))


def uniforms(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] float64 uniforms in (0, 1): row r is draw number `counters[r]` of the request
    keyed `keys[r]` (both int64 [n], on the device the result is wanted on). Each value is
    (top 53 bits + 0.5) / 2^53, so never 0 or 1 (Gumbel noise stays finite)."""
    keys = keys.to(torch.long)
    base = mix(keys)  # [n]
    rows = max(1, CHUNK // max(1, vocab))
    cols = torch.arange(vocab, dtype=torch.long, device=keys.device)
    parts = []
    for r0 in range(0, keys.numel(), rows):
        idx = counters[r0:r0 + rows].to(torch.long).view(-1, 1) * vocab + cols.view(1, -1) + 1
        z = mix(base[r0:r0 + rows].view(-1, 1) + idx * GOLDEN)
        parts.append((_shr(z, 11).to(torch.float64) + 0.5) * 2.0 ** -53)
    if not parts:
        return torch.empty(0, vocab, dtype=torch.float64, device=keys.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]
