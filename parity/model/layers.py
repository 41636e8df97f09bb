"""The decoder's modules: attention and MLP weights per layer, and the backbone holding them.

Parameter containers only, under Hugging Face's state-dict names (`model.layers.0.self_attn.q_proj
.weight`, ...); which ones a layer has follows the config's family switches. The forward pass,
the same for every family, is `decoder.Model.forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .moe import SparseMoE
from .weights import MLP, Weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = Weight(cfg.num_attention_heads * d, cfg.hidden_size, bias=bias)
        self.k_proj = Weight(cfg.num_key_value_heads * d, cfg.hidden_size, bias=bias)
        self.v_proj = Weight(cfg.num_key_value_heads * d, cfg.hidden_size, bias=bias)
        self.o_proj = Weight(cfg.hidden_size, cfg.num_attention_heads * d)
        if cfg.qk_norm:  # per head, or (OLMo) over the whole projection
            self.q_norm = Weight(cfg.num_attention_heads * d if cfg.olmo else d)
            self.k_norm = Weight(cfg.num_key_value_heads * d if cfg.olmo else d)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg.hidden_size, cfg.intermediate_size)
        if not cfg.olmo:  # (OLMo norms each block's output only)
            self.input_layernorm = Weight(cfg.hidden_size)
        self.post_attention_layernorm = Weight(cfg.hidden_size)  # (Gemma, OLMo: on the attention's output)
        if cfg.gemma:  # sandwich norms: before the MLP too
            self.pre_feedforward_layernorm = Weight(cfg.hidden_size)
        if cfg.gemma or cfg.olmo:
            self.post_feedforward_layernorm = Weight(cfg.hidden_size)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # not drawn here: `reset_parameters` (or a checkpoint) sets every weight, and nn.Embedding's
        # own N(0, 1) draw would cost ~1-3 s of the 0.6B shape's seeded construction. (Not
        # nn.utils.skip_init: its meta device costs each new process over a second of imports.)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Weight(cfg.hidden_size)
