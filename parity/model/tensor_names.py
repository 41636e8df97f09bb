"""Checkpoint tensor names: the files' spelling and the model's, per family.

Phi-3's files fuse each layer's q/k/v projections (`self_attn.qkv_proj`) and its gate/up ones
(`mlp.gate_up_proj`); parity cuts them apart on load and fuses them again on save (row blocks of
one weight: exact both ways).

A head that RoPE rotates only in part (Phi-4-mini) keeps its q and k dimensions in memory in
`rope.rotary_order` (rows of q_proj and k_proj reordered on load, put back on save: exact).

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
from .rope import rotary_order

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
    """A tensor's name as the checkpoint file spells it (for messages: Mixtral's `block_sparse_moe`,
    Phi-3's fused `qkv_proj` and `gate_up_proj`)."""
    if cfg.model_type == "phi3":
        return re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name))
    return _mixtral_name(name, to_hub=True) if cfg.model_type == "mixtral" else name


_PHI3_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
"""Phi-3's files fuse these projections (rows in this order); parity keeps them apart."""


def _phi3_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    d = cfg.head_dim
    if fused == "self_attn.qkv_proj":
        return [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _phi3_split(cfg: ModelConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Phi-3's fused projections cut into the model's (row blocks of one weight: exact)."""
    out = {}
    for name, t in tensors.items():
        prefix, _, rest = name.rpartition(".layers.")
        layer, _, proj = rest.partition(".")
        fused = proj.removesuffix(".weight")
        if not prefix or fused not in _PHI3_FUSED or not proj.endswith(".weight"):
            out[name] = t
            continue
        sizes = _phi3_sizes(cfg, fused)
        if t.dim() != 2 or t.shape != (sum(sizes), cfg.hidden_size):
            raise ConfigError(f"{where}: tensor {name} has shape {tuple(t.shape)}, config.json implies "
                              f"{(sum(sizes), cfg.hidden_size)}")
        parts = [f"{prefix}.layers.{layer}.{part}.weight" for part in _PHI3_FUSED[fused]]
        if any(p in tensors for p in parts):  # (one of the two would silently win)
            raise ConfigError(f"{where}: {name} is stored both fused and as its parts")
        out.update(zip(parts, (block.contiguous() for block in t.split(sizes))))
    return out


def _phi3_fuse(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's projections fused as Phi-3's files hold them."""
    out = dict(state)
    for i in range(cfg.num_hidden_layers):
        for fused, parts in _PHI3_FUSED.items():
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            out[f"model.layers.{i}.{fused}.weight"] = torch.cat([out.pop(n) for n in names])
    return out


_QK = re.compile(r"\.self_attn\.[qk]_proj\.weight$")


def _rotary_rows(cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                 to_files: bool) -> dict[str, torch.Tensor]:
    """Each head's q and k rows into `rotary_order` (or back, `to_files`) when only part rotates."""
    d = cfg.head_dim
    if cfg.rotary_dim == d:
        return tensors
    order = rotary_order(d, cfg.rotary_dim)
    order = torch.argsort(order) if to_files else order
    out = dict(tensors)
    for name, t in tensors.items():
        if _QK.search(name) and t.dim() == 2 and t.shape[0] % d == 0:  # (else: a shape error on load)
            out[name] = t.reshape(t.shape[0] // d, d, t.shape[1])[:, order].reshape(t.shape)
    return out


_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def text_model_tensors(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Gemma 3 image-text files' language-model tensors under a causal LM's names
    (`language_model.model.*`, as transformers writes them, or `model.language_model.*`, as it
    holds them, become `model.*`); the vision tower's and the projector's are left out."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(_IMAGE_PREFIXES):
            continue
        ours = next((new + name[len(old):] for old, new in _TEXT_PREFIXES if name.startswith(old)), name)
        if ours in out:  # (one of the two would silently win)
            raise ConfigError(f"{where}: tensor {ours} is stored under two names")
        out[ours] = t
    return out


def tensors_from_files(cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                       where: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under the model's own names: per-expert MoE weights are stacked, Phi-3's
    fused projections cut apart."""
    if cfg.model_type == "phi3":
        return _rotary_rows(cfg, _phi3_split(cfg, tensors, where), to_files=False)
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
    if cfg.model_type == "phi3":
        return _phi3_fuse(cfg, _rotary_rows(cfg, state, to_files=True))
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
