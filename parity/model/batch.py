"""`ForwardBatch`: how a set of sequences' new tokens are laid out for one model forward.

Token-wise work (embeddings, projections, MLP, norms) runs on the packed tokens [T, ...];
attention runs per sequence on a padded [B, M] view gathered from them. Keys come either from
the same forward (`dense`: every sequence starts at position 0, the learner's path) or from a
paged KV cache (`block_tables`: the engine's path, prefill chunks and decode steps alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] packed new tokens of all sequences
    positions: torch.Tensor  # [T] absolute position of each new token
    q_index: torch.Tensor  # [B, M] index into the packed tokens; padding points at row T
    q_pos: torch.Tensor  # [B, M] absolute query positions; padding rows are -1
    out_index: torch.Tensor  # [T] flat index into [B*M] for each packed token
    seq_lens: list[int]  # new tokens per sequence
    key_len: int  # padded key length L (a multiple of the block size)
    k_index: torch.Tensor | None = None  # dense: [B, L] index into packed tokens (pad -> T)
    block_tables: torch.Tensor | None = None  # cache: [B, L // block] block ids (pad -> 0)
    slots: torch.Tensor | None = None  # cache: [T] flat cache slot of each new token
    window_tables: torch.Tensor | None = None  # cache with a window group: its tables, as block_tables
    window_slots: torch.Tensor | None = None  # ... and its slots, as slots

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with its index tensors on `device` (built on the CPU, moved once)."""
        if self.input_ids.device == device:
            return self
        move = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                for k, v in vars(self).items()}
        return ForwardBatch(**move)

    @staticmethod
    def build(
        new_tokens: Sequence[Sequence[int] | torch.Tensor],
        start_positions: Sequence[int],
        block_size: int,
        block_tables: Sequence[Sequence[int]] | None = None,
        window_tables: Sequence[Sequence[int]] | None = None,
    ) -> ForwardBatch:
        """Lay out `new_tokens[b]` at positions `start_positions[b]...` of sequence b.

        Without `block_tables` every start must be 0 (dense). With them, sequence b's cache
        blocks are `block_tables[b]` (enough for its full context after this forward); a cache
        with a window group (`KVCache`) takes the sliding layers' tables too, `window_tables`.
        """
        n = len(new_tokens)  # (mismatched lengths were IndexErrors inside)
        if not n or len(start_positions) != n or (block_tables is not None and len(block_tables) != n):
            tables = "" if block_tables is None else f", {len(block_tables)} block tables"
            raise ValueError(f"a forward batch needs one start position (and block table) per sequence, "
                             f"got {n} sequences, {len(start_positions)} start positions{tables}")
        if all(isinstance(t, torch.Tensor) for t in new_tokens):
            seqs = [t.reshape(-1).long() for t in new_tokens]
            lens = [int(t.numel()) for t in seqs]
            input_ids = torch.cat(seqs).cpu()  # built on the CPU, moved once (`to`)
        else:  # lists (the engine's decode and prefill steps): one tensor, not one per sequence
            rows = [list(t) if isinstance(t, (list, tuple, range)) and (not t or isinstance(t[0], int))
                    else torch.as_tensor(t, dtype=torch.long).reshape(-1).tolist() for t in new_tokens]
            lens = [len(r) for r in rows]
            input_ids = torch.tensor([x for r in rows for x in r], dtype=torch.long)
        bsz, m = len(lens), max(lens)
        total = sum(lens)
        starts = torch.tensor(list(start_positions), dtype=torch.long)
        seq_of_tok = torch.repeat_interleave(torch.arange(bsz), torch.tensor(lens))
        offsets = torch.tensor([0] + lens[:-1]).cumsum(0)
        within = torch.arange(total) - offsets[seq_of_tok]
        positions = starts[seq_of_tok] + within
        cols = torch.arange(m)
        valid = cols.view(1, m) < torch.tensor(lens).view(bsz, 1)
        q_index = torch.where(valid, offsets.view(bsz, 1) + cols.view(1, m), total)
        q_pos = torch.where(valid, starts.view(bsz, 1) + cols.view(1, m), -1)
        out_index = seq_of_tok * m + within
        ctx = [int(s) + n for s, n in zip(start_positions, lens)]
        key_len = -(-max(ctx) // block_size) * block_size
        batch = ForwardBatch(input_ids, positions, q_index, q_pos, out_index, lens, key_len)
        if block_tables is None:
            if any(int(s) != 0 for s in start_positions):
                raise ValueError("a dense forward needs every sequence to start at position 0")
            kcols = torch.arange(key_len)
            kvalid = kcols.view(1, -1) < torch.tensor(lens).view(bsz, 1)
            batch.k_index = torch.where(kvalid, offsets.view(bsz, 1) + kcols.view(1, -1), total)
            return batch
        nblk = key_len // block_size
        out = []
        for group in [block_tables] if window_tables is None else [block_tables, window_tables]:
            flat: list[int] = []  # the padded table as one list: a tensor per row costs ~5 us each
            for b, blocks in enumerate(group):
                need = -(-ctx[b] // block_size)
                if len(blocks) < need:
                    raise ValueError(f"sequence {b} needs {need} cache blocks, has {len(blocks)}")
                row = blocks[:need]
                flat += row.tolist() if isinstance(row, torch.Tensor) else list(row)
                flat += [0] * (nblk - need)
            table = torch.tensor(flat, dtype=torch.long).view(bsz, nblk)
            out += [table, table[seq_of_tok, positions // block_size] * block_size + positions % block_size]
        batch.block_tables, batch.slots = out[:2]
        if window_tables is not None:
            batch.window_tables, batch.window_slots = out[2:4]
        return batch
