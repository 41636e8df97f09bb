"""Checkpoint tensor names: the files' spelling and the model's, per family.

Checkpoint files name MoE experts one by one (`mlp.experts.<e>.gate_proj.weight`, as on the Hub;
Mixtral's under `block_sparse_moe` as w1/w3/w2); in memory parity keeps each layer's experts
stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], as
transformers 5 does): `tensors_from_files` and `tensors_to_files` convert.
"""

from __future__ import annotations

import functools
import re

import torch

from ..errors import ConfigError
from .config import ModelConfig

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
            (".w2.", ".down_proj."))


def _mixtral_name(name: str, to_hub: bool) -> str:
    """A Mixtral tensor name between the Hub's spelling (`block_sparse_moe`, w1/w3/w2) and the one
    parity's MoE code reads (`mlp`, gate/up/down_proj; a Mixtral has no dense MLP to confuse)."""
    for hub, ours in _MIXTRAL:
        name = name.replace(ours, hub) if to_hub else name.replace(hub, ours)
    return name


def file_name(cfg: ModelConfig, name: str) -> str:
    """A tensor's name as the checkpoint file spells it (for messages: Mixtral's `block_sparse_moe`)."""
    return _mixtral_name(name, to_hub=True) if cfg.model_type == "mixtral" else name


def tensors_from_files(cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                       where: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under the model's own names: per-expert MoE weights are stacked."""
    if not cfg.is_moe:
        return tensors
    if cfg.model_type == "mixtral":
        named = {_mixtral_name(n, to_hub=False): t for n, t in tensors.items()}
        if len(named) < len(tensors):  # (both spellings of one tensor: one would silently win)
            raise ConfigError(f"{where}: a Mixtral tensor is stored under both its Hub and mlp names")
        tensors = named
    out, experts = {}, {}
    shown = functools.partial(file_name, cfg)
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    for prefix, parts in experts.items():
        for kind, shape in shapes.items():
            have = parts.get(kind, {})
            absent = [e for e in range(cfg.num_experts) if e not in have]
            if absent:
                raise ConfigError(f"{where}: missing tensor {shown(f'{prefix}.{absent[0]}.{kind}.weight')}")
            extra = sorted(e for e in have if e >= cfg.num_experts)
            if extra:
                raise ConfigError(f"{where}: unexpected tensor {shown(f'{prefix}.{extra[0]}.{kind}.weight')} "
                                  f"(config.json: num_experts={cfg.num_experts})")
            for e, t in sorted(have.items()):
                if tuple(t.shape) != shape:
                    raise ConfigError(f"{where}: tensor {shown(f'{prefix}.{e}.{kind}.weight')} has shape "
                                      f"{tuple(t.shape)}, config.json implies {shape}")
        if f"{prefix}.gate_up_proj" in out or f"{prefix}.down_proj" in out:  # (one silently won)
            raise ConfigError(f"{where}: {prefix} is stored both stacked and expert by expert")
        stack = {k: torch.stack([parts[k][e] for e in range(cfg.num_experts)]) for k in parts}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


def tensors_to_files(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint names the Hub and `transformers` use."""
    if not cfg.is_moe:
        return state
    out, inter = {}, cfg.moe_intermediate_size
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return {_mixtral_name(n, to_hub=True): t for n, t in out.items()} if cfg.model_type == "mixtral" else out
