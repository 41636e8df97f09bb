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

- `longrope` (Phi-3 128k, Phi-3.5, Phi-4-mini): each pair's frequency divided by its own factor,
  `long_factor` or `short_factor`, cos and sin multiplied by `attention_factor` (default
  `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`, factor the context's ratio to
  the original). transformers picks the set per forward, long when the forward's longest position
  passes `original_max_position_embeddings`; that would make a token's log-prob depend on its
  batch, so parity picks once per model, as vLLM picks once per server from its context: long when
  `max_position_embeddings` exceeds the original context, short otherwise.

`dynamic` NTK is refused: it switches frequencies by the longest sequence in the forward, so a
token's log-prob would depend on what it is batched with — the very mismatch parity removes.

Partial rotary embeddings (Phi-4-mini: `partial_rotary_factor` 0.75) rotate the first `rotary_dim`
dimensions of each head and pass the rest through. parity's kernels rotate whole heads, pairing
dimension i with i + head_dim / 2; `rotary_order` reorders each head's q and k dimensions (on load,
undone on save: `tensor_names.py`) so that the rotated pairs sit where the kernels pair them and the
passed-through ones meet angle 0 (cos exactly 1, sin 0: x * 1 + y * 0 is x, bit for bit). Attention
scores are sums over the same products in another order.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError
from ..hardware import available_memory

_REQUIRED: dict[str, tuple[str, ...]] = {  # per type; other keys are read as transformers reads them
    "linear": ("factor",),
    "llama3": ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),  # (and its two lists of factors)
}
_BATCH_DEPENDENT = ("dynamic",)


def _positive(rs: dict[str, Any], key: str) -> float:
    value = rs.get(key)  # (NaN and inf passed `<= 0` and gave NaN log-probs)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ConfigError(f"ModelConfig.rope_scaling.{key} must be a positive finite number, got {value!r}")
    return value


def _factors(rs: dict[str, Any], key: str, pairs: int) -> None:
    value = rs.get(key)
    if (not isinstance(value, list) or len(value) != pairs
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
                       for v in value)):
        shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)
        raise ConfigError(f"ModelConfig.rope_scaling.{key} must list {pairs} positive finite numbers "
                          f"(one per rotated pair), got {shown if len(shown) < 60 else shown[:57] + '...'}")


def _longrope(out: dict[str, Any], max_position_embeddings: int, pairs: int) -> None:
    """longrope's fields checked; its attention factor written out, so that a context capped
    later (or a transformers version that derives it otherwise) keeps the model's."""
    if out["original_max_position_embeddings"] < 2:  # (its log divides the attention factor's)
        raise ConfigError("ModelConfig.rope_scaling.original_max_position_embeddings must be at least 2 for "
                          f"longrope, got {out['original_max_position_embeddings']!r}")
    for key in ("short_factor", "long_factor"):
        _factors(out, key, pairs)
    if out.get("factor") is not None:
        _positive(out, "factor")
    if out.get("attention_factor") is not None:
        _positive(out, "attention_factor")
        return
    original = out["original_max_position_embeddings"]
    factor = out.get("factor") or max_position_embeddings / original
    out["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def check_rope_scaling(rs: dict[str, Any] | None, max_position_embeddings: int,
                       pairs: int | None = None) -> dict[str, Any] | None:
    """`rs` validated and normalised (`rope_type` spelled out; YaRN's context filled in as
    transformers fills it; longrope's attention factor written out, its lists `pairs` long, the
    rotated pairs of a head), or a one-line ConfigError naming the field."""
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
        raise ConfigError(f"ModelConfig.rope_scaling.partial_rotary_factor {rs['partial_rotary_factor']!r}: "
                          "set ModelConfig.partial_rotary_factor instead")
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
    if kind == "longrope":
        short = out.get("short_factor")
        _longrope(out, max_position_embeddings, pairs or (len(short) if isinstance(short, list) else 0))
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
    """YaRN's and longrope's cos/sin multiplier (1 for every other scaling)."""
    if rs is None or rs["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = rs["factor"], rs.get("mscale"), rs.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def long_factors(rs: dict[str, Any], positions: int) -> bool:
    """Whether a longrope model of `positions` positions rotates by its long factors (see above)."""
    return positions > rs["original_max_position_embeddings"]


def inverse_frequencies(rotary_dim: int, theta: float, rs: dict[str, Any] | None,
                        positions: int = 0) -> torch.Tensor:
    """The per-pair rotation frequencies [rotary_dim / 2] (float64), scaled as `rs` says (longrope:
    for a model of `positions` positions)."""
    d = rotary_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "longrope":
        key = "long_factor" if long_factors(rs, positions) else "short_factor"
        return inv_freq / torch.tensor(rs[key], dtype=torch.float64)
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    if rs["rope_type"] == "llama3":
        return _llama3(inv_freq, rs)
    return _yarn(inv_freq, rs, d, theta)


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order parity keeps a head's q and k dimensions in, as indices into the file's order: the
    first halves of the rotated and the passed-through dimensions, then their second halves, so
    that the kernels' pairs (i, i + head_dim / 2) are the rotated pairs (i, i + rotary_dim / 2)
    or two passed-through dimensions. The identity when every dimension rotates."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(r), rotary_dim + torch.arange(p), r + torch.arange(r),
                      rotary_dim + p + torch.arange(p)])


def rope_tables(head_dim: int, theta: float, positions: int, rs: dict[str, Any] | None,
                rotary_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [positions, head_dim] float32, rotate-half layout (a ModelConfig's
    head_dim, rope_theta, max_position_embeddings, rope_scaling and rotary_dim, checked); with
    fewer rotated dimensions than head_dim, in `rotary_order`, the passed-through pairs at angle 0
    and unscaled (cos 1, sin 0)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    need, free = 2 * positions * head_dim * 4, available_memory()
    if need > free // 2:  # (1M positions took 4 GB for a 100 KB model; 8M asked for 60 GB)
        raise ConfigError(f"max_position_embeddings = {positions:,}: its RoPE tables take "
                          f"{need / 2**30:.1f} GiB, more than half the {free / 2**30:.1f} GiB available; "
                          "serve a shorter context (model.context, --context)")
    inv_freq = inverse_frequencies(rotary_dim, theta, rs, positions)
    still = (head_dim - rotary_dim) // 2
    scale = torch.cat([torch.full((rotary_dim // 2,), attention_factor(rs), dtype=torch.float64),
                       torch.ones(still, dtype=torch.float64)])
    scale = torch.cat([scale, scale])
    cos, sin = torch.empty(positions, head_dim), torch.empty(positions, head_dim)
    for start in range(0, positions, 1 << 16):  # in blocks of positions: float64 only for a block
        stop = min(positions, start + (1 << 16))
        angles = torch.arange(start, stop, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles.new_zeros(stop - start, still)], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        cos[start:stop], sin[start:stop] = angles.cos() * scale, angles.sin() * scale
    return cos, sin
