"""The rollout engine: engine -> scheduler -> block manager -> model runner -> sampler.

`Decoder` is the model-level decode API on the same block manager and model runner.
"""

from .decoder import Decoder
from .engine import WEIGHT_MODES, Engine
from .sequence import RequestOutput, SamplingParams

__all__ = ["WEIGHT_MODES", "Decoder", "Engine", "RequestOutput", "SamplingParams"]
