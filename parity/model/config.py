"""`ModelConfig`: a decoder's shape and family, validated on construction, HF-compatible names.

One decoder definition serves every family; they differ in a few switches:

| model_type | q/k norm | q/k/v bias | MLP                 | RoPE                  |
|------------|----------|------------|---------------------|-----------------------|
| qwen3      | yes      | no         | SwiGLU              | default               |
| qwen3_moe  | yes      | no         | top-k mixture of SwiGLU experts | default   |
| qwen2      | no       | yes        | SwiGLU              | default               |
| llama      | no       | no         | SwiGLU              | llama3 (Llama 3.1+)   |
| mistral    | no       | no         | SwiGLU              | default               |
| mixtral    | no       | no         | top-k mixture in every layer    | default   |
| qwen2_moe  | no       | yes        | top-k mixture + gated shared expert | default |
| gemma2     | no       | no         | GeGLU (tanh GELU)   | default               |
| gemma3_text| yes      | no         | GeGLU (tanh GELU)   | local / global bases  |
| olmo2      | whole q/k| no         | SwiGLU              | default               |
| olmo3      | whole q/k| no         | SwiGLU              | sliding layers unscaled |
| phi3       | no       | no         | SwiGLU              | longrope, partial     |
| smollm3    | no       | no         | SwiGLU              | none on NoPE layers   |

Gemma 3 (text: Gemma3ForCausalLM, the 270M and 1B checkpoints) also scales its embeddings by
sqrt(hidden_size), stores every RMSNorm weight as an offset from 1 (applied as `1 + w` in float32),
norms each block's output before the residual add (`post_attention_layernorm`,
`post_feedforward_layernorm`; `pre_feedforward_layernorm` before the MLP), scales attention by
`query_pre_attn_scalar ** -0.5`, and gives its sliding layers RoPE of another base
(`rope_local_base_freq`), never scaled. OLMo 2 and OLMo 3 norm each block's output only (no norm
before attention or the MLP: `post_attention_layernorm`, `post_feedforward_layernorm`) and norm q
and k over the whole projection, every head at once, before RoPE; OLMo 3 slides three layers of
four, their RoPE never scaled. Gemma's and OLMo's norms multiply by their weight in float32 and
round once, as transformers computes them. Gemma 2 is Gemma 3's block without q/k norms, its
sliding layers on the same RoPE as the full ones, and it soft-caps attention scores and the final
logits: c * tanh(x / c) (`attn_logit_softcapping`, `final_logit_softcapping`).

SmolLM3 rotates only the layers `no_rope_layers` marks 1 (every fourth layer has no position
encoding at all: NoPE); when it slides, the NoPE layers do.

Any family but Phi-3 may scale RoPE (`linear`, `llama3` or `yarn`: `rope.py`), as transformers
allows; Phi-3 scales by `longrope` alone, and may rotate only part of each head
(`partial_rotary_factor`, Phi-4-mini).

Reading a Hugging Face `config.json` (and refusing what parity does not honour) is
`families.config_from_hf`; writing one is `families.config_to_hf`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..fields import check_fields, known_keywords
from .config_checks import check_family_fields, check_moe, check_windows
from .presets import PRESETS as _PRESETS
from .rope import check_rope_scaling

MODEL_TYPES: tuple[str, ...] = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "mixtral", "qwen2_moe",
                                "gemma2", "gemma3_text", "olmo2", "olmo3", "phi3", "smollm3")
"""Decoder families parity builds."""


PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
"""Named model shapes `ModelConfig.preset` builds."""


@known_keywords()
@dataclass
class ModelConfig:
    """Shape of a decoder (field names follow Hugging Face's configs)."""

    vocab_size: int = 128
    """Number of token ids; every id fed to the model must be below it."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 128
    """Width of the dense SwiGLU MLP."""
    num_hidden_layers: int = 2
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide `num_attention_heads`."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads (which must divide)."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + completion) the model accepts."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    partial_rotary_factor: float = 1.0
    """phi3 (Phi-4-mini: 0.75): the share of each head's dimensions RoPE rotates, the first
    int(head_dim * factor); the rest pass through (`rope.py`). 1: every dimension."""
    tie_word_embeddings: bool = True
    """Share the input embedding matrix with the LM head."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if the tokenizer has one (informational)."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence id(s): the engine stops on any of them."""
    model_type: str = "qwen3"
    """The family: 'qwen3', 'qwen3_moe', 'qwen2', 'llama', 'mistral', 'mixtral' or 'qwen2_moe' (the
    module docstring)."""
    attention_bias: bool = False
    """q/k/v projections have biases (always for qwen2; qwen2_moe's `qkv_bias`; unsupported elsewhere)."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE frequency scaling, HF names: None, or {"rope_type": "linear" | "llama3" | "yarn" |
    "longrope", "factor", ...} with the fields `rope.py` lists (llama3: low/high_freq_factor and
    original_max_position_embeddings; yarn: original_max_position_embeddings, optional
    attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate; longrope, phi3
    only: short_factor and long_factor, one per rotated pair, original_max_position_embeddings,
    optional factor and attention_factor)."""
    sliding_window: int | None = None
    """The attention window of the sliding layers (HF `sliding_window`): a query there attends to its
    last `sliding_window` positions, itself included. None: every layer attends to the whole prefix."""
    layer_types: list[str] | None = None
    """Per layer, 'full_attention' or 'sliding_attention' (HF `layer_types`). None: every layer
    slides when `sliding_window` is set (Mistral, Mixtral, Qwen3-MoE), else none does. A list
    (qwen2, qwen3, qwen2_moe) names each layer's; a sliding one needs `sliding_window`."""
    query_pre_attn_scalar: float | None = None
    """gemma2, gemma3_text: attention scores are scaled by query_pre_attn_scalar ** -0.5 (None:
    head_dim, the usual 1 / sqrt(head_dim))."""
    attn_logit_softcapping: float | None = None
    """gemma2: attention scores s are capped to c * tanh(s / c) before the softmax, c this value
    (Gemma 2: 50); None: not capped. (Gemma 3's config has the field, which transformers ignores.)"""
    final_logit_softcapping: float | None = None
    """gemma2, gemma3_text: the LM head's logits z are capped to c * tanh(z / c) (Gemma 2: 30),
    in the engine and the learner alike; None: not capped."""
    rope_local_base_freq: float | None = None
    """gemma3_text, olmo3: the RoPE base of the sliding layers, which rotate unscaled (`rope_theta`
    and `rope_scaling` are the full layers'); None: 10000 (Gemma), `rope_theta` (OLMo 3)."""
    no_rope_layers: list[int] | None = None
    """smollm3: per layer, 1 where it rotates q and k (RoPE), 0 where it has no position encoding
    (NoPE); None: transformers' default, every fourth layer NoPE."""
    num_experts: int = 0
    """qwen3_moe, mixtral (HF num_local_experts): experts per MoE layer."""
    num_experts_per_tok: int = 0
    """qwen3_moe, mixtral: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """qwen3_moe, mixtral (HF intermediate_size): width of each expert's SwiGLU MLP."""
    shared_expert_intermediate_size: int = 0
    """qwen2_moe: width of the shared expert every token also goes through, its output weighted by
    sigmoid(`shared_expert_gate`) and added to the experts'."""
    norm_topk_prob: bool = False
    """qwen3_moe: renormalise the top-k routing weights to sum to 1 (mixtral always does)."""
    decoder_sparse_step: int = 1
    """qwen3_moe: layer i has an MoE block when (i + 1) % decoder_sparse_step == 0 ..."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """qwen3_moe: ... and i is not listed here (those layers use the dense MLP)."""
    router_aux_loss_coef: float = 0.0
    """qwen3_moe, mixtral: the checkpoint's load-balancing loss weight (informational; the learner's own
    `LearnerConfig.router_aux_loss_coef` decides, 0 = off)."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Fields of a loaded config.json that parity does not use, kept so a save round-trips."""

    def __post_init__(self) -> None:
        check_fields(self)
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        for name in ints:
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        # (a config.json of 10^8 layers hung the build; 10^12 positions asked for 8 TB of RoPE
        # tables; 2^23 keeps the published 4M-context Llama 3 checkpoints)
        for name, most in (("num_hidden_layers", 1024), ("max_position_embeddings", 1 << 23)):
            if getattr(self, name) > most:
                raise ConfigError(f"ModelConfig.{name} must be at most {most:,}, got {getattr(self, name):,}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"ModelConfig.num_attention_heads={self.num_attention_heads} does not divide "
                    f"hidden_size={self.hidden_size} (set head_dim explicitly)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0:
            raise ConfigError(f"ModelConfig.head_dim must be a positive integer, got {self.head_dim!r}")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"ModelConfig.num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ConfigError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
        if not 0 <= self.router_aux_loss_coef < math.inf:  # (a saved one failed load_model)
            raise ConfigError(f"ModelConfig.router_aux_loss_coef must be >= 0 and finite, "
                              f"got {self.router_aux_loss_coef!r}")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ConfigError(f"ModelConfig.bos_token_id={self.bos_token_id!r} is not a token id "
                              "below vocab_size")
        for value in self.eos_token_ids:
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"ModelConfig.eos_token_id={self.eos_token_id!r} is not a token id "
                                  "(or list of ids) below vocab_size")
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"ModelConfig.model_type {self.model_type!r} is not supported: parity builds "
                              f"{', '.join(MODEL_TYPES)}")
        if self.attention_bias and self.model_type not in ("qwen2", "qwen2_moe"):
            raise ConfigError(f"ModelConfig.attention_bias=true is not supported for {self.model_type}")
        if self.model_type == "qwen2":
            self.attention_bias = True  # Qwen2's q/k/v projections always carry biases
        check_windows(self)
        check_family_fields(self)
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ConfigError(f"ModelConfig.partial_rotary_factor must be in (0, 1], got {f!r}")
        if f != 1 and self.model_type != "phi3":
            raise ConfigError(f"ModelConfig.partial_rotary_factor {f!r} is not supported for "
                              f"{self.model_type}: transformers rotates every head dimension there "
                              "(Phi-3's code alone rotates part)")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"ModelConfig.partial_rotary_factor {f!r} rotates {self.rotary_dim} of "
                              f"head_dim={self.head_dim} dimensions: that must be even and at least 2")
        rs = self.rope_scaling
        kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
        if self.model_type == "phi3" and kind not in (None, "longrope"):  # (transformers' refuses them)
            raise ConfigError(f"ModelConfig.rope_scaling {kind!r} is not supported for phi3: transformers' "
                              "Phi-3 scales by longrope alone")
        if kind == "longrope" and self.model_type != "phi3":
            raise ConfigError(f"ModelConfig.rope_scaling 'longrope' is not supported for {self.model_type}: "
                              "parity honours longrope on phi3 (Phi-3 128k, Phi-3.5, Phi-4-mini), where "
                              "transformers 4 and 5 read it alike")
        self.rope_scaling = check_rope_scaling(rs, self.max_position_embeddings, self.rotary_dim // 2)
        check_moe(self)

    # ------------------------------------------------------------------ family switches
    @property
    def gemma(self) -> bool:
        """Gemma 2's and 3's block: embeddings scaled by sqrt(hidden_size), RMSNorm weights applied
        as 1 + w (in float32), sandwich norms around attention and MLP, a tanh-GELU MLP."""
        return self.model_type in ("gemma2", "gemma3_text")

    @property
    def olmo(self) -> bool:
        """OLMo 2/3's block: no norm before attention or the MLP, each one's output normed before
        the residual add; q and k normed over the whole projection before RoPE."""
        return self.model_type in ("olmo2", "olmo3")

    @property
    def norms_in_float32(self) -> bool:
        """RMSNorm multiplies the float32 normalised x by its weight in float32, rounding once
        (Gemma, OLMo); else the normalised x is rounded to the model dtype, then scaled (Qwen, Llama)."""
        return self.gemma or self.olmo

    @property
    def query_scale(self) -> float:
        """What queries are multiplied by so that the attention kernels' 1/sqrt(head_dim) scaling
        gives the family's: sqrt(head_dim / query_pre_attn_scalar) (1 for all but Gemma 3, whose
        query norm's weight takes it)."""
        if self.query_pre_attn_scalar is None or not self.qk_norm:
            return 1.0
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

    @property
    def attention_scale(self) -> float | None:
        """The factor the attention kernels scale scores by: Gemma 2's query_pre_attn_scalar ** -0.5
        (it has no query norm to take `query_scale`); None (1/sqrt(head_dim)) for the others."""
        return self.query_pre_attn_scalar ** -0.5 if self.model_type == "gemma2" else None

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates by the local table: Gemma's and OLMo 3's sliding layers,
        whose base is `rope_local_base_freq` and whose RoPE is never scaled (even when the bases
        are equal)."""
        return self.rope_local_base_freq is not None and self.layer_window_type(layer) == "sliding_attention"

    def layer_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (all but SmolLM3's NoPE layers)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    def layer_window_type(self, layer: int) -> str:
        """'sliding_attention' or 'full_attention', as `layer_types` (or its default) says."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def layer_window(self, layer: int) -> int:
        """The sliding window of decoder layer `layer`, or 0 where it attends to its whole prefix
        (also when the window is at least the context: no sequence outgrows it)."""
        window = self.sliding_window
        if window is None or window >= self.max_position_embeddings:
            return 0
        return window if self.layer_window_type(layer) == "sliding_attention" else 0

    # ------------------------------------------------------------------ derived
    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE rotates (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every end-of-sequence id (the engine stops on any)."""
        e = self.eos_token_id
        return [] if e is None else list(e) if isinstance(e, (list, tuple)) else [e]

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on queries and keys (the Qwen3 families)."""
        return self.model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2", "olmo3")

    @property
    def is_moe(self) -> bool:
        return self.model_type in ("qwen3_moe", "mixtral", "qwen2_moe")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a mixture-of-experts block instead of the dense MLP."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def forward_flops_per_token(self, context: float = 0.0) -> float:
        """Forward FLOPs (2 per multiply-add) one token costs: the attention projections, the
        MLP (for MoE the router and the k active experts), the LM head, and attention scores
        and values over `context` positions. A learner step (forward + backward) costs 3x."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        macs = float(self.vocab_size * h)  # LM head
        for layer in range(self.num_hidden_layers):
            macs += 2 * h * q + 2 * h * kv + 2 * q * context  # q, o; k, v; QK^T and AV
            if self.is_moe_layer(layer):
                macs += h * self.num_experts + self.num_experts_per_tok * 3 * h * self.moe_intermediate_size
                macs += 3 * h * self.shared_expert_intermediate_size + h  # (qwen2_moe: shared expert, gate)
            else:
                macs += 3 * h * self.intermediate_size
        return 2 * macs

    @property
    def head_flops_per_token(self) -> float:
        """The LM head's share of `forward_flops_per_token` (a position whose logits are not
        needed, such as a prompt's all but last, costs that much less)."""
        return 2.0 * self.vocab_size * self.hidden_size

    # ------------------------------------------------------------------ construction
    def with_context(self, context: int | None) -> ModelConfig:
        """This config serving at most `context` positions (vLLM's max_model_len; None: all of
        them): max_position_embeddings capped, so a longrope model takes its short factors within
        its original context; what RoPE scalings derive from the full context stays."""
        if context is None:
            return self
        if isinstance(context, bool) or not isinstance(context, int) or not 2 <= context:
            raise ConfigError(f"the context must be an integer of at least 2 positions, got {context!r}")
        if context > self.max_position_embeddings:
            raise ConfigError(f"a context of {context:,} positions exceeds the model's "
                              f"max_position_embeddings ({self.max_position_embeddings:,})")
        return dataclasses.replace(self, max_position_embeddings=context)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (`PRESET_NAMES`), optionally with fields overridden."""
        if name not in _PRESETS:
            raise ConfigError(f"unknown model preset {name!r}: expected one of {', '.join(_PRESETS)}")
        return cls.from_dict({**_PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, data: dict[str, Any], strict: bool = True) -> ModelConfig:
        """Build from a dict; unknown keys are errors when `strict`, else kept in `extra`."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown and strict:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in data.items() if k in known}, extra=unknown)

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        hq, hkv = self.num_attention_heads, self.num_key_value_heads
        attn = h * d * (hq + 2 * hkv) + hq * d * h + (2 * d if self.qk_norm else 0)
        attn += d * (hq + 2 * hkv) if self.attention_bias else 0
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for layer in range(self.num_hidden_layers):
            if self.is_moe_layer(layer):
                mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)
            else:
                mlp = 3 * h * i
            total += attn + mlp + (4 if self.gemma else 2) * h
            if self.olmo:  # (its q/k norms span the whole projection)
                total += (hq + hkv) * d - 2 * d
        return total
