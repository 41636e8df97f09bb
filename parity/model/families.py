"""Model families: reading and writing Hugging Face `config.json` files and checkpoint tensor names.

`config_from_hf` turns a config of a supported family (Qwen3, Qwen3-MoE, Qwen2/2.5, Llama 3.x,
Mistral, Mixtral, Qwen2-MoE, Gemma 2 and 3, OLMo 2 and 3, Phi-3, SmolLM3; the layouts of transformers 4.x
and 5.x) into a `ModelConfig`, and
refuses — with a one-line error naming the field — anything parity would otherwise get silently
wrong: another architecture, biases or RoPE scalings it does not implement, an activation other
than SiLU. Sliding-window layers are read as each family's transformers code reads them
(`_windows`). `config_to_hf` writes what `transformers` loads back.

Tensor names between checkpoint files and the model are `tensor_names.py`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import files, hf_rope, hybrid
from .config import MODEL_TYPES, ModelConfig
from .config_checks import LAYER_TYPES

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Gemma3ForCausalLM": "gemma3_text", "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3",
                 "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "SmolLM3ForCausalLM": "smollm3"}

_DEFAULTS: dict[str, dict[str, Any]] = {  # transformers' defaults for fields a config.json leaves out
    "qwen3": dict(max_position_embeddings=32768, num_key_value_heads=32),
    "qwen3_moe": dict(max_position_embeddings=32768, num_key_value_heads=4),
    "qwen2": dict(max_position_embeddings=32768, num_key_value_heads=32),
    "llama": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "mistral": dict(max_position_embeddings=131072, num_key_value_heads=8, bos_token_id=1, eos_token_id=2),
    "mixtral": dict(max_position_embeddings=131072, num_key_value_heads=8, bos_token_id=1, eos_token_id=2,
                    rms_norm_eps=1e-5, rope_theta=1e6),
    "qwen2_moe": dict(max_position_embeddings=32768, num_key_value_heads=16, moe_intermediate_size=1408,
                      num_experts=60, num_experts_per_tok=4, shared_expert_intermediate_size=5632),
    "gemma2": dict(max_position_embeddings=8192, num_key_value_heads=4, head_dim=256, bos_token_id=2,
                   eos_token_id=1, tie_word_embeddings=True, intermediate_size=9216),
    "gemma3_text": dict(max_position_embeddings=131072, num_key_value_heads=4, head_dim=256, bos_token_id=2,
                        eos_token_id=1, tie_word_embeddings=True, rope_theta=1e6, intermediate_size=9216),
    "olmo2": dict(max_position_embeddings=2048, rms_norm_eps=1e-5, eos_token_id=50279,
                  intermediate_size=11008),
    "phi3": dict(max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=32000,
                 intermediate_size=8192),
    "smollm3": dict(max_position_embeddings=32768, num_key_value_heads=4, bos_token_id=128000,
                    eos_token_id=128001, tie_word_embeddings=True, intermediate_size=11008, rope_theta=2e6),
    "olmo3": dict(max_position_embeddings=2048, rope_theta=500000.0, rms_norm_eps=1e-5, eos_token_id=50279,
                  intermediate_size=11008),
}  # (else: rope_theta 1e4, rms_norm_eps 1e-6, num_key_value_heads num_attention_heads, no bos/eos)
_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_SHARED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
           "tie_word_embeddings", "bos_token_id", "eos_token_id")
"""Fields `ModelConfig` and transformers' configs both have, under one name (a null one is read as
transformers' default, and written back as parity's value)."""
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def read_json(path: Path) -> dict[str, Any]:
    if not Path(path).exists() and not Path(path).is_symlink():
        raise ConfigError(f"{path}: no such config file")
    data = files.read_json(path, ConfigError)  # (a regular file of bounded size: `files.py`)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _model_type(data: dict, where: str) -> str:
    model_type = data.get("model_type")
    archs = data.get("architectures") or []
    if model_type is None and archs:
        model_type = ARCHITECTURES.get(archs[0])
    if model_type is None and not archs:
        model_type = "qwen3"  # parity's first checkpoints did not name the type
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported; "
                          f"parity builds {', '.join(ARCHITECTURES)}")
    for arch in archs:
        if ARCHITECTURES.get(arch) != model_type:
            raise ConfigError(f"{where}: architecture {arch!r} is not supported (model_type {model_type!r})")
    return model_type


_NUMBERS = ("rope_theta", "rms_norm_eps", "router_aux_loss_coef")
_LISTS = ("architectures", "layer_types", "mlp_only_layers", "no_rope_layers")


def _check_types(data: dict, where: str) -> None:
    """Fields read below have the JSON types transformers writes (null counts as absent): a
    wrong one is a one-line error naming it, not a TypeError from deep inside."""
    for key in _NUMBERS:
        v = data.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
    for key in _LISTS:
        v = data.get(key)
        if v is not None and not isinstance(v, list):
            raise ConfigError(f"{where}: {key} must be a list, got {v!r}")
    for key in ("architectures", "layer_types"):
        bad = [x for x in data.get(key) or [] if not isinstance(x, str)]
        if bad:
            raise ConfigError(f"{where}: {key} must list strings, got {bad[0]!r}")
    if data.get("norm_topk_prob") is not None and not isinstance(data["norm_topk_prob"], bool):
        raise ConfigError(f"{where}: norm_topk_prob must be true or false, got {data['norm_topk_prob']!r}")
    if data.get("rope_parameters") is not None and not isinstance(data["rope_parameters"], dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {data['rope_parameters']!r}")


def _windows(data: dict, model_type: str, fields: dict, where: str) -> None:
    """`sliding_window` and `layer_types` as transformers reads the family's config: Mistral,
    Mixtral and Phi-3 slide every layer when a window is set (absent: 4096 for Mistral, none else);
    the Qwen families only with `use_sliding_window`: Qwen3-MoE every layer; Qwen2/Qwen3 the layers
    `layer_types` names, else those from `max_window_layers` on; Qwen2-MoE likewise, else the even
    layers below `max_window_layers`; SmolLM3 likewise the layers `layer_types` names, else its
    NoPE layers."""
    types, layers = data.get("layer_types"), data["num_hidden_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int):  # (before it is compared with them)
        raise ConfigError(f"{where}: num_hidden_layers must be an integer, got {layers!r}")
    if types is not None:  # (transformers checks them whether or not any layer slides)
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"{where}: layer_types: {bad[0]!r} is not supported (only "
                              f"{', '.join(LAYER_TYPES)})")
        if len(types) != layers:
            raise ConfigError(f"{where}: layer_types lists {len(types)} layers, num_hidden_layers is "
                              f"{layers}")
    window = data.get("sliding_window", 4096 if model_type == "mistral" else None)
    every = model_type in ("mistral", "mixtral", "phi3")  # (these slide whenever a window is set)
    on = window is not None and (every or bool(data.get("use_sliding_window")))
    if not on or model_type in ("llama", "olmo2"):  # (transformers' have no window)
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    fields["sliding_window"] = window
    if model_type in ("mistral", "mixtral", "qwen3_moe", "phi3"):
        return  # every layer
    if types is None and isinstance(layers, int):
        first = data.get("max_window_layers", 28) if model_type != "smollm3" else 0  # (transformers' default)
        if isinstance(first, bool) or not isinstance(first, int):
            raise ConfigError(f"{where}: max_window_layers must be an integer, got {first!r}")
        slides = (lambda i: i % 2 == 0 and i < first) if model_type == "qwen2_moe" else (lambda i: i >= first)
        if model_type == "smollm3":
            nope = fields["no_rope_layers"]
            slides = lambda i: not nope[i]  # noqa: E731
        types = ["sliding_attention" if slides(i) else "full_attention" for i in range(layers)]
    fields["layer_types"] = types


def _nope_layers(data: dict, where: str) -> list:
    """SmolLM3's per-layer RoPE switches as transformers reads them: `no_rope_layers`, else a NoPE
    layer every `no_rope_layer_interval` (4) layers."""
    nope, layers = data.get("no_rope_layers"), data["num_hidden_layers"]
    if nope is not None:  # (transformers reads the first num_hidden_layers of a longer list)
        if isinstance(layers, int) and len(nope) < layers:
            raise ConfigError(f"{where}: no_rope_layers lists {len(nope)} layers, num_hidden_layers is "
                              f"{layers}")
        return nope[:layers] if isinstance(layers, int) else nope
    interval = data.get("no_rope_layer_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"{where}: no_rope_layer_interval must be a positive integer, got {interval!r}")
    return [int((i + 1) % interval != 0) for i in range(layers if isinstance(layers, int) else 0)]


def config_from_hf(data: dict[str, Any], where: Path | str = "config.json") -> ModelConfig:
    """A `ModelConfig` from a Hugging Face config dict of a supported family (Gemma 3's image-text
    ones: their language model, `hybrid.text_config_of`)."""
    data = hybrid.text_config_of(data, str(where))
    _check_types(data, str(where))
    model_type = _model_type(data, str(where))
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"{where}: required field {missing[0]!r} is missing")
    if data.get("quantization_config") is not None:
        kind = data["quantization_config"]
        kind = kind.get("quant_method", "?") if isinstance(kind, dict) else kind
        raise ConfigError(f"{where}: quantized checkpoints (quantization_config: {kind}) are not supported: "
                          "load a dequantized (float32/bfloat16/float16) checkpoint")
    if model_type not in hybrid.GEMMAS and data.get("hidden_act", "silu") not in ("silu", "swish"):  # (same)
        raise ConfigError(f"{where}: hidden_act {data['hidden_act']!r} is not supported (only 'silu')")
    if data.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported")
    if model_type != "qwen2" and data.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported for {model_type}")
    fields = {k: data[k] for k in _SHARED if data.get(k) is not None and k != "rope_theta"}
    if model_type == "qwen3" and "head_dim" not in data:
        fields["head_dim"] = 128  # transformers' Qwen3Config default (not hidden/heads; null means that)
    defaults = _DEFAULTS[model_type]
    fields.update({k: v for k, v in defaults.items() if k not in data and k != "rope_theta"})  # (null: None)
    fields.setdefault("num_key_value_heads", data["num_attention_heads"])
    fields.setdefault("max_position_embeddings", defaults["max_position_embeddings"])
    fields.setdefault("tie_word_embeddings", False)  # every supported family's default
    fields.setdefault("intermediate_size", data.get("moe_intermediate_size", 1))
    fields["model_type"] = model_type
    hf_rope.rope_fields(data, fields, str(where), defaults.get("rope_theta", 10000.0))
    if model_type == "smollm3":  # (before the windows, which follow its NoPE layers)
        fields["no_rope_layers"] = _nope_layers(data, str(where))
        types = data.get("layer_types") or []
        if "sliding_attention" in types and data.get("sliding_window") and not data.get("use_sliding_window"):
            raise ConfigError(f"{where}: layer_types names sliding layers but use_sliding_window is false: "
                              "transformers' eager and SDPA attention slide them, its flash attention does "
                              "not; set use_sliding_window")
    if model_type in hybrid.FAMILIES:
        fields.update(hybrid.from_hf(data, model_type, str(where)))
    else:
        _windows(data, model_type, fields, str(where))
    if model_type == "mixtral":  # every layer a mixture of intermediate_size experts, top-k renormalised
        width = data.get("intermediate_size", 14336)  # (transformers' defaults, as for the others)
        fields.update(num_experts=data.get("num_local_experts", data.get("num_experts", 8)),
                      intermediate_size=width, num_experts_per_tok=data.get("num_experts_per_tok", 2),
                      moe_intermediate_size=width, norm_topk_prob=True,
                      router_aux_loss_coef=float(data.get("router_aux_loss_coef", 0.001) or 0.0))
    if model_type in ("qwen3_moe", "qwen2_moe"):  # (qwen2_moe's absent sizes: its defaults, set above)
        fields.update({k: data[k] for k in _MOE if k in data})
        fields.setdefault("num_experts", data.get("num_local_experts"))
        fields.update(norm_topk_prob=data.get("norm_topk_prob") or False,
                      decoder_sparse_step=data.get("decoder_sparse_step", 1),
                      mlp_only_layers=list(data.get("mlp_only_layers") or []),
                      router_aux_loss_coef=float(data.get("router_aux_loss_coef") or 0.0),
                      attention_bias=model_type == "qwen2_moe" and data.get("qkv_bias") is not False)
    extra = {k: v for k, v in data.items() if k not in fields and k not in _WRITTEN}
    extra.update(fields.pop("extra", {}))
    try:
        return ModelConfig(**fields, extra=extra)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


_WRITTEN = {*_SHARED, *hybrid.WRITTEN, "model_type", "architectures", "hidden_act", "attention_bias",
            "qkv_bias", "dtype", "rope_scaling", "rope_parameters", "use_sliding_window", "sliding_window",
            "layer_types",
            "mlp_bias", *_MOE, "num_local_experts", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers", "router_aux_loss_coef", "torch_dtype", "transformers_version",
            "no_rope_layers", "no_rope_layer_interval", "partial_rotary_factor"}
"""HF fields `config_to_hf` writes itself (not carried in `extra`)."""


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The `config.json` `transformers` loads as this family (both 4.x and 5.x read it)."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[cfg.model_type]
    out = {**cfg.extra}
    out.update({k: getattr(cfg, k) for k in _SHARED})
    out.update(model_type=cfg.model_type, architectures=[arch], rope_scaling=cfg.rope_scaling)
    if not cfg.gemma:  # (Gemma's activation is `hidden_activation`, written below)
        out["hidden_act"] = "silu"
    if cfg.model_type in hybrid.FAMILIES:
        out.update(hybrid.to_hf(cfg))
    out.setdefault("attention_dropout", 0.0)  # (a checkpoint's own value is kept; parity trains without)
    out.setdefault("pad_token_id", None)  # (a checkpoint's own is kept; Phi-3's default, 32000, is an id)
    if cfg.model_type == "qwen2_moe":  # (its q/k/v biases are `qkv_bias`)
        out.update(qkv_bias=cfg.attention_bias,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    elif cfg.model_type != "qwen2":
        out["attention_bias"] = False
    types = cfg.layer_types or ["sliding_attention"] * cfg.num_hidden_layers  # (None: all, with a window)
    if cfg.model_type == "smollm3":
        out["no_rope_layers"] = list(cfg.no_rope_layers)
    if cfg.model_type.startswith("qwen") or cfg.model_type == "smollm3":
        out["use_sliding_window"] = cfg.sliding_window is not None and "sliding_attention" in types
        if out["use_sliding_window"]:
            out["sliding_window"] = cfg.sliding_window
            if cfg.model_type != "qwen3_moe":  # (which slides every layer)
                out["layer_types"] = types
    if cfg.model_type in ("llama", "mistral", "smollm3"):
        out["mlp_bias"] = False
    if cfg.model_type in ("mistral", "mixtral", "phi3"):
        out["sliding_window"] = cfg.sliding_window  # (null written out: absent reads as 4096)
    if cfg.model_type == "phi3":
        out.update(hf_rope.phi3_to_hf(cfg))
    if cfg.model_type == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   intermediate_size=cfg.moe_intermediate_size, router_aux_loss_coef=cfg.router_aux_loss_coef)
    elif cfg.is_moe:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    return out
