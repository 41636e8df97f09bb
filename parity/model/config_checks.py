"""`ModelConfig`'s checks of one family's fields against each other: sliding windows and layer
types, Gemma's and OLMo 3's own fields, mixture-of-experts sizes. Each raises a one-line
`ConfigError` naming the field; `ModelConfig.__post_init__` runs them on construction (each takes
the `ModelConfig`: typed Any, as this module is imported by `config.py`)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
"""Attention kinds a layer may have (`ModelConfig.layer_types`)."""


def check_windows(cfg: Any) -> None:
    window, types = cfg.sliding_window, cfg.layer_types
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"ModelConfig.sliding_window must be a positive integer or None, "
                          f"got {window!r}")
    if window is not None and cfg.model_type in ("llama", "olmo2"):  # (transformers' have no window)
        raise ConfigError(f"ModelConfig.sliding_window is not supported for {cfg.model_type}")
    if window is None and cfg.model_type in ("gemma2", "gemma3_text", "olmo3"):  # (theirs always slide)
        raise ConfigError(f"ModelConfig.sliding_window must be set for {cfg.model_type} (its "
                          "transformers code always builds the sliding layers' mask)")
    if types is None:
        return
    if not isinstance(types, (list, tuple)) or len(types) != cfg.num_hidden_layers:
        raise ConfigError(f"ModelConfig.layer_types must list one type per layer "
                          f"({cfg.num_hidden_layers}), got {types!r}")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"ModelConfig.layer_types: {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")
    cfg.layer_types = list(types)
    if "sliding_attention" in types and window is None:
        raise ConfigError("ModelConfig.layer_types has sliding_attention layers but sliding_window "
                          "is None")
    full = window is not None and types[:1] == ["full_attention"]  # (saved, the window slides them all)
    if cfg.model_type in ("mistral", "mixtral", "qwen3_moe", "phi3") and (len(set(types)) > 1 or full):
        raise ConfigError(f"ModelConfig.layer_types: {cfg.model_type} layers all attend alike, and with "
                          "sliding_window set all slide (set sliding_window None for full attention)")


def check_family_fields(cfg: Any) -> None:
    """Gemma's query scalar and soft-caps, the sliding layers' RoPE base (Gemma 3, OLMo 3),
    SmolLM3's NoPE layers: their defaults where left out, refused on the other families."""
    nope = cfg.no_rope_layers
    if cfg.model_type == "smollm3" and nope is None:  # (transformers' default: every 4th layer NoPE)
        cfg.no_rope_layers = nope = [int((i + 1) % 4 != 0) for i in range(cfg.num_hidden_layers)]
    if nope is not None:
        if cfg.model_type != "smollm3":
            raise ConfigError(f"ModelConfig.no_rope_layers is not a field of {cfg.model_type}")
        if not isinstance(nope, (list, tuple)) or len(nope) != cfg.num_hidden_layers \
                or any(isinstance(x, bool) or x not in (0, 1) for x in nope):
            raise ConfigError(f"ModelConfig.no_rope_layers must list 1 (RoPE) or 0 (NoPE) for each of the "
                              f"{cfg.num_hidden_layers} layers, got {nope!r}")
        cfg.no_rope_layers = [int(x) for x in nope]
    gemma = cfg.gemma
    local = {"gemma3_text": 1e4, "olmo3": cfg.rope_theta}.get(cfg.model_type)
    for name, default, own in (("query_pre_attn_scalar", float(cfg.head_dim), gemma),
                               ("rope_local_base_freq", local, local is not None),
                               ("attn_logit_softcapping", None, cfg.model_type == "gemma2"),
                               ("final_logit_softcapping", None, gemma)):
        value = getattr(cfg, name)
        if value is None:
            if own:
                setattr(cfg, name, default)
        elif not own:
            raise ConfigError(f"ModelConfig.{name} is not a field of {cfg.model_type}")
        elif not 0 < value < math.inf:
            raise ConfigError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
    if gemma and not float(cfg.query_pre_attn_scalar).is_integer():  # (transformers 5 reads an int)
        raise ConfigError(f"ModelConfig.query_pre_attn_scalar must be a whole number, "
                          f"got {cfg.query_pre_attn_scalar!r}")


def check_moe(cfg: Any) -> None:
    if (cfg.shared_expert_intermediate_size > 0) != (cfg.model_type == "qwen2_moe"):
        raise ConfigError(f"ModelConfig.shared_expert_intermediate_size must be a positive integer for "
                          f"qwen2_moe and 0 otherwise, got {cfg.shared_expert_intermediate_size!r} "
                          f"for {cfg.model_type}")
    if not cfg.is_moe:
        if cfg.num_experts or cfg.num_experts_per_tok or cfg.moe_intermediate_size:
            raise ConfigError(f"ModelConfig.num_experts is set but model_type is {cfg.model_type!r}")
        return
    if cfg.model_type == "mixtral":  # every layer a mixture, its top-k weights renormalised
        if cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers or not cfg.norm_topk_prob:
            raise ConfigError("ModelConfig: mixtral has a mixture in every layer (decoder_sparse_step 1, "
                              "no mlp_only_layers) and renormalises its top-k (norm_topk_prob true)")
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        value = getattr(cfg, name)
        if value <= 0:
            raise ConfigError(f"ModelConfig.{name} must be a positive integer for {cfg.model_type}, "
                              f"got {value!r}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(f"ModelConfig.num_experts_per_tok={cfg.num_experts_per_tok} exceeds "
                          f"num_experts={cfg.num_experts}")
    layers = range(cfg.num_hidden_layers)
    bad = [i for i in cfg.mlp_only_layers if i not in layers]
    if bad:
        raise ConfigError(f"ModelConfig.mlp_only_layers: {bad[0]!r} is not a layer index")
