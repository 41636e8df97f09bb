"""The mixture-of-experts block (Qwen3-MoE, Mixtral, Qwen2-MoE): a router and `num_experts` SwiGLU
experts (Qwen2-MoE adds a shared expert every token goes through, gated by a sigmoid).

Each token goes to its top-k experts; the block's output is the routing-weighted sum of those
experts' outputs. Routing (softmax, top-k with a fixed tie-break), the experts (`moe_experts`:
each expert runs one GEMM chain over the tokens routed to it) and the final sum (a fixed order over
the k ranks) come from the kernel bundle. With aligned kernels a row's result does not depend on
how many rows the GEMM has (small GEMMs padded or computed in the GEMM's order, as everywhere), so
a token's expert outputs do not depend on how many other tokens chose the same expert, nor on the
batch, padding or chunking around it.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .weights import MLP, Weight


class Experts(nn.Module):
    """Every expert's weights, stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))


class SparseMoE(nn.Module):
    """`mlp.gate` (the router) and `mlp.experts`, under Hugging Face's names; for qwen2_moe also
    `mlp.shared_expert` and `mlp.shared_expert_gate`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.float32_weights = cfg.model_type == "mixtral"
        """Weigh expert outputs by float32 routing weights, rounding each product once, as
        transformers 5 does for Mixtral (for the Qwen MoEs it rounds the weights to the model's
        dtype first, and so does parity)."""
        self.inter = cfg.moe_intermediate_size
        if cfg.shared_expert_intermediate_size:
            h = cfg.hidden_size  # qwen2_moe: `mlp.shared_expert.*_proj` and `mlp.shared_expert_gate`
            self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Weight(1, h)

    def run(self, kernels, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, H] -> (output [T, H], expert ids [T, k], router logits [T, E])."""
        logits = kernels.linear(h, self.gate.weight)
        weights, idx = kernels.moe_route(logits, self.top_k, self.normalize)
        t, k = idx.shape
        parts = kernels.moe_experts(h, idx, self.experts.gate_up_proj, self.experts.down_proj)
        weights = weights if self.float32_weights else weights.to(h.dtype)
        parts = (parts.view(t, k, -1) * weights.unsqueeze(-1)).to(h.dtype)
        out = kernels.moe_combine(parts)
        if hasattr(self, "shared_expert"):  # every token's shared expert, gated by a sigmoid (on CPUs a
            # vector tail's sigmoid differs: `pointwise` keeps every element on one path), added last
            s = self.shared_expert
            act = kernels.silu_mul(torch.cat([kernels.linear(h, s.gate_proj.weight),
                                              kernels.linear(h, s.up_proj.weight)], dim=-1))
            gate = kernels.pointwise(torch.sigmoid, kernels.linear(h, self.shared_expert_gate.weight))
            out = out + gate * kernels.linear(act, s.down_proj.weight)
        return out, idx, logits
