"""The strict GEMM regime: products whose rows cannot depend on M, on machines where the library's
own do (`gemm.strict()` decides; `gemm.linear` calls `product`).

Every library call runs on one thread. float32 is padded to 16 rows (`STRICT_ROWS`), from which
MKL's single-threaded rows do not depend on M, and computed in K blocks (`kblock`: 384 input
positions on the AMX Xeon), one library GEMM each, accumulated left to right (`addmm_`, beta 1):
a GEMM of one block is one fused multiply-add chain from zero (probed; MKL's own blocking of
larger K varied with N there), so the order of every element is known and the native
matrix-vector kernel reproduces it for decode-sized products (`gemm.linear`). Where the C kernels
are built for AVX-512F, float32 runs instead on a GEMM of our own in that same order
(`native.gemm_f32`: both cores, no padding; `native_f32`), the library calls its reference. bf16 runs as
GEMMs of 128 rows each (`STRICT_BF16_ROWS`: oneDNN picks its kernel by M; the last call 64 rows
where its rows fit, `STRICT_BF16_TAIL`: the same kernel's bits) or, where that fails its probe,
in float32 (bf16 values multiplied exactly, the sum rounded once); on a CPU with AMX, bf16 runs
instead on tiles in an order of our own (`native.amx_linear`, `PATHS`). The cores share a product out
by column slices (fixed by the weight's shape) or row blocks. Under autograd the forward keeps
these bits and the backward is ordinary multi-threaded math (`_StrictLinear`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import torch.nn.functional as F

from . import native

STRICT_ROWS = 16
"""In strict mode, the row count from which a single-threaded float32 GEMM's rows do not depend
on M (measured: 16 where MKL orders rows of up to 15 otherwise)."""

STRICT_BF16_ROWS = 128
"""In strict mode, the rows of each bf16 GEMM call but a product's last (oneDNN picks its kernel by
M: fixed shapes, fixed kernels). 128 kept ~0.85 of the unchunked speed with AMX where 32 kept
~0.2 (2026-12-04)."""

STRICT_BF16_TAIL = 64
"""The last bf16 call of a strict product is padded to this many rows where its rows fit (else to
STRICT_BF16_ROWS): oneDNN's rows from 37- to 128-row calls were those of the 128-row call (7
weight shapes, one thread, AMX Xeon; the probe confirms it at first use). Halves the GEMM work
of a decode step (a 64-row call took 0.6-0.65 of the 128-row call's time)."""

KBLOCKS = (384, 192)
"""Candidate K blocks of strict float32 products, largest first. The first at which this machine's
one-thread GEMM is one fused multiply-add chain from zero is used (`kblock`), so that the
matrix-vector kernel can follow the order: 384 on the AMX Xeon (measured for K = 32-384 at N =
2-1024; above 384 MKL's own blocking there varies with N), 192 where MKL blocks K by 192."""

SPLIT_MIN_WEIGHT = {False: 1 << 21, True: 1 << 25}
"""Strict products whose weight has this many elements (K x N; float32 path, 128-row bf16 path)
are cut into column slices; below, a slice gains less than a hand-off costs (~90 us; AMX bf16 is
fast up to lm-head sizes). By the weight alone: never by M or the threads."""

SPLIT_PARTS = 4
"""Column slices of a sliced product (fewer where N is narrow), fixed: a GEMM's sums can depend on
N (oneDNN's bf16 at K = 768 rounds 128 columns otherwise than 256), so every call slices alike."""

SPLIT_MIN_COLUMNS = 512
"""Column slices are at least this many outputs wide (multiples of 64; the last one the rest)."""

SPLIT_ROWS = 256
"""Products of this many rows not sliced by columns are shared out by rows: whole 128-row bf16
calls, float32 blocks of STRICT_ROWS multiples (rows independent of M: the strict premise)."""

_strict_lock = threading.RLock()  # the MKL thread count is process-wide: one strict GEMM at a time
_kblock: int | None = None  # the K block chosen by `kblock` (None: not probed yet)
_native_f32: bool | None = None  # whether `native.gemm_f32` is built here (None: not asked yet)


@contextlib.contextmanager
def _one_thread():
    """MKL and oneDNN on one thread, one product at a time (the thread count is process-wide);
    yields the thread count the process had, which a split product shares out."""
    with _strict_lock:
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            yield threads
        finally:
            if threads > 1:
                torch.set_num_threads(threads)


_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool), under _strict_lock


def _on_one_thread(fn, grad: bool, inference: bool):
    """Run `fn` in a pool thread with one library thread (a thread's OpenMP count is its own, set
    when it first computes) and the caller's grad and inference modes (those are per thread)."""
    torch.set_num_threads(1)
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn()


def _parallel(tasks: list, threads: int) -> list[torch.Tensor]:
    """Each task's result, in order; the tasks shared out in contiguous groups among `threads`
    threads at once (the caller's among them). Called under `_one_thread`."""
    global _pool
    groups = min(threads, len(tasks))
    if groups < 2:
        return [task() for task in tasks]
    bounds = [len(tasks) * g // groups for g in range(groups + 1)]
    work = [tasks[a:b] for a, b in zip(bounds, bounds[1:])]
    if _pool is None or _pool[0] != os.getpid() or _pool[1] < groups - 1:  # (a forked child: no threads)
        _pool = (os.getpid(), groups - 1, ThreadPoolExecutor(groups - 1, thread_name_prefix="parity-gemm"))
    modes = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    futures = [_pool[2].submit(_on_one_thread, lambda g=g: [task() for task in g], *modes) for g in work[1:]]
    try:
        first = [task() for task in work[0]]
    finally:  # the pool's tasks end before the caller restores the thread count
        wait(futures)
    return [*first, *(y for f in futures for y in f.result())]


def _slices(n: int, k: int, chunked: bool) -> list[tuple[int, int]]:
    """The output-column slices of a strict product with an N x K weight on the 128-row bf16
    path (`chunked`) or the float32 one: a function of the weight's shape and the path only."""
    parts = min(SPLIT_PARTS, n // SPLIT_MIN_COLUMNS) if n * k >= SPLIT_MIN_WEIGHT[chunked] else 1
    if parts < 2:
        return [(0, n)]
    cuts = [0, *((n * i // parts) // 64 * 64 for i in range(1, parts)), n]
    return list(zip(cuts, cuts[1:]))


def _row_blocks(m: int, unit: int, threads: int) -> list[tuple[int, int]]:
    """Row ranges of an `m`-row product for `threads` threads, at multiples of `unit` rows (one
    range below SPLIT_ROWS rows)."""
    units = m // unit
    parts = min(threads, units) if m >= SPLIT_ROWS else 1
    cuts = [*(units * i // parts * unit for i in range(parts)), m]  # (the last block: the rest)
    return list(zip(cuts, cuts[1:]))


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if rows > x.shape[0] else x


def kblock() -> int:
    """The K block of strict float32 products: the first of KBLOCKS whose one-thread 16-row GEMM
    gives the matrix-vector kernel's single chain (1 and 8 rows, 12 and 83 outputs; once per
    process, at one thread: every process of a run chooses alike), else the first (the kernel's
    own probe then keeps it off)."""
    global _kblock
    if _kblock is None:
        _kblock = next((kb for kb in KBLOCKS if _one_chain(kb)), KBLOCKS[0])
    return _kblock


def native_f32() -> bool:
    """Whether strict float32 products run on the native GEMM (`forward`): built here (the C
    kernels compiled, AVX-512F). Once per process."""
    global _native_f32
    if _native_f32 is None:
        one = torch.ones(1, 1)
        _native_f32 = native.library() is not None and native.gemm_f32(one, one, None, 1) is not None
    return _native_f32


def _one_chain(k: int) -> bool:
    if native.library() is None:
        return False
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(16, k, generator=gen)
    with torch.no_grad(), _one_thread():
        return all(torch.equal(native.gemv(x[:m], w, None, k), F.linear(x, w)[:m])
                   for w in (torch.randn(n, k, generator=gen) for n in (12, 83)) for m in (1, 8))


def _join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The pieces of a product side by side; one piece as it is (`torch.cat` would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _chunk_rows(m: int) -> int:
    """The rows an `m`-row bf16 product is padded to: whole 128-row calls, the rest in one call of
    STRICT_BF16_TAIL rows where it fits, else of 128."""
    rest = m % STRICT_BF16_ROWS
    tail = 0 if rest == 0 else STRICT_BF16_TAIL if rest <= STRICT_BF16_TAIL else STRICT_BF16_ROWS
    return m - rest + tail


def _kblocked(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kb: int) -> torch.Tensor:
    """`F.linear` in K blocks of `kb` positions, added left to right (bias first)."""
    y = F.linear(x[:, :kb], w[:, :kb], b)
    for k0 in range(kb, x.shape[1], kb):
        y.addmm_(x[:, k0:k0 + kb], w[:, k0:k0 + kb].t())
    return y


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
            chunked: bool) -> torch.Tensor:
    """`x @ weight.T (+ bias)`: float32 products (and bf16 ones not `chunked`) by the native GEMM
    in the matrix-vector kernel's order where it is built (`native.gemm_f32`: both cores, no
    padding, no hand-off); else every library call on one thread: bf16 (with a bf16 GEMM) as calls
    of STRICT_BF16_ROWS rows (the last one padded to STRICT_BF16_TAIL rows where they fit: oneDNN
    gives those rows the same bits) where that passes its probe (`chunked`), else in float32
    (float64 stays float64) padded to STRICT_ROWS rows, in K blocks (float32), rounded back.
    Large weights are cut into column slices, large products into row blocks, shared among the
    threads."""
    rows, (n, k) = x.shape[0], weight.shape
    acc = x.dtype if chunked else torch.promote_types(x.dtype, torch.float32)
    if acc == torch.float32 and native.library() is not None and (kb := kblock()):
        # both cores on every product, unpadded, in the matrix-vector kernel's order (the order of
        # the K-blocked library calls below: `tests/parity/test_gemm_f32.py`); None: not built
        y = native.gemm_f32(x.float(), weight.float(), None if bias is None else bias.float(), kb)
        if y is not None:
            return y.to(x.dtype)
    unit = STRICT_BF16_ROWS if chunked else STRICT_ROWS
    xp = _pad_rows(x, _chunk_rows(rows) if chunked else max(rows, unit)).to(acc)
    w = weight.to(acc)
    b = None if bias is None else bias.to(acc)
    kb = kblock() if acc == torch.float32 else 0  # (probed here: never under the lock in a pool thread)

    def part(r0: int, r1: int, lo: int, hi: int) -> torch.Tensor:
        ws, bs = w[lo:hi], None if b is None else b[lo:hi]
        if not chunked:
            return _kblocked(xp[r0:r1], ws, bs, kb) if kb else F.linear(xp[r0:r1], ws, bs)
        return _join([F.linear(xp[i:i + unit], ws, bs) for i in range(r0, r1, unit)], 0)

    cols = _slices(n, k, chunked)
    with _one_thread() as threads:
        if len(cols) > 1:
            y = _join(_parallel([lambda s=s: part(0, xp.shape[0], *s) for s in cols], threads), 1)
        else:
            blocks = _row_blocks(xp.shape[0], unit, threads)
            y = _join(_parallel([lambda r=r: part(*r, 0, n) for r in blocks], threads), 0)
    return y[:rows].to(x.dtype)


PATHS = ("float32", "chunks", "amx")
"""A strict product's path (`gemm._strict_path` picks it): float32 (K blocks, padded rows), bf16
in 128-row oneDNN calls (`forward(chunked=True)`), or bf16 on AMX tiles in an order of our own
(`native.amx_linear`: every row's bits whatever M, no padding, both cores)."""


def _compute(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    if path == "amx":
        return native.amx_linear(x, weight, bias)
    return forward(x, weight, bias, chunked=path == "chunks")


class _StrictLinear(torch.autograd.Function):
    """The strict product under autograd: the forward's bits are `_compute`'s, the backward is
    ordinary math on every thread (only forward log-probs must match the engine's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, path):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _compute(x, weight, bias, path)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = grad.matmul(weight.to(grad.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = grad.t().matmul(x.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = grad.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """The strict regime's GEMM on `path` (one of PATHS), through `_StrictLinear` when a gradient
    is due."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _StrictLinear.apply(x, weight, bias, path)
    return _compute(x, weight, bias, path)
