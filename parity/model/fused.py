"""Projection weights that live in one storage: q/k/v (and gate/up) as row blocks of one tensor.

Each decoder layer runs its q, k and v projections as one GEMM (and gate and up as another), so
the engine needs the concatenated weight. Kept as separate tensors, that concatenation is a copy:
cached for inference (another [q+k+v+gate+up] worth of weights held beside the model), rebuilt by
every learner forward (a copy per layer per forward, held until its backward). Here the parameters
are views into one buffer per layer and kind, laid out back to back, so the fused weight is that
buffer: no copy, nothing cached. Under autograd `FusedView` hands the buffer to the GEMM and its
gradient back to the parameters as row blocks. Parameters keep their names and shapes; where they
do not share a buffer (weights assigned from elsewhere) the model concatenates as before.
"""

from __future__ import annotations

import torch


def adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor the `parts` are consecutive row blocks of (a view of their shared storage), or
    None when they are not laid out back to back in one storage."""
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
               and p.shape[1:] == first.shape[1:] for p in parts):
        return None
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, first.storage_offset(), (rows, *first.shape[1:]), first.stride())


def share_storage(parts: list[torch.nn.Parameter]) -> None:
    """Make `parts` row blocks of one new buffer (values kept; the Parameter objects, and so any
    optimizer holding them, unchanged). A no-op when they already are."""
    if adjacent(parts) is not None:
        return
    with torch.no_grad():
        buffer = torch.cat([p.detach() for p in parts])
    start = 0
    for p in parts:
        p.data = buffer[start:start + p.shape[0]]
        start += p.shape[0]


class FusedView(torch.autograd.Function):
    """`fused` (the parts' shared buffer) as a differentiable function of the parts: forward is the
    buffer itself, backward splits the gradient into the parts' row blocks."""

    @staticmethod
    def forward(ctx, fused: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
        ctx.rows = [p.shape[0] for p in parts]
        return fused.view_as(fused)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *grad.split(ctx.rows))
