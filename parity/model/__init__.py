"""The Qwen3-style model, its config, checkpoints, KV cache and log-prob entry points."""

from .batch import ForwardBatch
from .checkpoint import save_pretrained
from .config import ModelConfig
from .kv_cache import KVCache
from .loading import load_model
from .logprobs import sequence_logprobs
from .qwen3 import DEFAULT_BLOCK_SIZE, Model

__all__ = ["DEFAULT_BLOCK_SIZE", "ForwardBatch", "KVCache", "Model", "ModelConfig", "load_model",
           "save_pretrained", "sequence_logprobs"]
