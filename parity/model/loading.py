"""Build a model from a checkpoint directory: `parity`'s or Hugging Face's (`config.json` +
safetensors, one file or sharded) of any family `families.py` reads (Qwen3 and Qwen3-MoE, Qwen2/2.5
and Qwen2-MoE, Llama 3, Mistral, Mixtral, Gemma 2/3, OLMo 2/3, Phi-3, SmolLM3). The family comes
from `config.json` (`families.config_from_hf`); names and shapes are checked against the config
before any weight is copied, so a bad file is refused, never half-loaded."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..dtypes import checkpoint_dtype
from ..errors import CheckpointError, ConfigError
from ..hardware import check_device
from . import files
from .checkpoint import read_tensors
from .decoder import DEFAULT_BLOCK_SIZE, Model
from .families import config_from_hf, read_json
from .hybrid import is_image_text
from .tensor_names import file_name, tensors_from_files, text_model_tensors

_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def checkpoint_dir(path) -> Path:
    """`path` as a Path (a leading ~ your home), or a one-line CheckpointError where no checkpoint
    directory is there."""
    if not isinstance(path, (str, os.PathLike)):  # (load_model(None) was pathlib's TypeError)
        raise CheckpointError(f"a checkpoint is a directory path, got {type(path).__name__} {path!r:.40}")
    path = Path(path).expanduser()
    if not path.is_dir():
        why = "not a directory (a checkpoint is a directory of config.json and model.safetensors)" \
            if path.exists() else "checkpoint directory not found"
        raise CheckpointError(f"{path}: {why}")
    return path


def load_model(path: str | Path, kernels: str = "aligned", dtype: torch.dtype | None = None,
               block_size: int | None = None, device: torch.device | str | None = None,
               context: int | None = None):
    """Load a `parity` or Hugging Face checkpoint directory of a supported family onto `device`
    (default the CPU; the weights are checked on the CPU, then moved), serving at most `context`
    positions when given (`ModelConfig.with_context`)."""
    path = checkpoint_dir(path)
    if (path / files.MANIFEST).exists():  # a training checkpoint: its files as they were saved
        files.verify_manifest(path)
    try:
        config = config_from_hf(read_json(path / "config.json"), path / "config.json").with_context(context)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    raw = files.read_json(path / "config.json")  # (checked just above: a JSON object)
    if dtype is None:
        dtype = checkpoint_dtype(raw.get("dtype") or raw.get("torch_dtype"))
    try:
        tensors = read_tensors(path)
        if is_image_text(raw):  # (Gemma 3 4B-27B: the language model, without the vision tower)
            tensors = text_model_tensors(tensors, str(path / "model.safetensors"))
        tensors = tensors_from_files(config, tensors, str(path / "model.safetensors"))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    indices = (n.split(".")[2] for n in tensors if n.startswith("model.layers."))
    layers = {int(i) for i in indices if i.isdigit()}
    if layers and layers != set(range(config.num_hidden_layers)):  # (before a model of that size is built)
        raise CheckpointError(f"{path}: the weights hold layers {min(layers)}..{max(layers)}, "
                              f"config.json says num_hidden_layers = {config.num_hidden_layers}")
    for name, t in tensors.items():
        if t.dtype not in _WEIGHT_DTYPES:  # (int, bool or float8 ones were cast without a word)
            raise CheckpointError(f"{path}: tensor {name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                                  "parity loads float32, bfloat16 or float16 weights")
    embed = tensors.get("model.embed_tokens.weight")
    want = (config.vocab_size, config.hidden_size)
    if embed is not None and tuple(embed.shape) != want:  # (before a model of the config's size is built)
        raise CheckpointError(f"{path}: tensor model.embed_tokens.weight has shape {tuple(embed.shape)}, "
                              f"config.json implies {want}")
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    try:  # shapes first, on the meta device: a wrong size is named before memory is asked for it
        # (intermediate_size = 10^9 was 'out of memory, 238 GiB': lower the batch sizes)
        with torch.device("meta"):
            shapes = Model(config, kernels=kernels, dtype=dtype, seed=None, block_size=block_size)
        expected, dtype = shapes.state_dict(), shapes.dtype  # (a dtype given by name resolved)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    weights_file = path / "model.safetensors"
    for name in [n for n in tensors if n.endswith(".rotary_emb.inv_freq")]:
        del tensors[name]  # a buffer older checkpoints saved; parity derives it from rope_theta
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(head, embed):
            raise CheckpointError(f"{weights_file}: lm_head.weight differs from model.embed_tokens.weight "
                                  "but config.json says tie_word_embeddings=true")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        untied = missing == ["lm_head.weight"] and "tie_word_embeddings" not in raw
        named = list(dict.fromkeys(file_name(config, n) for n in missing))  # (as the file names them)
        raise CheckpointError(f"{weights_file}: missing tensor {named[0]}"
                              + (f" (and {len(named) - 1} more)" if len(named) > 1 else "")
                              + ("; config.json has no tie_word_embeddings, read as false" if untied else ""))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{weights_file}: unexpected tensor {file_name(config, unexpected[0])} "
                              "for this config")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{weights_file}: tensor {file_name(config, name)} has shape "
                                  f"{tuple(got.shape)}, "
                                  f"config.json implies {tuple(want.shape)}")
        tensors[name] = got = got.to(dtype)  # checked as loaded: 3.4e38 in float32 is inf in bfloat16
        if not torch.isfinite(got).all():
            raise CheckpointError(f"{weights_file}: tensor {file_name(config, name)} contains NaN or inf "
                                  f"as {dtype}")
    try:
        model = Model(config, kernels=kernels, dtype=dtype, seed=None, block_size=block_size)
    except ConfigError as exc:  # e.g. sizes no memory holds
        raise CheckpointError(f"{path}: {exc}") from None
    model.load_state_dict(tensors)
    return model.to(check_device(device))
