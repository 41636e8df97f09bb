"""`ModelConfig`: the Qwen3-style decoder's shape, validated on construction, HF-compatible."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

_PRESETS: dict[str, dict[str, Any]] = {
    # unit tests: runs a forward in a few milliseconds
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    # demos and benchmarks: ~5M parameters, learns small tasks on 2 cores in minutes
    "small": dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
"""Named model shapes `ModelConfig.preset` builds."""


@dataclass
class ModelConfig:
    """Shape of a Qwen3-style dense decoder (field names follow Hugging Face `Qwen3Config`)."""

    vocab_size: int = 128
    """Number of token ids; every id fed to the model must be below it."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 128
    """Width of the SwiGLU MLP."""
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
    tie_word_embeddings: bool = True
    """Share the input embedding matrix with the LM head."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if the tokenizer has one (informational)."""
    eos_token_id: int | None = None
    """End-of-sequence id, if the tokenizer has one (the engine stops on it)."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Fields of a loaded config.json that parity does not use, kept so a save round-trips."""

    def __post_init__(self) -> None:
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"ModelConfig.num_attention_heads={self.num_attention_heads} does not divide "
                    f"hidden_size={self.hidden_size} (set head_dim explicitly)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ConfigError(f"ModelConfig.head_dim must be a positive integer, got {self.head_dim!r}")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"ModelConfig.num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ConfigError(f"ModelConfig.{name}={value!r} is not a token id below vocab_size")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset ('tiny' or 'small'), optionally with fields overridden."""
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

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` a Hugging Face Qwen3 model loads."""
        out = {**self.extra}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        out.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu",
                   attention_bias=False, attention_dropout=0.0, use_sliding_window=False)
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Load a Qwen3 `config.json`; HF-only fields are kept in `extra`."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        model_type = data.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ConfigError(f"{path}: model_type {model_type!r} is not supported (only 'qwen3')")
        if data.get("attention_bias"):
            raise ConfigError(f"{path}: attention_bias=true is not supported")
        try:
            return cls.from_dict(data, strict=False)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        hq, hkv = self.num_attention_heads, self.num_key_value_heads
        layer = h * d * (hq + 2 * hkv) + hq * d * h + 3 * h * i + 2 * h + 2 * d
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h
