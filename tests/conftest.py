"""Shared fixtures: small seeded models built once per configuration."""

from __future__ import annotations

import functools

import pytest
import torch

import parity


@functools.lru_cache(maxsize=32)
def cached_model(preset: str, kernels: str, dtype_name: str, seed: int, std: float):
    cfg = parity.ModelConfig.preset(preset)
    model = parity.Model(cfg, kernels=kernels, dtype=getattr(torch, dtype_name), seed=seed)
    model.reset_parameters(seed, std)
    model.to(getattr(torch, dtype_name))
    return model


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Training runs set the learner's thread count in this process; give it back after a test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny():
    return cached_model("tiny", "aligned", "float32", 0, 0.02)
