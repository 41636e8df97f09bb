"""Shared fixtures: small seeded models built once per configuration.

PARITY_TEST_DEVICE=cuda builds them on the GPU (scripts/gpu_check.sh runs tests/parity so: the
bitwise suite on the Triton kernels, the controls on cuBLAS/SDPA); the default is the CPU.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import parity

DEVICE = os.environ.get("PARITY_TEST_DEVICE", "cpu")
"""Where the shared models live (and so where the bitwise suite runs)."""


@functools.lru_cache(maxsize=32)
def cached_model(preset: str, kernels: str, dtype_name: str, seed: int, std: float):
    cfg = parity.ModelConfig.preset(preset)
    model = parity.Model(cfg, kernels=kernels, dtype=getattr(torch, dtype_name), seed=seed)
    model.reset_parameters(seed, std)
    return model.to(getattr(torch, dtype_name)).to(DEVICE)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Training runs set the learner's thread count in this process; give it back after a test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny():
    return cached_model("tiny", "aligned", "float32", 0, 0.02)
