"""Compute dtypes by name: the one place that turns 'float32' / 'bfloat16' into torch dtypes.

Configs, the CLI and checkpoints name dtypes as strings; everything that needs a `torch.dtype`
asks here, so the set of supported compute dtypes is written once.
"""

from __future__ import annotations

import torch

from .errors import ConfigError

COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes the model, engine and learner compute in (log-probs are float32 either way)."""

DTYPE_NAMES: tuple[str, ...] = tuple(COMPUTE_DTYPES)


def dtype_from_name(name: str, what: str = "dtype") -> torch.dtype:
    """'float32' or 'bfloat16' -> the torch dtype; anything else is a one-line ConfigError."""
    if name not in COMPUTE_DTYPES:
        raise ConfigError(f"{what} must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return COMPUTE_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(name: str | None) -> torch.dtype:
    """The compute dtype for a checkpoint's stored `torch_dtype`: float16 and unknown names load
    as float32 (the CPU kernels compute in float32 or bfloat16)."""
    return COMPUTE_DTYPES.get(str(name or "float32"), torch.float32)
