"""Rotary position embeddings: the scalings parity honours, and the cos/sin tables they give.

Every RoPE variant here is a fixed table, one float32 cos/sin row per absolute position, computed
once per model in float64 then rounded: a position's rotation never depends on the batch, so
rollout and learner read the same rows. Scalings (`ModelConfig.rope_scaling`, HF names):

- `linear`: every frequency divided by `factor` (position interpolation).
- `llama3` (Llama 3.1+): low frequencies divided by `factor`, high ones kept, a smooth blend
  between the wavelength bounds `original_max_position_embeddings / {low,high}_freq_factor`.
- `yarn` (Qwen2.5/Qwen3 long context): per-pair blend of interpolated (/ `factor`) and original
  frequencies, ramping over the dimensions that turn between `beta_slow` and `beta_fast` times in
  `original_max_position_embeddings`; cos and sin are both multiplied by `attention_factor`
  (default `0.1 ln(factor) + 1`, or the ratio of the two `mscale`s), which scales attention logits
  by its square.

`dynamic` NTK and `longrope` are refused: both switch frequencies by the longest sequence in the
forward, so a token's log-prob would depend on what it is batched with — the very mismatch parity
removes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError

_REQUIRED: dict[str, tuple[str, ...]] = {  # per type; other keys are read as transformers reads them
    "linear": ("factor",),
    "llama3": ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_BATCH_DEPENDENT = ("dynamic", "longrope")


def _positive(rs: dict[str, Any], key: str) -> float:
    value = rs.get(key)  # (NaN and inf passed `<= 0` and gave NaN log-probs)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ConfigError(f"ModelConfig.rope_scaling.{key} must be a positive finite number, got {value!r}")
    return value


def check_rope_scaling(rs: dict[str, Any] | None, max_position_embeddings: int) -> dict[str, Any] | None:
    """`rs` validated and normalised (`rope_type` spelled out; YaRN's context filled in as
    transformers fills it), or a one-line ConfigError naming the field."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"ModelConfig.rope_scaling must be a dict or None, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in _BATCH_DEPENDENT:
        raise ConfigError(f"ModelConfig.rope_scaling of type {kind!r} is not supported: it rescales RoPE by "
                          "the longest sequence in each forward, so log-probs would depend on the batch")
    if kind not in _REQUIRED:
        raise ConfigError(f"ModelConfig.rope_scaling of type {kind!r} is not supported "
                          f"(parity honours {', '.join(repr(k) for k in _REQUIRED)})")
    if rs.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ConfigError(f"ModelConfig.rope_scaling.partial_rotary_factor {rs['partial_rotary_factor']!r} "
                          "is not supported (parity rotates every head dimension)")
    out = {k: v for k, v in rs.items() if k != "type"}
    out["rope_type"] = kind
    if kind == "yarn":
        out.setdefault("original_max_position_embeddings", max_position_embeddings)
        if out.get("attention_factor") is not None:
            _positive(out, "attention_factor")
        for key in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
            if out.get(key):  # (transformers reads 0 and None as the default)
                _positive(out, key)
        if not isinstance(out.get("truncate", True), bool):
            raise ConfigError(f"ModelConfig.rope_scaling.truncate must be true or false, "
                              f"got {out['truncate']!r}")
    for key in _REQUIRED[kind]:
        _positive(out, key)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ConfigError("ModelConfig.rope_scaling.high_freq_factor must exceed low_freq_factor")
    return out


def _llama3(inv_freq: torch.Tensor, rs: dict[str, Any]) -> torch.Tensor:
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    context = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long_wavelen, short_wavelen = context / low, context / high  # beyond: scaled; below: kept
    scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(between, blended, scaled)


def _yarn(inv_freq: torch.Tensor, rs: dict[str, Any], d: int, theta: float) -> torch.Tensor:
    context, factor = rs["original_max_position_embeddings"], rs["factor"]

    def pair_turning(turns: float) -> float:  # the (fractional) pair index turning `turns` times in context
        return d * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_turning(rs.get("beta_fast") or 32), pair_turning(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)  # fast pairs kept, slow ones interpolated


def attention_factor(rs: dict[str, Any] | None) -> float:
    """YaRN's cos/sin multiplier (1 for every other scaling)."""
    if rs is None or rs["rope_type"] != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = rs["factor"], rs.get("mscale"), rs.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def inverse_frequencies(head_dim: int, theta: float, rs: dict[str, Any] | None) -> torch.Tensor:
    """The per-pair rotation frequencies [head_dim / 2] (float64), scaled as `rs` says."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    if rs["rope_type"] == "llama3":
        return _llama3(inv_freq, rs)
    return _yarn(inv_freq, rs, d, theta)


def rope_tables(head_dim: int, theta: float, positions: int,
                rs: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [positions, head_dim] float32, rotate-half layout (a ModelConfig's
    head_dim, rope_theta, max_position_embeddings and rope_scaling, checked)."""
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inverse_frequencies(head_dim, theta, rs)
    angles = torch.cat([angles, angles], dim=-1)
    scale = attention_factor(rs)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()
