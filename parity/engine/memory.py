"""Memory budgets: how much the KV cache may take, as a fraction of the memory available now on
the cache's device (a GPU's free memory, or the host's) or a size in bytes ('4GiB', '512MiB',
0.25), read the same way from configs, the CLI and the API; and how the engine's cache spends its
budget (`plan_cache`: the full layers' blocks, and a sliding-window model's window group)."""

from __future__ import annotations

import re

import torch

from ..errors import InputError
from ..hardware import available_memory
from ..model import KVCache

DEFAULT_KV_CACHE_MEMORY = 0.25
"""The KV cache's default budget: this fraction of the memory available on the model's device
when the engine starts (the rest is the learner's, the weights' and the other processes')."""


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
    bare = not isinstance(value, str) or not unit  # ('1.1GiB' is bytes, rounded down; a bare 1.5 is not)
    if bare and number > 1 and number != int(number):  # (1.5 was read as 1 byte: "holds no cache block")
        raise InputError(f"{what} {value!r} is neither a fraction of available memory in (0, 1] nor a "
                         "whole number of bytes")
    decimal = isinstance(value, float) or (isinstance(value, str) and not unit
                                           and not value.strip().isdigit())
    if decimal and 1 < number < 1 << 20:  # (2.0 read as 2 bytes: "hold no cache block", naming no slip)
        raise InputError(f"{what} {value!r} reads as {int(number)} bytes: a fraction of available memory "
                         "is in (0, 1]; a size takes a unit (like 2GiB)")
    return number


def memory_budget(value: float | int | str, device: torch.device | str | None = None) -> int:
    """A memory budget in bytes: a fraction of the memory available on `device` (0 < value <= 1;
    the host's when None) or bytes (> 1)."""
    value = memory_size(value)
    return int(value * available_memory(device)) if value <= 1 else int(value)


def plan_cache(model, kv_cache_tokens: int | None, kv_cache_memory, max_num_seqs: int,
               max_num_batched_tokens: int) -> tuple[int, int | None]:
    """(blocks, window blocks) of the engine's KV cache. The blocks hold `kv_cache_tokens` tokens
    of every full layer (by default as many as the budget affords, up to `max_num_seqs` sequences
    of min(context, 2048) tokens). A model with full and sliding layers keeps its sliding layers
    in a window group (`KVCache`): blocks for every running sequence's window and one step's new
    tokens, at most as many as the full layers' (None: one group, every layer in the blocks). A
    model whose every layer slides is all window group: (blocks, blocks), those windows' blocks
    (`kv_cache_tokens` or the budget may cap them)."""
    cfg, bs = model.config, model.block_size
    groups = KVCache.layer_groups(cfg, 1, 1)
    if groups[0][0]:  # every layer slides
        window = groups[0][0]
        need = max_num_seqs * (-(-window // bs) + 2) + -(-max_num_batched_tokens // bs)
        if kv_cache_tokens is None:
            per_block = KVCache.bytes_per_token(cfg, model.dtype) * bs
            kv_cache_tokens = memory_budget(kv_cache_memory, model.device) // per_block * bs
            if kv_cache_tokens < bs:
                raise InputError(f"kv_cache_memory holds no cache block of this model ({per_block:,} "
                                 "bytes a block); raise it")
        blocks = max(1, min(need, -(-kv_cache_tokens // bs)))
        return blocks, blocks
    per_full = KVCache.bytes_per_token(cfg, model.dtype, len(groups[0][1]))
    window = groups[1][0] if len(groups) > 1 else 0
    per_window = KVCache.bytes_per_token(cfg, model.dtype, len(groups[1][1])) if window else 0
    need = max_num_seqs * (-(-window // bs) + 2) + -(-max_num_batched_tokens // bs) if window else 0
    if kv_cache_tokens is None:
        budget = memory_budget(kv_cache_memory, model.device)
        wanted = max_num_seqs * min(cfg.max_position_embeddings, 2048)
        kv_cache_tokens = min(wanted, max(0, budget - need * bs * per_window) // per_full // bs * bs)
        if window and kv_cache_tokens < need * bs:  # (a budget too small to spare: one size for both)
            kv_cache_tokens = min(wanted, budget // (per_full + per_window) // bs * bs)
        if kv_cache_tokens < bs:
            raise InputError(f"kv_cache_memory: {budget:,} bytes hold no cache block of this model "
                             f"({bs} tokens x {per_full + per_window:,} bytes); raise it")
    num_blocks = max(1, -(-kv_cache_tokens // bs))
    return num_blocks, (min(num_blocks, need) if window else None)


def describe_cache(info: dict, max_position: int, block_size: int) -> str:
    """An engine's `cache_info` in one line (what the commands print at start-up)."""
    size = f"{info['bytes'] / 2**20:,.1f} MiB"
    if info["every_layer_slides"]:
        return (f"KV cache {info['tokens']:,} tokens, {size}: every layer slides over "
                f"{info['every_layer_slides']:,} keys, so a sequence of any length up to {max_position:,} "
                "holds its window")
    window = "" if info["window_blocks"] is None else (
        f"; sliding layers in {info['window_blocks'] * block_size:,} tokens of their own, each "
        "sequence's window")
    return (f"KV cache {info['tokens']:,} tokens ({info['full_length_seqs']} sequences at the full "
            f"{max_position:,}), {size}{window}")
