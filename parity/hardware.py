"""What machine a figure was measured on: CPU model, cores, the vector features that decide CPU
numerics and speed (AVX2, AVX-512, AVX-512 BF16, AMX), the torch build and its threads.

Machines of one kind differ (some CPUs have bf16 instructions, some only AVX2, where PyTorch's
bf16 runs far slower), so every benchmark header, the study's results.json and docs/results.md
name the features beside their numbers.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from pathlib import Path

import torch

FEATURES = [("avx2", "AVX2"), ("avx512f", "AVX-512F"), ("avx512_bf16", "AVX-512 BF16"),
            ("amx_bf16", "AMX-BF16")]
"""(/proc/cpuinfo flag, name) of the features that matter here, in order."""


def describe() -> dict:
    """The machine as a dict: cpu, cores, features (present ones), bf16 ("native" when the CPU has
    bf16 dot-product instructions, else "slow"), torch, threads, gpu (name or None)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    features = [name for flag, name in FEATURES if flag in flags]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "cores": os.cpu_count() or 1, "features": features,
            "bf16": "native" if {"avx512_bf16", "amx_bf16"} & flags else "slow",
            "bf16_gemm": "onednn" if bf16_gemm_native() else "float32",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "gpu": gpu}


def available_memory(device: torch.device | str | None = None) -> int:
    """Bytes of memory available to a new allocation now on `device`: a GPU's free memory
    (`torch.cuda.mem_get_info`), else the host's (MemAvailable; physical memory when
    /proc/meminfo is not there)."""
    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_device(device: torch.device | str | None, what: str = "device") -> torch.device:
    """`device` as a torch.device ('cpu', 'cuda', 'cuda:N'; None is the CPU), or a one-line
    ConfigError naming `what` when it is malformed or names a GPU this torch build cannot see."""
    from .errors import ConfigError
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{what} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what}={str(device)!r} but this torch build sees no CUDA device "
                              f"(torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{what}={str(device)!r} but only {torch.cuda.device_count()} CUDA "
                              f"device(s) are visible")
    return dev


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work before reading a clock (no-op on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def line(info: dict | None = None) -> str:
    """One line for a table header: 'AMD EPYC 9R14, 2 cores, AVX2 AVX-512F AVX-512 BF16 (no AMX),
    torch 2.13.0+cpu, 2 threads'."""
    info = info or describe()
    feats = " ".join(info["features"]) or "no AVX2"
    amx = "" if "AMX-BF16" in info["features"] else " (no AMX)"
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (f"{info['cpu']}, {info['cores']} cores, {feats}{amx}, torch {info['torch']}, "
            f"{info['threads']} threads{gpu}")


@functools.cache
def bf16_gemm_native() -> bool:
    """Whether this CPU's GEMM library (oneDNN) has a bf16 path. Without one (AVX2-only CPUs),
    PyTorch multiplies bf16 matrices ~50x slower than float32, and parity's kernels multiply bf16
    values in float32 instead (`ops.common.gemm_linear`). PARITY_BF16_GEMM=native|float32
    overrides the answer (tests)."""
    forced = os.environ.get("PARITY_BF16_GEMM")
    if forced in ("native", "float32"):
        return forced == "native"
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def preferred_dtype(info: dict | None = None) -> str:
    """The compute dtype that runs faster here: 'bfloat16' with bf16 instructions (AVX-512 BF16,
    AMX), else 'float32' (PyTorch's bf16 without them is several times slower). parity computes
    on the CPU, so a GPU in the machine does not change the answer."""
    info = info or describe()
    return "bfloat16" if info["bf16"] == "native" else "float32"


def gemm_rate(dtype: torch.dtype = torch.float32, size: int = 2048, reps: int = 5,
              device: torch.device | str | None = None) -> float:
    """This machine's matrix-multiply rate in GFLOP/s for `dtype` at the current thread count (or
    on `device`'s GPU): the fastest of `reps` size x size x size products after a warm-up (~2 s in
    float32 on 2 cores) — a limit, so the best run, not a median that a noisy neighbour drags.
    Benchmarks divide their achieved GFLOP/s by it: the fraction of the machine's limit.
    bfloat16 on a CPU without a bf16 GEMM is the rate of the path parity runs there (float32
    products of the bf16 values, `ops.common.gemm_linear`), not PyTorch's slow bf16 loop."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        size = max(size, 8192)  # a GPU needs a large product to reach its rate
    gen = torch.Generator(device=device).manual_seed(0)  # drawn where they are used: 8192² on a GPU
    a = torch.randn(size, size, generator=gen, device=device).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device).to(dtype)
    if dtype == torch.bfloat16 and device.type == "cpu" and not bf16_gemm_native():
        a, b = a.float(), b.float()
    a @ b
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * size ** 3 / min(times) / 1e9


def bf16_cost(size: int = 384, reps: int = 3, linear=None) -> float:
    """How many times slower a bfloat16 GEMM forward+backward runs than float32 on this machine
    (median of `reps` interleaved timings of a size x size layer on size rows; ~0.1 s). `linear`
    (default `F.linear`): the layer function to time, e.g. the kernels' own `gemm_linear`."""
    linear = linear or torch.nn.functional.linear
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(size, size, generator=gen)
    for _ in range(reps):
        for dtype in times:
            x = data.to(dtype)
            w = data.t().contiguous().to(dtype).requires_grad_()
            t0 = time.perf_counter()
            linear(x, w).sum().backward()
            times[dtype].append(time.perf_counter() - t0)
    return statistics.median(times[torch.bfloat16]) / statistics.median(times[torch.float32])


def bf16_warning(dtype_name: str, what: str = "model.dtype", info: dict | None = None,
                 linear=None) -> str | None:
    """A one-line warning when `dtype_name` is bfloat16 on a CPU without bf16 instructions, with
    the cost measured now (of `linear`, see `bf16_cost`); None otherwise."""
    info = info or describe()
    if dtype_name != "bfloat16" or info["bf16"] == "native":
        return None
    cost = bf16_cost(linear=linear)
    if cost <= 1.1:  # no bf16 instructions, yet not slower: nothing to warn about
        return None
    feats = " ".join(info["features"]) or "no AVX2"
    return (f"this CPU has no bf16 instructions ({feats}): bfloat16 forward+backward measured "
            f"{cost:.1f}x slower than float32 here; float32 ({what}) is faster on this machine")
