"""Hugging Face-compatible checkpoints: `config.json` (Qwen3 fields) + `model.safetensors`.

What `parity` saves loads in `transformers` as `Qwen3ForCausalLM`, and a local Qwen3 checkpoint
(one safetensors file, or several with an index) loads here. Names and shapes are checked
against the config before any weight is copied, so a bad file is refused, never half-loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from .config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_pretrained(model, path: str | Path) -> None:
    """Write `config.json` and `model.safetensors` into directory `path` (created if needed)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if not files[0].exists() and index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: weights file not found")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({exc})") from None
    return tensors


def load_model(path: str | Path, kernels: str = "aligned", dtype: torch.dtype | None = None,
               block_size: int | None = None):
    """Load a `parity` or Hugging Face Qwen3 checkpoint directory."""
    from .qwen3 import DEFAULT_BLOCK_SIZE, Model

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    try:
        config = ModelConfig.from_json(path / "config.json")
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    raw = json.loads((path / "config.json").read_text())
    if dtype is None:
        dtype = _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype") or "float32"), torch.float32)
        dtype = torch.float32 if dtype == torch.float16 else dtype
    tensors = _read_tensors(path)
    model = Model(config, kernels=kernels, dtype=dtype, seed=None,
                  block_size=block_size or DEFAULT_BLOCK_SIZE)
    expected = model.state_dict()
    weights_file = path / "model.safetensors"
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{weights_file}: missing tensor {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{weights_file}: unexpected tensor {unexpected[0]} for this config")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{weights_file}: tensor {name} has shape {tuple(got.shape)}, "
                                  f"config.json implies {tuple(want.shape)}")
        if not torch.isfinite(got.float()).all():
            raise CheckpointError(f"{weights_file}: tensor {name} contains NaN or inf")
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
    return model
