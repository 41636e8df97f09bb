"""A mixture-of-experts block's routed experts (`Kernels.moe_experts`): each expert's GEMM chain.

Each expert runs one chain over the tokens routed to it: `linear` (gate and up, fused), `silu_mul`,
`linear` (down). `expert_loop` is that chain expert by expert on a bundle's own `linear` and
`silu_mul`; every bundle has it, and it is the only path under autograd (the learner). The aligned
CPU bundle's `aligned_experts` runs the experts that got 1-8 slots (the matrix-vector kernel's
sizes: engine decode, where a step sends about one token to each expert) in one native call,
`parity_moe_experts_f32`, with the code the loop's `gemm.linear` and `silu_mul` run per element:
the same bits (`tests/parity/test_moe_experts.py`) without some ten Python-level calls per expert.
The rest take the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import gemm, native


def expert_loop(linear: Callable, silu_mul: Callable) -> Callable:
    """`moe_experts` on a bundle's `linear` and `silu_mul`, one expert at a time."""

    def moe_experts(h: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: list[int] | None = None, parts: torch.Tensor | None = None) -> torch.Tensor:
        t, k = idx.shape
        flat = idx.reshape(-1)  # slot j of token i sits at i * k + j
        # one view per expert (under autograd, unbind's backward assembles the gradient once;
        # indexing per expert would allocate a whole zero gradient per expert)
        gate_up_w, down_w = gate_up.unbind(0), down.unbind(0)
        outs, where = [], []
        for e in flat.unique().tolist() if experts is None else experts:
            slots = (flat == e).nonzero().flatten()
            act = silu_mul(linear(h[slots // k], gate_up_w[e]))
            outs.append(linear(act, down_w[e]))
            where.append(slots)
        if not outs:
            return h.new_zeros(t * k, h.shape[1]) if parts is None else parts
        slots, rows = torch.cat(where), torch.cat(outs)
        if parts is None:  # (differentiable: out of place)
            return h.new_zeros(t * k, h.shape[1]).index_copy(0, slots, rows)
        return parts.index_copy_(0, slots, rows)  # (the native call's parts: nothing to differentiate)

    return moe_experts


def _fused_applies(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the one-call path gives the loop's bits here: float32 on the CPU with nothing to
    differentiate, and both products on the matrix-vector kernel (`gemm._gemv_applies`: its order
    confirmed for K = hidden and K = the experts' width)."""
    if not (h.dtype == gate_up.dtype == down.dtype == torch.float32 and h.device.type == "cpu"
            and gate_up.is_contiguous() and down.is_contiguous() and h.dim() == 2 and h.shape[0] > 0):
        return False
    if torch.is_grad_enabled() and (h.requires_grad or gate_up.requires_grad or down.requires_grad):
        return False
    lib = native.library()
    if lib is None or not hasattr(lib, "parity_moe_experts_f32"):
        return False
    return (gemm._gemv_applies(h[:1], gate_up[0], None)
            and gemm._gemv_applies(down[0, :1], down[0], None))  # (an x of the width's K)


ROWS = min(gemm.GEMV_ROWS, 8)
"""The most slots an expert may have to be served by the native call (its kernel takes 1-8 rows)."""


def _check(h: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """The shapes the native call reads through raw pointers (the loop raised on each; a wrong one
    read out of bounds there): one-line ValueErrors."""
    e, i2, hidden = gate_up.shape
    native._need(idx.dim() == 2 and idx.shape[0] == h.shape[0] and idx.dtype == torch.int64,
                 f"moe_experts: expert ids {tuple(idx.shape)} {idx.dtype} for {h.shape[0]} tokens")
    native._need(hidden == h.shape[1] and i2 % 2 == 0 and down.shape == (e, hidden, i2 // 2),
                 f"moe_experts: h {tuple(h.shape)}, gate_up {tuple(gate_up.shape)} and down "
                 f"{tuple(down.shape)} do not fit")


def aligned_experts(linear: Callable, silu_mul: Callable) -> Callable:
    """`moe_experts` for the aligned CPU bundle: the experts with 1-8 slots in one native call where
    `_fused_applies`, the others (and everything else) by `expert_loop`."""
    loop = expert_loop(linear, silu_mul)

    def moe_experts(h: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        if not _fused_applies(h, gate_up, down):
            return loop(h, idx, gate_up, down)
        _check(h, idx, gate_up, down)
        t, k = idx.shape
        n_exp, inter, hidden = gate_up.shape[0], down.shape[2], h.shape[1]
        h, flat = h.contiguous(), idx.reshape(-1)
        counts = torch.bincount(flat, minlength=n_exp)  # (a negative id raises here)
        native._need(counts.numel() == n_exp, f"moe_experts: an expert id past the {n_exp} experts")
        sizes = counts.tolist()
        rest = [e for e, c in enumerate(sizes) if c > ROWS]
        served = sum(c for c in sizes if c <= ROWS)
        if not served:  # (prefill: every expert has more than 8 slots)
            return loop(h, idx, gate_up, down, experts=rest)
        order = torch.argsort(flat, stable=True)
        offs = torch.zeros(n_exp + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offs[1:])
        parts = h.new_zeros(t * k, hidden)
        xs, gu, act, ys = (h.new_empty(served, n) for n in (hidden, 2 * inter, inter, hidden))
        done = native.library().parity_moe_experts_f32(
            native._ptr(h), native._ptr(order), native._ptr(offs), n_exp, k, native._ptr(gate_up),
            native._ptr(down), hidden, inter, gemm._gemv_kblock(hidden), gemm._gemv_kblock(inter),
            ROWS, native._ptr(xs), native._ptr(gu), native._ptr(act), native._ptr(ys),
            native._ptr(parts), torch.get_num_threads())
        if done < 0:
            raise MemoryError("moe_experts: no memory for the list of experts")
        assert done == sum(1 for c in sizes if 0 < c <= ROWS), (done, sizes)  # (every slot written once)
        return loop(h, idx, gate_up, down, experts=rest, parts=parts) if rest else parts

    return moe_experts
