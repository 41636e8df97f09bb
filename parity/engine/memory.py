"""Memory budgets: how much the KV cache may take, as a fraction of the memory available now on
the cache's device (a GPU's free memory, or the host's) or a size in bytes ('4GiB', '512MiB',
0.25), read the same way from configs, the CLI and the API."""

from __future__ import annotations

import os
import re

import torch

from ..errors import InputError

DEFAULT_KV_CACHE_MEMORY = 0.25
"""The KV cache's default budget: this fraction of the memory available on the model's device
when the engine starts (the rest is the learner's, the weights' and the other processes')."""


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


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def memory_size(value: float | int | str, what: str = "kv_cache_memory") -> float:
    """A memory budget as given: a fraction of available memory (0 < x <= 1) or a number of bytes
    (> 1), as a number or a string ('0.25', '1e9', '4GiB', '512MiB', '2GB'); InputError otherwise."""
    number = None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", value)  # (1e-9 was refused)
        unit = m.group(2).lower() if m else None
        try:
            number = float(m.group(1)) * _UNITS[unit] if m and unit in _UNITS else None
        except ValueError:
            number = None
        if unit and number is not None and number <= 1:
            number = None  # '1B' or '0.5GiB'-style slips that would read as a fraction
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if number is None or not 0 < number < float("inf"):
        raise InputError(f"{what} must be a fraction of available memory in (0, 1] or a size in "
                         f"bytes (a number, or like 4GiB / 512MiB), got {value!r}")
    return number


def memory_budget(value: float | int | str, device: torch.device | str | None = None) -> int:
    """A memory budget in bytes: a fraction of the memory available on `device` (0 < value <= 1;
    the host's when None) or bytes (> 1)."""
    value = memory_size(value)
    return int(value * available_memory(device)) if value <= 1 else int(value)
