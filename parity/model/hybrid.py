"""Families with sliding and full layer types: Gemma 2, Gemma 3 (text) and OLMo 3 configs.

Gemma 3 and OLMo 3 name each layer's type (`layer_types`, or a pattern when absent: every 6th layer full for
Gemma 3, every 4th for OLMo 3), give the sliding layers RoPE that is never scaled (in transformers
5, `rope_parameters.sliding_attention`; `rope_scaling` is the full layers' alone) and, for Gemma,
another base (`rope_local_base_freq`). `families.py` reads the fields shared with the other
families and the full layers' RoPE; this module the rest, and writes them back.

Gemma3ForCausalLM (the 270M and 1B checkpoints) also has the attention scale
`query_pre_attn_scalar` and a tanh-GELU activation (`hidden_activation`). The 4B, 12B and 27B
checkpoints are Gemma3ForConditionalGeneration (image and text): `text_config_of` reads their
language model's config (its `text_config`, fields left out there at Gemma3TextConfig's defaults),
whose weights load without the vision tower (`tensor_names.text_model_tensors`); such a model
saves as the Gemma3ForCausalLM it is.

Gemma 2 (Gemma2ForCausalLM: 2B, 9B, 27B) has the scalar and the activation too, slides every
other layer (the even ones, unless `layer_types` says otherwise) on the full layers' RoPE, and
soft-caps attention scores and final logits (`attn_logit_softcapping`, `final_logit_softcapping`:
50 and 30 when left out; Gemma 3's may set the final one, absent there means none; its attention
cap, which transformers ignores, is refused). The bidirectional variant is refused, not
approximated.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from .config import ModelConfig

WRITTEN = ("hidden_activation", "query_pre_attn_scalar", "rope_local_base_freq", "sliding_window_pattern",
           "_sliding_window_pattern", "attn_logit_softcapping", "final_logit_softcapping",
           "use_bidirectional_attention")
"""Fields `to_hf` writes itself (never carried in `extra`)."""

FAMILIES = ("gemma2", "gemma3_text", "olmo3")
"""The model types whose config fields this module reads and writes."""

GEMMAS = ("gemma2", "gemma3_text")
"""The Gemma families (activation `hidden_activation`, query scalar, soft-caps)."""

_CAPS = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
         "gemma3_text": {"final_logit_softcapping": None}}  # (its attention cap: refused)
"""transformers' soft-caps where a config leaves them out (an explicit null: no cap)."""


_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, num_hidden_layers=26, num_attention_heads=8)
"""Gemma3TextConfig's defaults for the fields every config must otherwise give (Gemma 3's image-text
configs leave those of the 4B checkpoint out: its sizes are the defaults)."""


def is_image_text(data: dict[str, Any]) -> bool:
    """Whether a config.json is Gemma 3's image-text one (model_type gemma3)."""
    archs = data.get("architectures")  # (a list, or checked as one later: 5 was a TypeError here)
    return data.get("model_type") == "gemma3" or (isinstance(archs, list)
                                                  and "Gemma3ForConditionalGeneration" in archs)


def text_config_of(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A Gemma 3 image-text config's language model as a Gemma3ForCausalLM config (the top level's
    token ids and tie win, as transformers generates with them; its tie defaults to true there,
    as transformers 5 reads it); any other config unchanged. The image-text model applies neither
    soft-cap its `text_config` may name, so neither is read."""
    if not is_image_text(data):
        return data
    text = data.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config must be an object, got {text!r}")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ConfigError(f"{where}: text_config.model_type {text['model_type']!r} is not supported "
                          "(Gemma 3's language model is gemma3_text)")
    top = {k: data[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings")
           if data.get(k) is not None}
    return {**_TEXT_DEFAULTS, **text, "tie_word_embeddings": True, **top, "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None,
            "final_logit_softcapping": None}


def _positive(value, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{where}: {what} must be a positive number, got {value!r}")
    return float(value)


def _pattern(pattern: int, layers: int) -> list[str]:
    """transformers' layer types from a pattern: every pattern-th layer is full."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _gemma_checks(data: dict[str, Any], model_type: str, where: str) -> None:
    if model_type == "gemma3_text" and data.get("attn_logit_softcapping") is not None:
        raise ConfigError(f"{where}: attn_logit_softcapping {data['attn_logit_softcapping']!r} on Gemma 3 is "
                          "not supported: transformers' Gemma 3 ignores it, other servers may apply it")
    if data.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention=true is not supported (a causal LM only)")
    act = data.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")


def _check_scaling(data: dict[str, Any], full: dict | None, where: str) -> None:
    """A legacy `rope_scaling` (the full layers') beside per-layer-type `rope_parameters`: 5.x
    merges the two, 4.x reads `rope_scaling` alone, so they must say the same; and what 5.x would
    read otherwise than 4.x in it (its old `type` spelling, YaRN's `truncate`) is refused."""
    scaling = data.get("rope_scaling")
    if not scaling:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    if "type" in scaling and "rope_type" not in scaling:  # (5.x keeps rope_type 'default': unscaled)
        raise ConfigError(f"{where}: rope_scaling spells its type 'type': transformers 5 reads it as no "
                          "scaling here, 4 as the scaling; write 'rope_type'")
    if full is not None and {k: v for k, v in full.items() if k != "rope_theta"} != scaling:
        raise ConfigError(f"{where}: rope_scaling beside per-layer-type rope_parameters says otherwise than "
                          "rope_parameters.full_attention: transformers 4 and 5 read them differently")


def _local_base(data: dict[str, Any], model_type: str, where: str) -> float:
    """The sliding layers' RoPE base, as transformers 5 reads it (4.x alike, or refused): Gemma's
    `rope_parameters.sliding_attention.rope_theta`, else `rope_local_base_freq`, else 10000;
    OLMo 3's `rope_parameters.sliding_attention.rope_theta`, else 500000 (4.x: `rope_theta`)."""
    params = data.get("rope_parameters")
    nested = isinstance(params, dict) and bool({"full_attention", "sliding_attention"} & set(params))
    if params and not nested:  # (transformers 5 ignores flat keys here, 4.x all of rope_parameters)
        raise ConfigError(f"{where}: rope_parameters must name the layer types for {model_type} "
                          "({'full_attention': {...}, 'sliding_attention': {...}}), got a flat one")
    full = params.get("full_attention") if nested else None
    _check_scaling(data, full if isinstance(full, dict) else None, where)
    for scaling in (data.get("rope_scaling"), full):
        if isinstance(scaling, dict) and scaling.get("truncate") is False:  # (5.x reads it at the top only)
            raise ConfigError(f"{where}: YaRN's truncate=false on {model_type}: transformers 5 ignores it "
                              "in a per-layer-type config, 4 applies it")
    local = params.get("sliding_attention") if nested else None
    if local is not None and not isinstance(local, dict):
        raise ConfigError(f"{where}: rope_parameters.sliding_attention must be an object, got {local!r}")
    if local is not None and local.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} "
                          "is not supported (the sliding layers rotate unscaled)")
    own = None if local is None else local.get("rope_theta")
    own = None if own is None else _positive(own, "rope_parameters.sliding_attention.rope_theta", where)
    if model_type == "gemma3_text":
        legacy = data.get("rope_local_base_freq")
        if own is not None and legacy is not None and own != float(legacy):
            raise ConfigError(f"{where}: rope_local_base_freq {legacy} and rope_parameters.sliding_attention."
                              f"rope_theta {own} disagree (transformers 4 reads the first, 5 the second)")
        return _positive(own if own is not None else legacy if legacy is not None else 10000.0,
                         "rope_local_base_freq", where)
    base, legacy = (own if own is not None else 500000.0), data.get("rope_theta")  # olmo3
    if legacy is None and not nested:
        raise ConfigError(f"{where}: OLMo 3 config without rope_theta: transformers 4 reads 10000, 5 reads "
                          "500000; set it")
    if legacy is not None and float(legacy) != base:
        raise ConfigError(f"{where}: rope_theta {legacy} for OLMo 3's sliding layers: transformers 4 rotates "
                          f"them by it, 5 by {base:g} (rope_parameters.sliding_attention); make them agree")
    return base


def from_hf(data: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a gemma3_text or olmo3 config beyond the shared ones and the
    full layers' RoPE."""
    if model_type in GEMMAS:
        _gemma_checks(data, model_type, where)
    window = data.get("sliding_window", 4096)  # (every family's transformers default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    types = data.get("layer_types")
    if types is None:  # transformers' derivation (Gemma 3's configs may set the pattern; the others fixed)
        pattern = {"gemma2": 2, "olmo3": 4}.get(model_type) or data.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        layers = data["num_hidden_layers"]
        types = _pattern(pattern, layers if isinstance(layers, int) else 0)
    out: dict[str, Any] = dict(sliding_window=window, layer_types=types)
    if model_type != "gemma2":  # (whose sliding layers rotate as the full ones)
        out["rope_local_base_freq"] = _local_base(data, model_type, where)
    if model_type in GEMMAS:
        scalar = data.get("query_pre_attn_scalar", 256)
        out["query_pre_attn_scalar"] = _positive(scalar, "query_pre_attn_scalar", where)
        for key, default in _CAPS[model_type].items():
            cap = data.get(key, default)
            out[key] = None if cap is None else _positive(cap, key, where)
    return out


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of `config.json` this module reads, in a layout transformers 4.x and 5.x read
    alike (`rope_theta` and `rope_scaling` are the full layers', written by `families.py`;
    `layer_types` for 4.53+ and 5.x, and Gemma's `sliding_window_pattern` for 4.50-4.52 where the
    layers follow one)."""
    types = [cfg.layer_window_type(i) for i in range(cfg.num_hidden_layers)]
    out: dict[str, Any] = dict(sliding_window=cfg.sliding_window, layer_types=types, attention_bias=False)
    if cfg.model_type == "olmo3":  # per layer type, as 5.x reads it (4.x: rope_theta, rope_scaling)
        out["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                                     **(cfg.rope_scaling or {})},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": cfg.rope_local_base_freq}}
        out["rope_scaling"] = cfg.rope_scaling  # (4.x reads these two; 5.x merges the same values)
        if cfg.rope_local_base_freq != cfg.rope_theta:  # (4.x rotates every layer by rope_theta)
            out["rope_theta"] = None
        return out
    out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
               attn_logit_softcapping=cfg.attn_logit_softcapping, use_bidirectional_attention=False,
               final_logit_softcapping=cfg.final_logit_softcapping)
    if cfg.model_type == "gemma2":
        return out
    out["rope_local_base_freq"] = cfg.rope_local_base_freq
    for pattern in range(1, len(types) + 2):  # transformers 4.50-4.52 read this, not layer_types
        if types == _pattern(pattern, len(types)):
            out["sliding_window_pattern"] = pattern
            break
    return out
