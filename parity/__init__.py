"""parity: asynchronous RL for language models with bitwise-identical rollout and learner log-probs.

Public API (see README):
    ModelConfig, Model, load_model, sequence_logprobs, Decoder, Engine, SamplingParams, get_kernels
"""

from . import _startup  # noqa: F401  (before torch: see the module)
from .engine import Decoder, Engine, RequestOutput, SamplingParams
from .errors import CheckpointError, ConfigError, InputError, ParityError
from .model import (
    ForwardBatch,
    KVCache,
    Model,
    ModelConfig,
    load_model,
    sequence_logprobs,
)
from .ops import get_kernels

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "Decoder", "Engine", "ForwardBatch", "InputError", "KVCache",
    "Model", "ModelConfig", "ParityError", "RequestOutput", "SamplingParams", "get_kernels",
    "load_model", "sequence_logprobs",
]
