"""Paged KV cache storage: fixed-size blocks per layer, block 0 kept as an all-zero pad block.

One more block past the allocatable ones is scratch: the padding rows of a decode graph
(`engine/graphs.py`) write their keys/values there, and no block table ever names it.

The block size is the aligned attention kernel's key-block size, so a sequence's cached keys
are reduced in exactly the blocks a dense forward would use. Allocation policy (which sequence
gets which blocks, preemption) belongs to the engine's `BlockManager`, the package's one allocator.

A model with both full and sliding-window layers (Gemma 2 and 3, OLMo 3, ...) may keep its sliding
layers in a *window group* of their own (`window_blocks`): blocks of its own numbering, which a
sequence gives back once every later query's window has passed them (`BlockManager.trim`), so a
sliding layer holds about a window of keys per sequence, not the whole context. A model whose
every layer slides is one such group. A sequence then
has one block table per group; a trimmed entry names the pad block, which the kernels read (if
at all) only as keys before the window, masked: the same bits as the keys that were there.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    """Per-layer key/value blocks: k[layer] is [blocks + 2, Hkv, D, block] (keys transposed inside
    a block, so attention reads 16 keys' entries side by side) and v[layer] is [blocks + 2, Hkv,
    block, D]: block 0 the pad block, 1..blocks allocatable, the last one scratch. With one group
    (the default) k and v are [layers, num_blocks + 2, ...] tensors; with a window group they are
    per-layer lists, each layer's blocks numbered in its group."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", window_blocks: int | None = None):
        layers, hkv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        groups = self.layer_groups(config, num_blocks, window_blocks)
        self.windows = [w for w, _, _ in groups]
        """Per group, the window its blocks are trimmed behind (0: the full layers, kept whole)."""
        self.group_blocks = [n for _, _, n in groups]
        """Per group, its allocatable blocks."""
        self.group_of = [0] * layers
        """Per layer, its group."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slots = [(n + 1) * block_size for n in self.group_blocks]
        """Per group, a flat slot no sequence owns: where padding rows' keys and values go."""
        self.scratch_slot = self.scratch_slots[0]
        self._k, self._v = [], []  # per group: [layers of the group, blocks + 2, ...]
        for g, (_, members, n) in enumerate(groups):
            self._k.append(torch.zeros(len(members), n + 2, hkv, d, block_size, dtype=dtype, device=device))
            self._v.append(torch.zeros(len(members), n + 2, hkv, block_size, d, dtype=dtype, device=device))
            for i in members:
                self.group_of[i] = g
        if len(groups) == 1:
            self.k, self.v = self._k[0], self._v[0]
        else:
            rank = {i: j for _, members, _ in groups for j, i in enumerate(members)}
            self.k = [self._k[self.group_of[i]][rank[i]] for i in range(layers)]
            self.v = [self._v[self.group_of[i]][rank[i]] for i in range(layers)]

    @staticmethod
    def layer_groups(config: ModelConfig, num_blocks: int,
                     window_blocks: int | None) -> list[tuple[int, list[int], int]]:
        """(window, layers, blocks) per group: every layer in one, or with `window_blocks` (and
        both full and sliding layers) the full layers, then the sliding ones in blocks of their own.
        A model whose every layer slides has one group, of `window_blocks`, trimmed behind the
        window (Mistral v0.1, Phi-3-mini)."""
        layers = config.num_hidden_layers
        windows = [config.layer_window(i) for i in range(layers)]
        full = [i for i in range(layers) if not windows[i]]
        if window_blocks is not None and not full:
            return [(max(windows), list(range(layers)), window_blocks)]
        if window_blocks is None or len(full) == layers:
            return [(0, list(range(layers)), num_blocks)]
        sliding = [i for i in range(layers) if windows[i]]
        return [(0, full, num_blocks), (max(windows), sliding, window_blocks)]

    @classmethod
    def bytes_for(cls, config: ModelConfig, dtype: torch.dtype, block_size: int, num_blocks: int,
                  window_blocks: int | None = None) -> int:
        """The bytes a cache of these blocks takes (its pad and scratch blocks included)."""
        return sum(cls.bytes_per_token(config, dtype, len(members)) * (n + 2) * block_size
                   for _, members, n in cls.layer_groups(config, num_blocks, window_blocks))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def storage(self) -> list[int]:
        """The storages' addresses (a captured decode graph baked them in)."""
        return [t.data_ptr() for t in (*self._k, *self._v)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, layers: int | None = None) -> int:
        """Cache bytes one token takes: keys and values of every layer (or of `layers` of them)
        and KV head."""
        item = torch.empty((), dtype=dtype).element_size()
        n = config.num_hidden_layers if layers is None else layers
        return 2 * n * config.num_key_value_heads * config.head_dim * item

    def locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of flat slots [T] (block * block_size + offset): once per forward."""
        return slots // self.block_size, slots % self.block_size

    def write(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store new keys/values [T, Hkv, D] at the (block, offset) pairs `locate` gave (for the
        layer's group)."""
        block, offset = where
        self.k[layer][block, :, :, offset] = k.to(self.k[layer].dtype)
        self.v[layer][block, :, offset, :] = v.to(self.v[layer].dtype)

    def zero_blocks(self, blocks: list[int], group: int = 0) -> None:
        """Clear freed blocks, so no stale (possibly non-finite) value outlives its sequence."""
        if blocks:
            idx = torch.tensor(blocks, device=self._k[group].device)
            self._k[group][:, idx] = 0
            self._v[group][:, idx] = 0
