"""The Qwen3-style decoder: one model definition for the engine and the learner.

Parameter names are Hugging Face Qwen3's (`model.layers.0.self_attn.q_proj.weight`, ...), so the
state dict is a valid HF checkpoint. Every reduction goes through the `Kernels` bundle chosen at
construction (`aligned` or `standard`); the model code does not know which one it runs on.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from ..ops import get_kernels
from .batch import ForwardBatch
from .config import ModelConfig
from .kv_cache import KVCache

DEFAULT_BLOCK_SIZE = 32
"""Attention key-block size = KV-cache page size (the aligned kernel reduces keys in these)."""


class _Weight(nn.Module):
    """A module holding one `weight` parameter, so state-dict names match HF's."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.head_dim
        self.q_proj = _Weight(cfg.num_attention_heads * d, cfg.hidden_size)
        self.k_proj = _Weight(cfg.num_key_value_heads * d, cfg.hidden_size)
        self.v_proj = _Weight(cfg.num_key_value_heads * d, cfg.hidden_size)
        self.o_proj = _Weight(cfg.hidden_size, cfg.num_attention_heads * d)
        self.q_norm = _Weight(d)
        self.k_norm = _Weight(d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = _Weight(cfg.intermediate_size, cfg.hidden_size)
        self.up_proj = _Weight(cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _Weight(cfg.hidden_size, cfg.intermediate_size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = _Weight(cfg.hidden_size)
        self.post_attention_layernorm = _Weight(cfg.hidden_size)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _Weight(cfg.hidden_size)


class Model(nn.Module):
    """Qwen3-style causal LM. `kernels` is 'aligned' or 'standard'; weights live in `dtype`."""

    def __init__(self, config: ModelConfig, kernels: str = "aligned",
                 dtype: torch.dtype = torch.float32, seed: int | None = 0,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__()
        self.config = config
        self.kernels = get_kernels(kernels)
        self.block_size = block_size
        self.model = Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = _Weight(config.vocab_size, config.hidden_size)
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.arange(config.max_position_embeddings, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        # RoPE tables in float32 (plain attributes, so `.to(dtype)` leaves them alone), computed
        # once: a position's rotation never depends on the batch
        self.rope_cos = angles.cos().float()
        self.rope_sin = angles.sin().float()
        if seed is not None:
            self.reset_parameters(seed)
        self.to(dtype)

    # ------------------------------------------------------------------ parameters
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int, std: float = 0.02) -> None:
        """Seeded init: N(0, std) projections and embeddings, ones for norms."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def set_kernels(self, kernels: str) -> Model:
        """Switch this instance to another kernel backend (weights unchanged)."""
        self.kernels = get_kernels(kernels)
        return self

    # ------------------------------------------------------------------ forward
    def check_tokens(self, tokens: torch.Tensor, where: str = "sequence") -> None:
        """Raise `InputError` for an id outside the vocabulary."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            bad = tokens[(tokens < 0) | (tokens >= self.config.vocab_size)][0].item()
            raise InputError(f"{where}: token id {bad} is outside the vocabulary "
                             f"(vocab_size={self.config.vocab_size})")

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def forward(self, batch: ForwardBatch, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states of the batch's new tokens: [T, hidden]."""
        cfg, K = self.config, self.kernels
        if cache is None and batch.k_index is None:
            raise ValueError("a forward with block tables needs a KV cache")
        t = batch.num_tokens
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bsz, m = batch.q_index.shape
        x = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            att = layer.self_attn
            h = K.rms_norm(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
            q = K.linear(h, att.q_proj.weight).view(t, hq, d)
            k = K.linear(h, att.k_proj.weight).view(t, hkv, d)
            v = K.linear(h, att.v_proj.weight).view(t, hkv, d)
            q = self._rope(K.rms_norm(q, att.q_norm.weight, cfg.rms_norm_eps), batch.positions)
            k = self._rope(K.rms_norm(k, att.k_norm.weight, cfg.rms_norm_eps), batch.positions)
            q_pad = torch.cat([q, q.new_zeros(1, hq, d)])[batch.q_index]  # [B, M, Hq, D]
            if cache is None:
                k_ctx = torch.cat([k, k.new_zeros(1, hkv, d)])[batch.k_index]  # [B, L, Hkv, D]
                v_ctx = torch.cat([v, v.new_zeros(1, hkv, d)])[batch.k_index]
            else:
                cache.write(i, batch.slots, k, v)  # new keys enter the cache before attending
                k_ctx, v_ctx = cache.gather(i, batch.block_tables)
            o = K.attention(q_pad, k_ctx, v_ctx, batch.q_pos, self.block_size)
            o = o.reshape(bsz * m, hq * d)[batch.out_index]  # back to packed [T, Hq*D]
            x = x + K.linear(o, att.o_proj.weight)
            h = K.rms_norm(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            mlp = layer.mlp
            act = K.silu_mul(K.linear(h, mlp.gate_proj.weight), K.linear(h, mlp.up_proj.weight))
            x = x + K.linear(act, mlp.down_proj.weight)
        return K.rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [N, vocab] in the model dtype."""
        return self.kernels.linear(hidden, self.lm_head_weight)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
        """float32 `log softmax(logits / T)[target]` for each hidden row. [N, H], [N] -> [N]"""
        return self.kernels.token_logprobs(self.logits(hidden), targets, temperature)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path) -> None:
        from .checkpoint import save_pretrained

        save_pretrained(self, path)
