"""Parameter holders under Hugging Face's state-dict names: a `weight` (and `bias`) module, and the
SwiGLU MLP's three projections (the dense layers' MLP and Qwen2-MoE's shared expert)."""

from __future__ import annotations

import torch
from torch import nn


class Weight(nn.Module):
    """A module holding one `weight` parameter (and a `bias`), so state-dict names match HF's."""

    def __init__(self, *shape: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))
        self.bias = nn.Parameter(torch.empty(shape[0])) if bias else None


class MLP(nn.Module):
    """`gate_proj`, `up_proj` [width, hidden] and `down_proj` [hidden, width]."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = Weight(width, hidden)
        self.up_proj = Weight(width, hidden)
        self.down_proj = Weight(hidden, width)
