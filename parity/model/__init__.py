"""The decoder (the Qwen3, Qwen3-MoE, Qwen2/2.5, Qwen2-MoE, Llama 3, Mistral, Mixtral, Gemma 2/3, OLMo 2/3,
Phi-3 and SmolLM3 families), its config, checkpoints, KV cache and log-prob entry points."""

from .batch import ForwardBatch
from .checkpoint import save_pretrained
from .config import ModelConfig
from .decoder import DEFAULT_BLOCK_SIZE, Model
from .kv_cache import KVCache
from .loading import load_model
from .logprobs import scored_routing, sequence_logprobs

__all__ = ["DEFAULT_BLOCK_SIZE", "ForwardBatch", "KVCache", "Model", "ModelConfig", "load_model",
           "save_pretrained", "scored_routing", "sequence_logprobs"]
