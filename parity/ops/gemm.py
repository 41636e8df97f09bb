"""Small aligned GEMMs: how a product of few rows gets the bits of a large one.

MKL's float32 GEMM gives a row of `x @ W.T` bits that do not depend on the other rows once M >=
12 (`FREE_ROWS`); below that it takes a GEMV path (M < 4) or orders the last M mod 4 rows of a
5..11-row GEMM otherwise, while 4 and 8 rows take the large GEMM's path. So `linear` either
pads a small product to the next multiple of 4 rows, or, in float32 up to `GEMV_ROWS` rows,
computes it with the native matrix-vector kernel, which follows the large GEMM's per-element
order (K-blocks of `gemm_kblock(K)`, each a fused multiply-add chain from zero, added to the
bias left to right), at GEMV speed (two to three times the padded GEMM). Neither property is
assumed: a probe of this machine confirms each at first use (per thread count; per K for the
kernel), and a product whose probe fails keeps the 16-row padding the design started from. A
product of one output column (a gate's logit) is computed as one of four: MKL orders its rows
by M.

Where even the large GEMM's rows are not fixed (measured on an Intel Xeon with AMX: MKL's float32
GEMM at 2 threads orders a row by M and thread count for K >= 1024, and oneDNN's bf16 GEMM picks
its kernel by M up to ~1,000 rows), the probe `_large_rows_hold` fails and GEMMs run *strict*
(`gemm_strict.py`: float32 in K blocks (384 here) whose order is known, on a GEMM of our own where
the C kernels are built for AVX-512F, else one library thread per call padded to 16 rows; bf16 on
AMX tiles in an order of our own where the CPU has them, else in 128-row calls); there too float32
products of up to `GEMV_ROWS` rows go to the matrix-vector kernel, in the strict order, where its
probe confirms it. Never silently variant.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from ..errors import ConfigError
from ..hardware import bf16_gemm_native
from . import gemm_strict, native
from .common import check_linear_args, gemm_linear
from .gemm_strict import STRICT_ROWS

MIN_GEMM_ROWS = 16
"""Rows a small GEMM is padded to where the probe finds 4-row multiples unsafe, and the smallest
row count of attention's score and value GEMMs (fewer than 12 rows can change a row's order)."""

FREE_ROWS = 12
"""From this many rows up a GEMM's row bits do not depend on M (no padding)."""

ROW_QUANTUM = 4
"""Below `FREE_ROWS`, GEMMs of a multiple of this many rows take the large GEMM's path."""

_PROBE_SHAPES = ((64, 96), (256, 768), (1024, 1024), (1024, 3072))
"""(K, N) of the probe's GEMMs: the sizes of the presets' projections, small to Qwen3-0.6B's."""

_quantum: dict[tuple[int, bool], int] = {}
_strict: dict[bool, bool] = {}  # bf16 GEMM native -> strict mode
_bf16_chunks_ok: bool | None = None  # whether `_bf16_chunks` passed its probe (None: not probed)
_amx_ok: bool | None = None  # whether the AMX bf16 GEMM runs here and passed the probe (None: not asked)
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


_bf16_chunks = functools.partial(gemm_strict.forward, chunked=True)  # the 128-row path, as probed


def _bf16_chunks_hold() -> bool:
    """Whether `_bf16_chunks` passes the large-GEMM probe here (else strict bf16 runs in float32)."""
    global _bf16_chunks_ok
    if _bf16_chunks_ok is None:
        _bf16_chunks_ok = _large_rows_hold(_bf16_chunks, (torch.bfloat16,))
    return _bf16_chunks_ok


def _amx_holds() -> bool:
    """Whether strict bf16 products run on AMX tiles here (`native.amx_linear`): built, granted the
    tile state, and passing the large-GEMM probe (by its construction it should; checked anyway)."""
    global _amx_ok
    if not native.amx_ready():  # (asked each time: the native kernels can be switched off)
        return False
    if _amx_ok is None:
        _amx_ok = _large_rows_hold(native.amx_linear, (torch.bfloat16,))
    return _amx_ok


def _strict_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """A strict product's path (`gemm_strict.PATHS`): bf16 on AMX tiles, else in 128-row calls,
    where they pass their probes; otherwise float32."""
    if not (x.dtype == torch.bfloat16 == weight.dtype and bf16_gemm_native()):
        return "float32"
    if (bias is None or bias.dtype == x.dtype) and _amx_holds():
        return "amx"
    return "chunks" if _bf16_chunks_hold() else "float32"


def _strict_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The strict regime's GEMM (`gemm_strict.product`) on its path (`_strict_path`)."""
    return gemm_strict.product(x, weight, bias, _strict_path(x, weight, bias))


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
"""Products of at most this many rows go to the native matrix-vector kernel, one pass over the
weights (float32, and bf16 where it runs as float32: `_gemv_dtype`; where its order is the GEMM's,
see `_gemv_order_holds`)."""

_gemv_ok: dict[tuple[int, int, bool, torch.dtype], bool] = {}


def gemm_kblock(k: int) -> int:
    """The K-blocking of MKL's float32 GEMM seen on this machine kind: one block up to 192
    input positions, two halves below 384, else blocks of 192 (the last one the rest)."""
    return k if k <= 192 else (k // 2 if k < 384 else 192)


def _gemv_kblock(k: int) -> int:
    """The matrix-vector kernel's K blocks: the strict regime's where GEMMs run strict."""
    return gemm_strict.kblock() if strict() else gemm_kblock(k)


def _gemv_order_holds(k: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether, for this K and dtype at this thread count, the native matrix-vector kernel (blocks
    of `_gemv_kblock(k)`, bias first) gives bit for bit the rows of a 16-row GEMM (the library's,
    or the strict regime's), with and without bias, for 1 and 8 rows, at 12 outputs (the fewest it
    takes: below 12, MKL orders the sums otherwise) and at 83 (a vector body and a scalar tail).
    bfloat16 (which takes the kernel only where its products run in float32) is compared before
    rounding, with the float32 GEMM of its widened values: after rounding, a sum in another order
    would pass ~9,999 times in 10,000. Probed once per K and dtype (< 1 ms); where it fails, that K
    keeps the padded GEMM."""
    key = (k, torch.get_num_threads(), strict(), dtype)
    ok = _gemv_ok.get(key)
    if ok is None:
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(16, k, generator=gen).to(dtype)
        reference = functools.partial(gemm_strict.forward, chunked=False) if key[2] else gemm_linear
        ok = True
        with torch.no_grad():
            for n in (FREE_ROWS, 83):
                w, b = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
                for bias in (None, b):
                    full = reference(x.float(), w.float(), None if bias is None else bias.float())
                    ok = ok and all(torch.equal(native.gemv(x[:m], w, bias, _gemv_kblock(k)), full[:m])
                                    for m in (1, 8))
        _gemv_ok[key] = ok
    return ok


def _gemv_dtype(dtype: torch.dtype) -> bool:
    """Whether products of this dtype can take the matrix-vector kernel: float32, and bfloat16
    where the CPU has no bf16 GEMM (its products run in float32 anyway, `gemm_linear`; the kernel
    widens the bf16 weights as it reads them, half the bytes of a float32 copy and no copy made)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and not bf16_gemm_native())


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.dtype == weight.dtype and _gemv_dtype(x.dtype) and x.device.type == "cpu"
            and (bias is None or bias.dtype == x.dtype) and weight.is_contiguous()
            and weight.shape[0] >= FREE_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and native.library() is not None and _gemv_order_holds(x.shape[1], x.dtype))


def token_rows(m: int, dtype: torch.dtype) -> int:
    """The row count a forward pads its token-wise work of `m` tokens to: none up to `GEMV_ROWS`
    where the matrix-vector kernel serves the dtype (and `linear` still pads any product it
    cannot take), else `gemm_rows(m)`, so that each GEMM is padded once per forward."""
    if _gemv_dtype(dtype) and m <= GEMV_ROWS and native.library() is not None:
        return m
    if dtype == torch.bfloat16 and bf16_gemm_native() and strict() and _amx_holds():
        return m  # (AMX products need no padding)
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
    check_linear_args(x, weight, bias)
    if weight.shape[0] == 1 and x.device.type == "cpu":  # one output column: MKL's float32 path for it
        # orders a row by M (even past FREE_ROWS); as one of ROW_QUANTUM columns it is a GEMM row
        wide = torch.cat([weight, weight.new_zeros(ROW_QUANTUM - 1, weight.shape[1])])
        wide_bias = None if bias is None else torch.cat([bias, bias.new_zeros(ROW_QUANTUM - 1)])
        return linear(x, wide, wide_bias)[..., :1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if 0 < rows <= GEMV_ROWS and _gemv_applies(x2, weight, bias):
        y = native.gemv(x2, weight, bias, _gemv_kblock(x2.shape[1])).to(x2.dtype)
        return y.view(*lead, weight.shape[0])
    if x2.device.type == "cpu" and strict():
        return _strict_product(x2, weight, bias).view(*lead, weight.shape[0])
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
    threads, mode = torch.get_num_threads(), strict()
    probed = [(k, d, ok) for (k, t, s, d), ok in _gemv_ok.items() if (t, s) == (threads, mode)]
    bad = sorted((k, "" if d == torch.float32 else f" {str(d).removeprefix('torch.')}")
                 for k, d, ok in probed if not ok)
    good = sorted({k for k, _, ok in probed if ok} - {k for k, _ in bad})
    seen = f"K {', '.join(map(str, good))} confirmed" if good else "no K confirmed"
    if bad:
        seen += f"; K {', '.join(f'{k}{d}' for k, d in bad)} padded instead"
    gemv = "" if native.library() is None else (
        f"; {'float32' if bf16_gemm_native() else 'float32 and bf16'} products of 1-{GEMV_ROWS} rows by "
        f"the matrix-vector kernel in the GEMM's order ({seen})")
    if mode:
        chunks = bf16_gemm_native() and _bf16_chunks_hold()
        bf16 = "bf16 in 128-row GEMMs (the last 64 where it fits)" if chunks else "bf16 in float32"
        if bf16_gemm_native() and _amx_holds():
            bf16 = "bf16 on AMX tiles in a fixed order (every M, both cores, no padding)"
        f32 = (f"float32 on a GEMM of our own in K blocks of {gemm_strict.kblock()} (both cores, no padding)"
               if gemm_strict.native_f32() else f"float32 in one-thread library calls padded to 16 rows in K "
               f"blocks of {gemm_strict.kblock()}")
        return (f"GEMMs strict: {f32}, {bf16}, other library calls on one thread each, large ones shared "
                f"among threads (GEMM rows here depend on M or threads: the probe failed){gemv}")
    pads = "4-row multiples" if gemm_rows(1) == ROW_QUANTUM else "16 rows (the 4-row probe failed here)"
    return f"small GEMMs padded to {pads}{gemv}"
