"""The decoder: one model definition for the engine and the learner, for every supported family.

Qwen3 (q/k norm), Qwen3-MoE (q/k norm, mixture-of-experts blocks, `moe.py`), Qwen2 (q/k/v biases),
Qwen2-MoE, Llama 3, Mistral, Mixtral, Gemma 2/3, OLMo 2/3, Phi-3 and SmolLM3 differ only in the
switches of their `ModelConfig`; RoPE and its scalings (llama3, YaRN, linear, longrope; partial
rotary) are fixed tables from `rope.py`.
Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...; MoE experts
stacked as in transformers 5).
Every reduction goes through the `Kernels` bundle chosen at construction (`aligned` or `standard`);
the model code does not know which one it runs on. A forward also leaves each MoE layer's routing
behind (`last_routing`, `last_router_logits`) for the engine to record and the learner to compare.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as recomputed

from ..dtypes import COMPUTE_DTYPES
from ..errors import ConfigError, InputError
from ..hardware import check_device
from ..ops import Kernels, check_backend, get_kernels
from ..signals import import_held
from .batch import ForwardBatch
from .checkpoint import save_pretrained
from .config import ModelConfig
from .fused import FusedView, adjacent, share_storage
from .kv_cache import KVCache
from .layers import Backbone
from .logprobs import soft_cap
from .moe import SparseMoE
from .rope import rope_tables
from .tied import TiedGradient, TiedHead, TiedLookup
from .weights import Weight


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


DEFAULT_BLOCK_SIZE = 32
"""Attention key-block size = KV-cache page size (the aligned kernel reduces keys in these)."""


class Model(nn.Module):
    """Causal LM of any supported family. `kernels` is 'aligned' or 'standard'; weights live in `dtype`."""

    check_inputs: bool = True
    """`forward` checks its token ids and positions on the CPU (on a GPU that would sync every forward;
    the engine and `sequence_logprobs` check their input first). `parity compile`, which counts the
    host syncs a GPU forward would make, turns it off on its CPU-tensor models."""

    def __init__(self, config: ModelConfig, kernels: str = "aligned",
                 dtype: torch.dtype = torch.float32, seed: int | None = 0,
                 block_size: int = DEFAULT_BLOCK_SIZE, device: torch.device | str | None = None):
        super().__init__()
        if not isinstance(config, ModelConfig):  # (an AttributeError deep in the build)
            raise ConfigError(f"Model needs a ModelConfig (e.g. ModelConfig.preset('tiny')), got "
                              f"{type(config).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed < 1 << 63):
            raise ConfigError(f"Model seed must be an integer in 0..2**63-1 or None, got {seed!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 \
                or block_size % 16:
            raise ConfigError(f"block_size must be a positive multiple of 16, got {block_size!r}")
        if isinstance(dtype, str) and dtype in COMPUTE_DTYPES:  # ("bfloat16" was refused, naming itself)
            dtype = COMPUTE_DTYPES[dtype]
        if dtype not in (*COMPUTE_DTYPES.values(), torch.float64):  # float64: references, tests
            raise ConfigError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)} (or float64 for "
                              f"references), got {dtype!r}")
        device = check_device(device)
        config.__post_init__()  # again: fields set after construction are checked before the build
        self.config = config
        self._backend = check_backend(kernels)
        self.block_size = block_size
        self._fused_cache: dict = {}
        try:
            self.model = Backbone(config)
            if not config.tie_word_embeddings:
                self.lm_head = Weight(config.vocab_size, config.hidden_size)
        except (RuntimeError, MemoryError, TypeError, OverflowError) as exc:  # sizes no memory holds
            # (was the allocator's error), or past torch's int64 shapes (10^30 heads: a TypeError)
            if isinstance(exc, TypeError) and "overflow" not in str(exc).lower():
                raise  # (a bug, not a size)
            raise ConfigError(f"the model this config describes cannot be built here "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        # RoPE tables in float32 (plain attributes, so `.to(dtype)` leaves them alone)
        self.rope_cos, self.rope_sin = rope_tables(config.head_dim, config.rope_theta,
                                                   config.max_position_embeddings, config.rope_scaling,
                                                   config.rotary_dim)
        self.local_rope = None  # Gemma's and OLMo 3's sliding layers: their own base, never scaled
        if any(config.local_rope(i) for i in range(config.num_hidden_layers)):
            self.local_rope = rope_tables(config.head_dim, config.rope_local_base_freq,
                                          config.max_position_embeddings, None)
        self.last_routing: torch.Tensor | None = None
        self._tied: TiedGradient | None = None  # the last grad-enabled forward's (tied weights)
        self.last_router_logits: list[torch.Tensor] = []
        if seed is not None:
            self.reset_parameters(seed)
        self.to(dtype)
        if device.type != "cpu":
            self.to(device)

    # ------------------------------------------------------------------ parameters
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def kernels(self) -> Kernels:
        """The kernel bundle of this instance's backend for the device its weights are on (the
        aligned backend is Triton kernels on CUDA, the CPU kernels elsewhere)."""
        return get_kernels(self._backend, self.device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int, std: float = 0.02) -> None:
        """Seeded init: N(0, std) projections, biases, routers and embeddings; norms scale by 1 (a
        Gemma norm weight is an offset from 1: zeros)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(0.0 if self.config.gemma else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std))

    def twin(self, kernels: str) -> Model:
        """A second model with these weights on backend `kernels`, on the same device, without a
        second random initialisation (seeded init is serial on the CPU: ~10 s at the 0.6B shape)."""
        other = Model(self.config, kernels=kernels, dtype=self.dtype, seed=None,
                      block_size=self.block_size, device=self.device)
        other.load_state_dict(self.state_dict())
        return other

    @property
    def backend(self) -> str:
        """The name of the kernel backend this instance runs on ('aligned' or 'standard')."""
        return self._backend

    def set_kernels(self, kernels: str) -> Model:
        """Switch this instance to another kernel backend (weights unchanged)."""
        self._backend = check_backend(kernels)
        return self

    # ------------------------------------------------------------------ forward
    def check_tokens(self, tokens: torch.Tensor, where: str = "sequence") -> None:
        """Raise `InputError` for an id outside the vocabulary."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            bad = tokens[(tokens < 0) | (tokens >= self.config.vocab_size)][0].item()
            raise InputError(f"{where}: token id {bad} is outside the vocabulary "
                             f"(vocab_size={self.config.vocab_size})")

    def _check_batch(self, batch: ForwardBatch) -> None:
        self.check_tokens(batch.input_ids, "Model.forward")
        most, pos = self.config.max_position_embeddings, batch.positions
        if pos.numel() and not 0 <= int(pos.min()) <= int(pos.max()) < most:
            raise InputError(f"Model.forward: positions {int(pos.min())}..{int(pos.max())} are outside "
                             f"0..{most - 1} (max_position_embeddings={most})")

    def _fused(self, layer: int, kind: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """Concatenated projection weight (QKV or gate/up): one GEMM instead of several.

        The parts normally share one buffer (`fused.py`), which is then the fused weight itself.
        Otherwise, without autograd the concatenation is cached until a part changes (in-place
        updates bump a tensor's version counter; code that writes through `.data` must call
        `invalidate_fused()`); with autograd it is rebuilt, so gradients reach the parts. Every
        path holds the same values, so the GEMM gives the same bits either way.
        """
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in parts)
        shared = adjacent(parts)
        if shared is not None:
            return FusedView.apply(shared, *parts) if grad else shared
        if grad:
            return torch.cat(parts)
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in parts)
        hit = self._fused_cache.get((layer, kind))
        if hit is None or hit[0] != key:
            hit = (key, torch.cat([p.detach() for p in parts]))
            self._fused_cache[(layer, kind)] = hit
        return hit[1]

    def share_projection_storage(self) -> None:
        """Put each layer's q/k/v (and their biases) and gate/up weights in one buffer each."""
        for layer in self.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            share_storage([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
            if self.config.attention_bias:
                share_storage([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
            if not isinstance(mlp, SparseMoE):
                share_storage([mlp.gate_proj.weight, mlp.up_proj.weight])
        self._fused_cache.clear()

    def _apply(self, fn, recurse=True):
        # `.to(dtype)`, `.to(device)` and the like give every parameter a storage of its own
        super()._apply(fn, recurse)
        if hasattr(self, "_fused_cache"):
            self.share_projection_storage()
        return self

    def invalidate_fused(self) -> None:
        """Drop cached concatenated weights (after writing parameters behind autograd's back)."""
        self._fused_cache.clear()

    def place_rope(self, device: torch.device) -> None:
        """Move the RoPE tables to `device` (plain attributes, which `.to(device)` leaves alone)."""
        if self.rope_cos.device != device:
            self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)
        if self.local_rope is not None and self.local_rope[0].device != device:
            self.local_rope = tuple(t.to(device) for t in self.local_rope)

    def _tied_autograd(self) -> bool:
        weight = self.model.embed_tokens.weight
        return self.config.tie_word_embeddings and torch.is_grad_enabled() and weight.requires_grad

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` [T] -> [T, hidden] (tied weights under autograd: `tied.py`)."""
        weight = self.model.embed_tokens.weight
        if self._tied_autograd():
            self._tied = TiedGradient()
            return TiedLookup.apply(ids, weight, self._tied)
        return F.embedding(ids, weight)

    def _norm(self, K: Kernels, x: torch.Tensor, weight: torch.Tensor, rope=None,
              scale: float = 1.0) -> torch.Tensor:
        """RMSNorm of x by `weight` (then RoPE by rope = (cos, sin)). Gemma and OLMo scale the
        float32 normalised x by the weight in float32, rounded once to x's dtype, as transformers
        computes them (a Gemma weight is an offset: `1 + w`); `scale` multiplies that weight
        (Gemma's query scaling)."""
        eps, dtype = self.config.rms_norm_eps, x.dtype
        if self.config.norms_in_float32:
            acc = torch.promote_types(dtype, torch.float32)  # (float64 stays: references)
            x, weight = x.to(acc), weight.to(acc)
            weight = (weight + 1.0) * scale if self.config.gemma else weight
        out = K.rms_norm(x, weight, eps) if rope is None else K.rms_norm_rope(x, weight, eps, *rope)
        return out.to(dtype)

    def _activation(self, K: Kernels, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's gated activation of a fused [T, 2I] gate/up: SwiGLU, or Gemma's tanh-GELU
        one (element-wise through the backend's `pointwise`, in float32, rounded once)."""
        if not self.config.gemma:
            return K.silu_mul(gate_up)
        half, acc = gate_up.shape[-1] // 2, torch.promote_types(gate_up.dtype, torch.float32)
        gate, up = gate_up[:, :half].to(acc), gate_up[:, half:].to(acc)
        return (K.pointwise(_gelu_tanh, gate) * up).to(gate_up.dtype)

    def forward(self, batch: ForwardBatch, cache: KVCache | None = None,
                recompute: bool = False) -> torch.Tensor:
        """Final-norm hidden states of the batch's new tokens: [T, hidden]. With `recompute` (a
        grad-enabled forward without a cache), activation checkpointing: each layer's activations
        are recomputed in the backward instead of kept (memory per token: one hidden row per
        layer), the forward's values and the gradients unchanged bit for bit."""
        cfg, K = self.config, self.kernels
        device = self.model.embed_tokens.weight.device
        batch = batch.to(device)
        if self.check_inputs and device.type == "cpu":  # (torch's IndexError)
            self._check_batch(batch)
        self.place_rope(device)
        if cache is None and batch.k_index is None:
            raise ValueError("a forward with block tables needs a KV cache")
        t = batch.num_tokens
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bsz, m = batch.q_index.shape
        # token-wise work runs on `token_rows` rows (extra rows are dropped at the end)
        rows = K.token_rows(t, self.model.embed_tokens.weight.dtype)
        norm = functools.partial(self._norm, K)
        x = self._embed(batch.input_ids)
        if cfg.gemma:  # embeddings times sqrt(hidden), the factor rounded to the weights' dtype
            x = x * torch.tensor(cfg.hidden_size ** 0.5, dtype=x.dtype)
        if rows > t:
            x = torch.cat([x, x.new_zeros(rows - t, x.shape[1])])
        positions = batch.positions
        if rows > t:
            positions = torch.cat([positions, positions.new_zeros(rows - t)])
        ropes = {False: (self.rope_cos[positions], self.rope_sin[positions])}  # [rows, D] float32
        if self.local_rope is not None:
            ropes[True] = tuple(t[positions] for t in self.local_rope)
        q_index = batch.q_index
        k_index = batch.k_index
        padded = bsz * m > t  # the [B, M] query layout has padding slots (they point at row t)
        q_pos = batch.q_pos.to(K.index_dtype)  # converted once here, not in every layer's kernel
        if cache is not None:  # per cache group (a window group: the sliding layers' own blocks)
            tables = [batch.block_tables.to(K.index_dtype)]
            where = [cache.locate(batch.slots)]
            if batch.window_tables is not None:
                tables.append(batch.window_tables.to(K.index_dtype))
                where.append(cache.locate(batch.window_slots))
            if len(tables) != cache.num_groups:
                raise ValueError(f"a KV cache of {cache.num_groups} block groups needs as many tables per "
                                 f"sequence, got {len(tables)}")
        def run_layer(i: int, x: torch.Tensor):
            layer = self.model.layers[i]
            att, mlp = layer.self_attn, layer.mlp
            h = x if cfg.olmo else norm(x, layer.input_layernorm.weight)
            projections = (att.q_proj, att.k_proj, att.v_proj)
            w_qkv = self._fused(i, "qkv", [p.weight for p in projections])
            b_qkv = self._fused(i, "qkv_bias", [p.bias for p in projections]) if cfg.attention_bias else None
            qkv = K.linear(h, w_qkv, b_qkv)
            q = qkv[:, :hq * d].reshape(rows, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].reshape(rows, hkv, d)
            v = qkv[:, (hq + hkv) * d:].reshape(rows, hkv, d)
            rope = ropes[cfg.local_rope(i)]
            if cfg.olmo:  # q/k norms over the whole projection, then RoPE per head
                q = K.rope(norm(q.reshape(rows, hq * d), att.q_norm.weight).view(rows, hq, d), *rope)
                k = K.rope(norm(k.reshape(rows, hkv * d), att.k_norm.weight).view(rows, hkv, d), *rope)
            elif cfg.qk_norm:
                q = norm(q, att.q_norm.weight, rope, cfg.query_scale)
                k = norm(k, att.k_norm.weight, rope)
            elif cfg.layer_rope(i):  # (SmolLM3's NoPE layers: no position encoding)
                q, k = K.rope(q, *rope), K.rope(k, *rope)
            # row `t` (a padding row, or an appended zero row) serves as the gather pad target:
            # of q where the query layout is padded, of k and v in the dense (learner) layout
            if rows == t and (padded or cache is None):
                q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
            if rows == t and cache is None:
                k, v = (torch.cat([z, z.new_zeros(1, *z.shape[1:])]) for z in (k, v))
            # [B, M, Hq, D]; without padding slots the layout is the packed order (decode): a view
            q_pad = q[q_index] if padded else q[:t].view(bsz, m, hq, d)
            spec = dict(window=cfg.layer_window(i), softcap=cfg.attn_logit_softcapping or 0.0,
                        scale=cfg.attention_scale)
            if cache is None:
                o = K.attention(q_pad, k[k_index], v[k_index], q_pos, self.block_size, **spec)
            else:
                group = cache.group_of[i]
                cache.write(i, where[group], k[:t], v[:t])  # new keys enter the cache first
                o = K.paged_attention(q_pad, cache.k[i], cache.v[i], tables[group], q_pos, **spec)
            o = o.reshape(bsz * m, hq * d)  # back to packed [T, Hq*D]
            if padded:
                o = o[batch.out_index]
            if rows > t:
                o = torch.cat([o, o.new_zeros(rows - t, o.shape[1])])
            o = K.linear(o, att.o_proj.weight)
            if cfg.gemma or cfg.olmo:
                x = x + norm(o, layer.post_attention_layernorm.weight)
                h = norm(x, layer.pre_feedforward_layernorm.weight) if cfg.gemma else x
            else:
                x = x + o
                h = norm(x, layer.post_attention_layernorm.weight)
            if isinstance(mlp, SparseMoE):  # the real tokens only: padding rows would take expert slots
                out, experts, logits = mlp.run(K, h[:t])
                out = torch.cat([out, out.new_zeros(rows - t, out.shape[1])]) if rows > t else out
                return x + out, experts, logits
            gate_up = K.linear(h, self._fused(i, "gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight]))
            out = K.linear(self._activation(K, gate_up), mlp.down_proj.weight)
            if cfg.gemma or cfg.olmo:
                out = norm(out, layer.post_feedforward_layernorm.weight)
            return x + out, None, None

        # recompute: each layer keeps only its input for the backward and runs again there (the
        # same kernels on the same rows: the same bits, so the same gradients, bit for bit)
        recompute = recompute and cache is None and torch.is_grad_enabled()
        if recompute:  # (torch's checkpoint imports torch._dynamo, and so Triton, at its first call)
            import_held("torch._dynamo")
        routing, router_logits = [], []
        for i in range(len(self.model.layers)):
            x, experts, logits = (recomputed(run_layer, i, x, use_reentrant=False, preserve_rng_state=False)
                                  if recompute else run_layer(i, x))
            if experts is not None:
                routing.append(experts)
                router_logits.append(logits)
        # which experts each token went to, per MoE layer: [T, layers, k] (None for dense models)
        self.last_routing = torch.stack(routing, 1).to(torch.int16) if routing else None
        self.last_router_logits = router_logits
        return norm(x, self.model.norm.weight)[:t]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [N, vocab] in the model dtype (soft-capped where the family caps them)."""
        if self._tied_autograd() and self._tied is not None:
            z = TiedHead.apply(hidden, self.lm_head_weight, self.kernels.linear, self._tied)
        else:
            z = self.kernels.linear(hidden, self.lm_head_weight)
        return self.cap_logits(z)

    def cap_logits(self, z: torch.Tensor) -> torch.Tensor:
        """Gemma's final soft-cap c * tanh(z / c) of LM-head logits (`logprobs.soft_cap`); z itself
        for the other families."""
        return soft_cap(self.kernels, z, self.config.final_logit_softcapping)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
        """float32 `log softmax(logits / T)[target]` for each hidden row. [N, H], [N] -> [N]"""
        return self.kernels.token_logprobs(self.logits(hidden), targets, temperature)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path) -> None:
        """Write `config.json` + `model.safetensors` (Hugging Face names) into directory `path`."""
        save_pretrained(self, path)
