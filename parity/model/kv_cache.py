"""Paged KV cache storage: fixed-size blocks per layer, block 0 kept as an all-zero pad block.

One more block past the allocatable ones is scratch: the padding rows of a decode graph
(`engine/graphs.py`) write their keys/values there, and no block table ever names it.

The block size is the aligned attention kernel's key-block size, so a sequence's cached keys
are reduced in exactly the blocks a dense forward would use. Allocation policy (which sequence
gets which blocks, preemption) belongs to the engine's `BlockManager`, the package's one allocator.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    """Per-layer key/value blocks: k[layer] is [num_blocks + 2, Hkv, D, block] (keys transposed
    inside a block, so attention reads 16 keys' entries side by side) and v[layer] is
    [num_blocks + 2, Hkv, block, D]: block 0 the pad block, 1..num_blocks allocatable, the last
    one scratch."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        layers, hkv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.k = torch.zeros(layers, num_blocks + 2, hkv, d, block_size, dtype=dtype, device=device)
        self.v = torch.zeros(layers, num_blocks + 2, hkv, block_size, d, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slot = (num_blocks + 1) * block_size
        """A flat slot no sequence owns: where padding rows' keys and values go."""

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """Cache bytes one token takes: keys and values of every layer and KV head."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * item

    def locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of flat slots [T] (block * block_size + offset): once per forward."""
        return slots // self.block_size, slots % self.block_size

    def write(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store new keys/values [T, Hkv, D] at the (block, offset) pairs `locate` gave."""
        block, offset = where
        self.k[layer][block, :, :, offset] = k.to(self.k.dtype)
        self.v[layer][block, :, offset, :] = v.to(self.v.dtype)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Clear freed blocks, so no stale (possibly non-finite) value outlives its sequence."""
        if blocks:
            idx = torch.tensor(blocks, device=self.k.device)
            self.k[:, idx] = 0
            self.v[:, idx] = 0
