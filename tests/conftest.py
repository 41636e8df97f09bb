"""Shared fixtures: small seeded models built once per configuration.

PARITY_TEST_DEVICE=cuda builds them on the GPU (scripts/gpu_check.sh runs tests/parity so: the
bitwise suite on the Triton kernels, the controls on cuBLAS/SDPA); the default is the CPU.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

import parity

os.environ.setdefault("PARITY_ALLOW_DEGRADED_SANDBOX", "1")  # the suite tests the tool tasks' logic on
# machines without namespaces too (isolation is still used where it exists); the tests of the
# refusal, the default for users, unset it

DEVICE = os.environ.get("PARITY_TEST_DEVICE", "cpu")
"""Where the shared models live (and so where the bitwise suite runs)."""

if not torch.cuda.is_available():  # before anything imports Triton (torch._dynamo does, and tests
    # reach it through torch's AdamW or torch.compile): the Triton kernels then run through its
    # interpreter whichever test file comes first (the fused-draw tests skipped when a learner test
    # had imported Triton before them)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores() -> None:
    """Give each pytest-xdist worker its share of the cores, for itself and the processes it starts.

    Every worker's torch otherwise takes all the cores, so two workers on 2 cores ran 4 OpenMP
    threads that spin at each barrier waiting for a thread descheduled by the other worker: small
    kernels ran ~10x slower (the thousand generated cases: 6 s alone, 58 s in the suite), and the
    suite took 652 s instead of 442 s on 2 cores. An OMP_NUM_THREADS set by the user wins.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the runs, sandboxes and Ray processes tests start
    torch.set_num_threads(threads)


_share_the_cores()


HEAVY_FIRST = ("tests/rl/test_ray.py", "tests/parity/test_triton.py", "tests/rl/test_faults.py",
               "tests/test_cli.py", "tests/parity/test_bitwise.py", "tests/test_sft_demo.py",
               "tests/test_study.py", "tests/rl/test_ray_nodes.py", "tests/parity/test_triton_compile.py",
               "tests/rl/test_controller.py", "tests/test_sandbox_hardening.py", "tests/test_user_tasks.py",
               "tests/rl/test_local_worker.py", "tests/test_families.py", "tests/test_sandbox.py",
               "tests/engine/test_engine.py", "tests/parity/test_gemm_rows.py", "tests/rl/test_optim.py")
"""The files that take 13 s or more (`--durations=0` on 2 cores, 2026-12-08: 217 s down to 13 s),
longest first, given out first (the rest follow, each under 10 s): under `--dist loadfile` a long
file that started last kept one worker busy alone at the end."""


def pytest_configure(config):
    """Keep HEAVY_FIRST's order under `--dist loadfile`: pytest-xdist (3.6 on) otherwise re-sorts the
    files by how many tests each has, so a long file of few tests (the study's, 53 s in 4 tests)
    could start last. An explicit `--loadscope-reorder` still wins."""
    asked = "--loadscope-reorder" in config.invocation_params.args
    if hasattr(config.option, "loadscopereorder") and not asked:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files of HEAVY_FIRST first, in that order; every file's tests in their own order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    root = Path(config.rootpath)

    def key(item) -> int:
        try:
            return rank.get(Path(str(item.fspath)).relative_to(root).as_posix(), len(rank))
        except ValueError:  # (a test file outside the repository)
            return len(rank)

    items.sort(key=key)


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
