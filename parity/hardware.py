"""What machine a figure was measured on: CPU model, cores, the vector features that decide CPU
numerics and speed (AVX2, AVX-512, AVX-512 BF16, AMX), the torch build and its threads.

Machines of one kind differ (some CPUs have bf16 instructions, some only AVX2, where PyTorch's
bf16 runs far slower), so every benchmark header, the study's results.json and docs/results.md
name the features beside their numbers.
"""

from __future__ import annotations

import os
import platform
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
            "torch": torch.__version__, "threads": torch.get_num_threads(), "gpu": gpu}


def line(info: dict | None = None) -> str:
    """One line for a table header: 'AMD EPYC 9R14, 2 cores, AVX2 AVX-512F AVX-512 BF16 (no AMX),
    torch 2.13.0+cpu, 2 threads'."""
    info = info or describe()
    feats = " ".join(info["features"]) or "no AVX2"
    amx = "" if "AMX-BF16" in info["features"] else " (no AMX)"
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (f"{info['cpu']}, {info['cores']} cores, {feats}{amx}, torch {info['torch']}, "
            f"{info['threads']} threads{gpu}")
