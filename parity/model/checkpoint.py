"""Hugging Face-compatible checkpoint files: `config.json` + `model.safetensors` (or shards).

`save_pretrained` writes what `transformers` loads back as the model's family (tensor names as on
the Hub: `tensor_names.tensors_to_files`); `read_tensors` reads one safetensors file or an index of
shards, with one-line errors for missing or corrupt files. Building a model from a directory is
`loading.load_model`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError
from .families import config_to_hf
from .files import read_json, regular_file
from .tensor_names import tensors_to_files


def _own(t: torch.Tensor):
    """`t` itself when it owns its storage, else a contiguous copy."""
    whole = t.is_contiguous() and t.storage_offset() == 0 \
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def save_pretrained(model, path: str | Path) -> None:
    """Write `config.json` and `model.safetensors` into directory `path` (created if needed)."""
    from safetensors.torch import save_file

    if not isinstance(path, (str, Path)) or not str(path).strip():  # ("" wrote into the working directory)
        raise CheckpointError(f"save_pretrained: path must name a directory, got {path!r}")
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be made a checkpoint directory "
                              f"({exc.strerror or exc})") from None
    cfg = config_to_hf(model.config)
    cfg["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    # q/k/v and gate/up share one buffer per layer in memory (`fused.py`): safetensors stores
    # tensors that own their memory, so those are copied out (one tensor at a time)
    state = {k: _own(v.detach().cpu()) for k, v in model.state_dict().items()}
    tensors = tensors_to_files(model.config, state)
    tmp = path / "model.safetensors.tmp"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    except Exception as exc:  # safetensors reports I/O failures (a full disk) as its own error type
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{tmp.parent}: could not write model.safetensors "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    try:
        tmp.replace(path / "model.safetensors")
        (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise CheckpointError(f"{path}: could not write the checkpoint ({exc.strerror or exc})") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if not files[0].exists() and index.exists():
        try:
            weight_map = read_json(index)["weight_map"]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names, "
                                  f"got {type(weight_map).__name__}")
        for name, file in weight_map.items():  # shards lie beside the index, nowhere else
            if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
                raise CheckpointError(f"{index}: tensor {name} maps to {file!r}, not a file name in "
                                      f"{path}")
        files = [path / name for name in sorted(set(weight_map.values()))]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            pickled = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                       if (path / n).exists()]
            raise CheckpointError(f"{f}: weights file not found" + (
                f" ({pickled[0]} is there: parity reads safetensors only; resave with transformers' "
                "save_pretrained, which writes them)" if pickled else ""))
        regular_file(f, 1 << 50)  # (a FIFO hung load_file for good, through SIGTERM)
        try:
            shard = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({exc})") from None
        twice = sorted(set(shard) & set(tensors))
        if twice:  # (the later shard's silently won)
            raise CheckpointError(f"{f}: tensor {twice[0]} is also in another shard")
        tensors.update(shard)
    return tensors
