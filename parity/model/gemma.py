"""Gemma 3 (text) configs: the fields `families.py` reads and writes for `gemma3_text` alone.

Gemma3ForCausalLM (the 270M and 1B checkpoints; the larger ones are Gemma3ForConditionalGeneration,
image and text) differs from the other families in fields of its own: a local RoPE base for its
sliding layers (`rope_local_base_freq`, or 5.x's `rope_parameters.sliding_attention`), the
attention scale `query_pre_attn_scalar`, a sliding-layer pattern (`sliding_window_pattern`, every
6th layer full, when `layer_types` is absent) and a tanh-GELU activation (`hidden_activation`).
Gemma 2's soft-capping and the bidirectional variant are refused, not approximated.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from .config import ModelConfig

WRITTEN = ("hidden_activation", "query_pre_attn_scalar", "rope_local_base_freq", "sliding_window_pattern",
           "_sliding_window_pattern",
           "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention")
"""Gemma fields `to_hf` writes itself (never carried in `extra`)."""


def _positive(value, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{where}: {what} must be a positive number, got {value!r}")
    return float(value)


def from_hf(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The gemma3_text `ModelConfig` fields beyond the shared ones and the full layers' RoPE."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if data.get(key) is not None:
            raise ConfigError(f"{where}: {key} {data[key]!r} is not supported (soft-capping, as in Gemma 2)")
    if data.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention=true is not supported (a causal LM only)")
    act = data.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    params = data.get("rope_parameters")
    nested = isinstance(params, dict) and bool({"full_attention", "sliding_attention"} & set(params))
    if params and not nested:  # (transformers 5 ignores flat keys here, 4.x all of rope_parameters)
        raise ConfigError(f"{where}: rope_parameters must name the layer types for gemma3_text "
                          "({'full_attention': {...}, 'sliding_attention': {...}}), got a flat one")
    if nested and data.get("rope_scaling"):  # (5.x merges the two, 4.x reads rope_scaling alone)
        raise ConfigError(f"{where}: rope_scaling beside per-layer-type rope_parameters: transformers 4 "
                          "and 5 read them differently; keep one")
    local = params.get("sliding_attention") if nested else None
    base = data.get("rope_local_base_freq")
    if local is not None:
        if not isinstance(local, dict):
            raise ConfigError(f"{where}: rope_parameters.sliding_attention must be an object, got {local!r}")
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} "
                              "is not supported (Gemma's sliding layers rotate unscaled)")
        own = local.get("rope_theta")
        if own is not None and base is not None and _positive(own, "rope_theta", where) != float(base):
            raise ConfigError(f"{where}: rope_local_base_freq {base} and rope_parameters.sliding_attention."
                              f"rope_theta {own} disagree (transformers 4 reads the first, 5 the second)")
        base = own if own is not None else base
    window = data.get("sliding_window", 4096)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    types = data.get("layer_types")
    if types is None:  # transformers' derivation: every `sliding_window_pattern`-th layer is full
        pattern = data.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        layers = data["num_hidden_layers"]
        types = _pattern(pattern, layers if isinstance(layers, int) else 0)
    base = _positive(10000.0 if base is None else base, "rope_local_base_freq", where)
    scalar = _positive(data.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar", where)
    return dict(sliding_window=window, layer_types=types, rope_local_base_freq=base,
                query_pre_attn_scalar=scalar)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The gemma3_text fields of `config.json`, in the layout both transformers 4.x and 5.x read
    (`rope_theta` and `rope_scaling` are the full layers', written by `families.config_to_hf`;
    `layer_types` for 4.53+ and 5.x, and `sliding_window_pattern` for 4.50-4.52 where the layers
    follow one)."""
    types = [cfg.layer_window_type(i) for i in range(cfg.num_hidden_layers)]
    out = dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
               rope_local_base_freq=cfg.rope_local_base_freq, sliding_window=cfg.sliding_window,
               layer_types=types, attn_logit_softcapping=None, final_logit_softcapping=None,
               use_bidirectional_attention=False, attention_bias=False)
    for pattern in range(1, len(types) + 2):  # transformers 4.50-4.52 read this, not layer_types
        if types == _pattern(pattern, len(types)):
            out["sliding_window_pattern"] = pattern
            break
    return out


def _pattern(pattern: int, layers: int) -> list[str]:
    """transformers' layer types from `sliding_window_pattern`: every pattern-th layer is full."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
