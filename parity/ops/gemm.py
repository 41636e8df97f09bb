"""Small aligned GEMMs: how a product of few rows gets the bits of a large one.

MKL's float32 GEMM gives a row of `x @ W.T` bits that do not depend on the other rows once M >=
12 (`FREE_ROWS`); below that it takes a GEMV path (M < 4) or orders the last M mod 4 rows of a
5..11-row GEMM otherwise, while 4 and 8 rows take the large GEMM's path. So `linear` either
pads a small product to the next multiple of 4 rows, or, in float32 up to `GEMV_ROWS` rows,
computes it with the native matrix-vector kernel, which follows the large GEMM's per-element
order (K-blocks of `gemm_kblock(K)`, each a fused multiply-add chain from zero, added to the
bias left to right), at GEMV speed (two to three times the padded GEMM). Neither property is
assumed: a probe of this machine confirms each at first use (per thread count; per K for the
kernel), and a product whose probe fails keeps the 16-row padding the design started from.

Where even the large GEMM's rows are not fixed (measured on an Intel Xeon with AMX: MKL's float32
GEMM at 2 threads orders a row by M and thread count for K >= 1024, and oneDNN's bf16 GEMM picks
its kernel by M up to ~1,000 rows), the probe `_large_rows_hold` fails and GEMMs run *strict*:
every library GEMM on one thread, float32 padded to 16 rows (`STRICT_ROWS`), from which MKL's
single-threaded rows do not depend on M; bf16 as GEMMs of exactly 128 rows each
(`STRICT_BF16_ROWS`: one shape, one oneDNN kernel), or where that fails its probe, in float32
(bf16 values multiplied exactly, the sum rounded once). The cores share a product out by column
slices (fixed by the weight's shape) or row blocks. Never silently variant. Under autograd the
backward is ordinary multi-threaded math (`_StrictLinear`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..hardware import bf16_gemm_native
from . import native
from .common import gemm_linear

STRICT_ROWS = 16
"""In strict mode, the row count from which a single-threaded float32 GEMM's rows do not depend
on M (measured: 16 where MKL orders rows of up to 15 otherwise)."""

STRICT_BF16_ROWS = 128
"""In strict mode, the rows of each bf16 GEMM call (oneDNN picks its kernel by M: one shape, one
kernel). 128 kept ~0.85 of the unchunked speed with AMX where 32 kept ~0.2 (2026-12-04)."""

MIN_GEMM_ROWS = 16
"""Rows a small GEMM is padded to where the probe finds 4-row multiples unsafe, and the smallest
row count of attention's score and value GEMMs (fewer than 12 rows can change a row's order)."""

FREE_ROWS = 12
"""From this many rows up a GEMM's row bits do not depend on M (no padding)."""

ROW_QUANTUM = 4
"""Below `FREE_ROWS`, GEMMs of a multiple of this many rows take the large GEMM's path."""

_PROBE_SHAPES = ((64, 96), (256, 768), (1024, 1024), (1024, 3072))
"""(K, N) of the probe's GEMMs: the sizes of the presets' projections, small to Qwen3-0.6B's."""

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

_quantum: dict[tuple[int, bool], int] = {}
_strict: dict[bool, bool] = {}  # bf16 GEMM native -> strict mode
_bf16_chunks_ok: bool | None = None  # whether `_bf16_chunks` passed its probe (None: not probed)
_strict_lock = threading.RLock()  # the MKL thread count is process-wide: one strict GEMM at a time
_LARGE_ROWS = (STRICT_ROWS, 17, 24, 37, 64, 100)
"""Row counts the large-GEMM probe compares with a 160-row GEMM (where MKL and oneDNN were seen
to change a row's order: below 16 rows, at 33-36 and above, with M-dependent thread splits)."""


def _large_rows_hold(linear, dtypes: tuple[torch.dtype, ...] | None = None) -> bool:
    """Whether `linear`'s rows, for 16-100 of them at two offsets, are those of a 160-row
    product, at one and at two threads, and the same at both, for the probe shapes (float32, and
    bfloat16 where the CPU has a bf16 GEMM). Probed at fixed thread counts, so that every process
    of a run (workers and learner run at different counts) reaches the same answer. ~0.1 s here."""
    gen = torch.Generator().manual_seed(4321)
    dtypes = dtypes or ((torch.float32,) + ((torch.bfloat16,) if bf16_gemm_native() else ()))
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            for dtype in dtypes:
                for k, n in _PROBE_SHAPES[1:3]:  # (where the Xeon failed; 3072 wide doubles the cost)
                    x = torch.randn(160, k, generator=gen).to(dtype)
                    w = torch.randn(n, k, generator=gen).to(dtype)
                    fulls = []
                    for t in (1, 2):
                        torch.set_num_threads(t)
                        fulls.append(full := linear(x, w))
                        for m in _LARGE_ROWS:
                            for off in (0, 160 - m):
                                if not torch.equal(linear(x[off:off + m], w), full[off:off + m]):
                                    return False
                    if not torch.equal(*fulls):
                        return False
    finally:
        torch.set_num_threads(threads)
    return True


def strict() -> bool:
    """Whether GEMMs run strict on this machine: the large-GEMM probe failed (once per process
    and bf16 GEMM path; the same answer in every process of a run). PARITY_GEMM_STRICT=1|0
    overrides the probe (to measure what strict mode costs or prevents)."""
    key = bf16_gemm_native()
    got = _strict.get(key)
    if got is not None:
        return got
    forced = os.environ.get("PARITY_GEMM_STRICT")  # "1" or "0": override the probe (comparisons)
    if forced not in (None, "", "0", "1"):
        raise ConfigError(f"PARITY_GEMM_STRICT must be 1 or 0, got {forced!r}")
    if forced:
        got = _strict[key] = forced == "1"
    else:
        got = _strict[key] = not _large_rows_hold(gemm_linear)
        if got and not _large_rows_hold(_strict_product):
            logging.getLogger(__name__).warning(
                "this machine's GEMM rows depend on the row count even on one thread in float32: "
                "aligned kernels may not be invariant here (run `parity check`)")
    return got


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


def _strict_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    chunked: bool | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)`, the strict regime's GEMM, every library call on one thread: bf16
    (with a bf16 GEMM) as calls of exactly STRICT_BF16_ROWS rows (the last one padded; one shape,
    so oneDNN takes one kernel whatever M) where that passes the probe (`chunked`), else in
    float32 (float64 stays float64) padded to STRICT_ROWS rows and rounded back. Large weights
    are cut into column slices, large products into row blocks, shared among the threads."""
    if chunked is None:
        chunked = x.dtype == torch.bfloat16 == weight.dtype and bf16_gemm_native() and _bf16_chunks_hold()
    rows, (n, k) = x.shape[0], weight.shape
    acc = x.dtype if chunked else torch.promote_types(x.dtype, torch.float32)
    unit = STRICT_BF16_ROWS if chunked else STRICT_ROWS
    xp = _pad_rows(x, -(-rows // unit) * unit if chunked else max(rows, unit)).to(acc)
    w = weight.to(acc)
    b = None if bias is None else bias.to(acc)

    def product(r0: int, r1: int, lo: int, hi: int) -> torch.Tensor:
        ws, bs = w[lo:hi], None if b is None else b[lo:hi]
        if not chunked:
            return F.linear(xp[r0:r1], ws, bs)
        return torch.cat([F.linear(xp[i:i + unit], ws, bs) for i in range(r0, r1, unit)])

    cols = _slices(n, k, chunked)
    with _one_thread() as threads:
        if len(cols) > 1:
            y = torch.cat(_parallel([lambda s=s: product(0, xp.shape[0], *s) for s in cols], threads), 1)
        else:
            blocks = _row_blocks(xp.shape[0], unit, threads)
            y = torch.cat(_parallel([lambda r=r: product(*r, 0, n) for r in blocks], threads), 0)
    return y[:rows].to(x.dtype)


_bf16_chunks = functools.partial(_strict_forward, chunked=True)  # the 128-row path, as probed


def _bf16_chunks_hold() -> bool:
    """Whether `_bf16_chunks` passes the large-GEMM probe here (else strict bf16 runs in float32)."""
    global _bf16_chunks_ok
    if _bf16_chunks_ok is None:
        _bf16_chunks_ok = _large_rows_hold(_bf16_chunks, (torch.bfloat16,))
    return _bf16_chunks_ok


class _StrictLinear(torch.autograd.Function):
    """The strict product under autograd: the forward's bits are `_strict_forward`'s, the
    backward is ordinary math on every thread (only forward log-probs must match the engine's)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _strict_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = grad.matmul(weight.to(grad.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = grad.t().matmul(x.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = grad.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _strict_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The strict regime's GEMM (`_strict_forward`), through `_StrictLinear` when a gradient is due."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _StrictLinear.apply(x, weight, bias)
    return _strict_forward(x, weight, bias)


def _probe_quantum() -> int:
    """ROW_QUANTUM if, at this thread count, every row of 4- and 8-row GEMMs (at row offsets 0, 4
    and 20) equals that row of a 32-row GEMM, for the probe shapes in float32 (and bfloat16 where
    the CPU has a bf16 GEMM); else MIN_GEMM_ROWS. ~10 ms, once per thread count."""
    gen = torch.Generator().manual_seed(1234)
    dtypes = [torch.float32] + ([torch.bfloat16] if bf16_gemm_native() else [])
    with torch.no_grad():
        for dtype in dtypes:
            for k, n in _PROBE_SHAPES:
                x = torch.randn(32, k, generator=gen).to(dtype)
                w = torch.randn(n, k, generator=gen).to(dtype)
                full = gemm_linear(x, w)
                for m in (4, 8):
                    for off in (0, 4, 20):
                        if not torch.equal(gemm_linear(x[off:off + m], w), full[off:off + m]):
                            return MIN_GEMM_ROWS
    return ROW_QUANTUM


GEMV_ROWS = 8
"""Float32 products of at most this many rows go to the native matrix-vector kernel, one pass
over the weights (where its order is the GEMM's, see `_gemv_order_holds`)."""

_gemv_ok: dict[tuple[int, int], bool] = {}


def gemm_kblock(k: int) -> int:
    """The K-blocking of MKL's float32 GEMM seen on this machine kind: one block up to 192
    input positions, two halves below 384, else blocks of 192 (the last one the rest)."""
    return k if k <= 192 else (k // 2 if k < 384 else 192)


def _gemv_order_holds(k: int) -> bool:
    """Whether, for this K at this thread count, the native matrix-vector kernel (blocks of
    `gemm_kblock(k)`, bias first) gives bit for bit the rows of a 16-row float32 GEMM, with and
    without bias, for 1 and 8 rows, at 12 outputs (the fewest it takes: below 12, MKL orders the
    sums otherwise) and at 83 (a vector body and a scalar tail). Probed once per K (< 1 ms);
    where it fails, that K keeps the padded GEMM."""
    key = (k, torch.get_num_threads())
    ok = _gemv_ok.get(key)
    if ok is None:
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(16, k, generator=gen)
        ok = True
        with torch.no_grad():
            for n in (FREE_ROWS, 83):
                w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
                ok = ok and all(
                    torch.equal(native.gemv(x[:m], w, bias, gemm_kblock(k)), F.linear(x, w, bias)[:m])
                    for bias in (None, b) for m in (1, 8))
        _gemv_ok[key] = ok
    return ok


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and (bias is None or bias.dtype == torch.float32) and weight.is_contiguous()
            and weight.shape[0] >= FREE_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and native.library() is not None and not strict() and _gemv_order_holds(x.shape[1]))


def token_rows(m: int, dtype: torch.dtype) -> int:
    """The row count a forward pads its token-wise work of `m` tokens to: none in float32 up to
    `GEMV_ROWS` (the matrix-vector kernel serves them, and `linear` still pads any product it
    cannot take), else `gemm_rows(m)`, so that each GEMM is padded once per forward."""
    if dtype == torch.float32 and m <= GEMV_ROWS and native.library() is not None and not strict():
        return m
    return gemm_rows(m)


def gemm_rows(m: int) -> int:
    """The row count a GEMM of `m` rows is padded to, so that each row's bits are those of any
    larger GEMM: `m` from `FREE_ROWS` up, else the next multiple of the probed quantum (4 here,
    16 where the probe fails)."""
    if strict():
        return max(m, STRICT_ROWS)
    if m >= FREE_ROWS:
        return m
    key = (torch.get_num_threads(), bf16_gemm_native())
    q = _quantum.get(key)
    if q is None:
        q = _quantum[key] = _probe_quantum()
    return q if q == MIN_GEMM_ROWS else max(q, -(-m // q) * q)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` with every row computed by the same GEMM path. [..., K] -> [..., N]"""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if x2.device.type == "cpu" and strict():
        return _strict_product(x2, weight, bias).view(*lead, weight.shape[0])
    if 0 < rows <= GEMV_ROWS and _gemv_applies(x2, weight, bias):
        y = native.gemv(x2, weight, bias, gemm_kblock(x2.shape[1]))
        return y.view(*lead, weight.shape[0])
    padded = gemm_rows(rows)
    if padded > rows:
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])
    y = gemm_linear(x2, weight, bias)
    if padded > rows:
        y = y[:rows]
    return y.view(*lead, weight.shape[0])


def describe() -> str:
    """The small-GEMM paths this process uses, in words (`parity check` prints it after its runs,
    so the matrix-vector probes of the model's K values have been made)."""
    if strict():
        bf16 = "128-row bf16 GEMMs" if bf16_gemm_native() and _bf16_chunks_hold() else "bf16 in float32"
        return (f"GEMMs strict: one thread per call, float32 padded to 16 rows, {bf16}, large ones "
                "shared among threads (GEMM rows here depend on M or threads: the probe failed)")
    pads = "4-row multiples" if gemm_rows(1) == ROW_QUANTUM else "16 rows (the 4-row probe failed here)"
    if native.library() is None:
        return f"small GEMMs padded to {pads}"
    threads = torch.get_num_threads()
    good = sorted(k for (k, t), ok in _gemv_ok.items() if t == threads and ok)
    bad = sorted(k for (k, t), ok in _gemv_ok.items() if t == threads and not ok)
    seen = f"K {', '.join(map(str, good))} confirmed" if good else "no K probed yet"
    if bad:
        seen += f"; K {', '.join(map(str, bad))} padded instead"
    return (f"small GEMMs padded to {pads}; float32 products of 1-{GEMV_ROWS} rows by the "
            f"matrix-vector kernel in the GEMM's order ({seen})")
