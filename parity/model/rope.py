"""Rotary position embedding tables: one float32 cos/sin row per absolute position.

Computed once per model (a position's rotation never depends on the batch), in float64 then
rounded to float32. `llama3` scaling (Llama 3.1+) divides the low frequencies by `factor`, keeps
the high ones and interpolates smoothly between the two wavelength bounds.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The per-pair rotation frequencies [head_dim / 2] (float64), scaled as the config says."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    context = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long_wavelen, short_wavelen = context / low, context / high  # beyond: scaled; below: kept
    scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(between, blended, scaled)


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_position_embeddings, head_dim] float32, rotate-half layout."""
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
    angles = positions[:, None] * inverse_frequencies(cfg)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()
