"""Decode steps as CUDA graphs: a step's host work paid once per batch shape, not once per step.

A decode step (every sequence gets one new token) launches hundreds of kernels; on a GPU the
host's time to launch them is far longer than the GPU's time to run them. `DecodeGraphs` captures
the whole step — the model forward, the KV-cache writes and the LM head — once per (batch bucket,
block-table width bucket) and replays it: the step's tokens, positions, cache slots and block tables
are copied into the graph's static inputs in one host-to-device copy, and one launch runs the rest.

A batch is padded up to its bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, then steps of 32).
A padding row is token 0 at query position -1: its key/value go to the cache's scratch slot,
which no block table names, and its table row is the all-zero pad block. On aligned kernels a row's
bits never depend on the other rows of the launch (M, the table width, the neighbours), so padding
changes no live row's logits: replayed graphs give the eager step's bits (tested, with the standard
kernels as the control that padding does change). Tables are padded to the width bucket with the
pad block, which the attention kernels read as exact no-ops beyond a row's position.

Modes: 'cuda' captures real graphs (a GPU); 'emulate' runs the same static, padded step eagerly
with no capture, so the padding argument is tested on a CPU; `mode_for` picks one from 'auto'
('cuda' for a dense model on a GPU, else none), 'off', 'emulate'. Not graphed: mixture-of-experts
models (tokens per expert are data-dependent shapes) and projection weights that do not share one
buffer (a cached concatenation would go stale in a captured graph). Weights updated in place are
seen by the graphs; weights moved to new storage (or a kernel switch) drop them for recapture.
"""

from __future__ import annotations

import array
import contextlib
import logging

import torch

from ..errors import ConfigError
from ..model import ForwardBatch
from ..model.fused import adjacent
from ..model.moe import SparseMoE

log = logging.getLogger(__name__)

GRAPH_MODES = ("auto", "off", "emulate")
"""What callers may ask for: 'auto' (CUDA graphs where they apply), 'off', 'emulate' (tests)."""

_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def batch_bucket(n: int) -> int:
    """The padded batch size a decode step of `n` sequences runs at."""
    for b in _SMALL_BUCKETS:
        if n <= b:
            return b
    return -(-n // 32) * 32


def width_bucket(blocks: int, limit: int) -> int:
    """The padded block-table width for a step whose longest sequence holds `blocks` blocks."""
    return min(limit, 1 << max(0, blocks - 1).bit_length())


def unsupported(model) -> str | None:
    """Why `model`'s decode steps cannot be captured, or None when they can."""
    layers = model.model.layers
    if any(isinstance(layer.mlp, SparseMoE) for layer in layers):
        return "mixture-of-experts layers send a data-dependent number of tokens to each expert"
    for layer in layers:
        att, mlp = layer.self_attn, layer.mlp
        groups = [[att.q_proj.weight, att.k_proj.weight, att.v_proj.weight],
                  [mlp.gate_proj.weight, mlp.up_proj.weight]]
        if model.config.attention_bias:
            groups.append([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
        if any(adjacent(g) is None for g in groups):
            return "projection weights do not share one buffer (share_projection_storage)"
    return None


def mode_for(model, requested: str) -> str | None:
    """The graph mode a runner uses: 'cuda', 'emulate' or None (eager steps)."""
    if requested not in GRAPH_MODES:
        raise ConfigError(f"decode graphs must be one of {', '.join(map(repr, GRAPH_MODES))}, "
                          f"got {requested!r}")
    if requested == "off":
        return None
    if requested == "auto" and model.device.type != "cuda":
        return None
    why = unsupported(model)
    if why is not None:
        if requested == "emulate" or model.device.type == "cuda":
            log.info("decode steps run eagerly: %s", why)
        return None
    return "cuda" if model.device.type == "cuda" else "emulate"


def _first_cause(err: BaseException) -> str:
    """The error that broke a capture, in one line: when the graph's exit raised a second, generic
    error (capture_end after a failed op), the first one is the cause."""
    while err.__context__ is not None and "capture" in str(err).lower():
        err = err.__context__
    return f"{type(err).__name__}: {err}".splitlines()[0]


class _Captured:
    """One bucket's static inputs (views of one packed int64 buffer), its batch and its graph."""

    def __init__(self, model, cache, bsz: int, width: int):
        dev = model.device
        self.bsz, self.width, self.groups = bsz, width, cache.num_groups
        # packed layout: input_ids [B] | positions [B] | q_pos [B] | then per cache group (a window
        # group: the sliding layers' own blocks) slots [B] | tables [B * W]
        g = self.groups
        self.packed = torch.zeros((3 + g) * bsz + g * bsz * width, dtype=torch.long, device=dev)
        ids, pos, q_pos, *slots = (self.packed[i * bsz:(i + 1) * bsz] for i in range(3 + g))
        at, size = (3 + g) * bsz, bsz * width
        tables = [self.packed[at + j * size:at + (j + 1) * size].view(bsz, width) for j in range(g)]
        rows = torch.arange(bsz, device=dev)
        self.batch = ForwardBatch(ids, pos, rows.view(bsz, 1), q_pos.view(bsz, 1), rows, [1] * bsz,
                                  width * model.block_size, block_tables=tables[0], slots=slots[0])
        if g > 1:
            self.batch.window_tables, self.batch.window_slots = tables[1], slots[1]
        self.scratch = cache.scratch_slots
        self.packed.copy_(self.pack())
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def pack(self, tokens: list[int] = (), positions: list[int] = (), slots: list[list[int]] = (),
             tables: list[list[int]] = ()) -> torch.Tensor:
        """The packed inputs (CPU) of a step whose first rows are these sequences (per group, their
        `slots` and `tables`: their rows of the block table, `width` each, flattened); the rest are
        padding rows: token 0 at position 0, the scratch slot, query position -1, tables of the
        pad block. No arguments: an all-padding step."""
        pad, width = self.bsz - len(tokens), self.width
        slots, tables = slots or [[]] * self.groups, tables or [[]] * self.groups
        values = [*tokens, *[0] * pad, *positions, *[0] * pad, *positions, *[-1] * pad]
        for s, scratch in zip(slots, self.scratch):
            values += [*s, *[scratch] * pad]
        for t in tables:
            values += [*t, *[0] * (pad * width)]
        return torch.frombuffer(array.array("q", values), dtype=torch.long)  # 3x faster than torch.tensor


class DecodeGraphs:
    """Decode-step graphs of one model over one KV cache, captured lazily per bucket."""

    def __init__(self, model, cache, mode: str):
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"graph mode must be 'cuda' or 'emulate', got {mode!r}")
        self.model, self.cache, self.mode = model, cache, mode
        self.max_width = -(-model.config.max_position_embeddings // model.block_size)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.stream = torch.cuda.Stream(model.device) if mode == "cuda" else None
        """The capture stream, on the model's device (which need not be the current one)."""
        dev = model.device
        model.place_rope(dev)  # as the forward would on its first call: before the key
        self.replays = 0
        """Steps served by a graph (or its emulation) so far."""
        self.failed: str | None = None
        """Why capture failed, after which every step runs eagerly."""
        self._params = list(model.parameters())  # walking the modules each step costs ~0.1 ms
        self._key = self._weights_key()

    def _weights_key(self) -> tuple:
        """What a captured graph baked in: the backend and the storage of every weight (`.to()`
        and `share_projection_storage` move weights to new storage; in-place updates do not)."""
        kernels, m = self.model.kernels, self.model
        return (kernels.name, kernels.impl, [p.data_ptr() for p in self._params], self.cache.storage(),
                m.rope_cos.data_ptr(), m.rope_sin.data_ptr(), [t.data_ptr() for t in m.local_rope or ()])

    def _on_device(self):
        """The model's CUDA device made current for a capture or replay, when it is not."""
        dev = self.model.device
        if self.mode == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            return torch.cuda.device(dev)
        return contextlib.nullcontext()

    def _forward(self, entry: _Captured) -> torch.Tensor:
        return self.model.logits(self.model(entry.batch, self.cache))

    def _capture(self, bsz: int, width: int) -> _Captured:
        entry = _Captured(self.model, self.cache, bsz, width)
        if self.mode == "cuda":
            # the outer stream context is restored even when the graph's own exit raises (a failed
            # capture_end), so later eager steps do not run on the capture stream; the capture
            # stream first waits for what the step's stream has queued (cache writes, the inputs)
            self.stream.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.no_grad(), self._on_device(), torch.cuda.stream(self.stream):
                self._forward(entry)  # warm-up on padding only: compiles, allocates workspaces
                torch.cuda.synchronize(self.model.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    entry.logits = self._forward(entry)
            entry.graph = graph
            log.debug("captured a decode graph: batch %d, table width %d", bsz, width)
        return entry

    def run(self, tokens: list[int], positions: list[int],
            tables: list[list[int]]) -> torch.Tensor | None:
        """Logits [n, vocab] of one decode step (sequence i: token `tokens[i]` at `positions[i]`,
        its blocks `tables[i]`, already grown to hold it); None when the step runs eagerly instead
        (capture failed earlier, or the step is wider than any graph). The logits are the caller's:
        a copy, not the graph's buffer."""
        if self.failed is not None:
            return None
        n = len(tokens)
        if n == 0:
            return None
        bs = self.model.block_size
        need = max(positions) // bs + 1
        if need > self.max_width:
            return None
        key = self._weights_key()
        if key != self._key:  # weights on new storage, or another backend: recapture
            self.graphs.clear()
            self._key = key
            if self.mode == "cuda":  # a fresh pool: the old one may hold a workspace, not a graph
                self.pool = torch.cuda.graph_pool_handle()
            why = unsupported(self.model)
            if why is not None:
                self.failed = why
                log.warning("decode graphs off, steps run eagerly: %s", why)
                return None
        bsz, width = batch_bucket(n), width_bucket(need, self.max_width)
        entry = self.graphs.get((bsz, width))
        if entry is None:
            try:
                entry = self._capture(bsz, width)
            except Exception as err:  # noqa: BLE001 - any capture failure: eager from now on
                self.failed = _first_cause(err)
                log.warning("decode graphs off, steps run eagerly: capture failed (%s)", self.failed)
                return None
            self.graphs[(bsz, width)] = entry
        groups = entry.groups
        slots, flat = [[] for _ in range(groups)], [[] for _ in range(groups)]
        for own, p in zip(tables, positions):  # plain lists: a Python loop over tensors costs ms
            used = p // bs + 1
            for g, t in enumerate(own if groups > 1 else (own,)):  # (a window group: a pair of tables)
                slots[g].append(t[p // bs] * bs + p % bs)
                flat[g] += t[:used]
                flat[g] += [0] * (width - used)
        entry.packed.copy_(entry.pack(tokens, positions, slots, flat))
        self.replays += 1
        if entry.graph is None:  # emulation: the same static step, run eagerly
            with torch.no_grad():
                return self._forward(entry)[:n].clone()
        with self._on_device():
            entry.graph.replay()
        return entry.logits[:n].clone()
