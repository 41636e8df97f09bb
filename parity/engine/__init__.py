"""The rollout engine: engine -> scheduler -> block manager -> model runner -> sampler."""

from .engine import WEIGHT_MODES, Engine
from .sequence import RequestOutput, SamplingParams

__all__ = ["WEIGHT_MODES", "Engine", "RequestOutput", "SamplingParams"]
