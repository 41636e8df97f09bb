"""parity: asynchronous RL for language models with bitwise-identical rollout and learner log-probs.

Public API (see README):
    ModelConfig, Model, load_model, sequence_logprobs, Decoder, get_kernels
"""

from .errors import CheckpointError, ConfigError, InputError, ParityError
from .model import Decoder, ForwardBatch, KVCache, Model, ModelConfig, load_model, sequence_logprobs
from .ops import get_kernels

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "Decoder", "ForwardBatch", "InputError", "KVCache",
           "Model", "ModelConfig", "ParityError", "get_kernels", "load_model", "sequence_logprobs"]
