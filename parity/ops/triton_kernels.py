"""Aligned kernels in Triton: the GPU form of `aligned.py`, one reduction order per output element.

Each kernel fixes how an output element is reduced from the shapes that describe the *element*
alone (K for a GEMM, the hidden size for a norm, the key position for attention, the vocabulary
for a log-sum-exp), never from how many rows, queries or sequences share the launch:

- `matmul`: a tile per (device kind, dtype, weight shape) with a fixed K step, no split-K and
  no autotuning by M; a row of `x @ W.T` is reduced by the same sequence of tile products
  whatever M is and whichever tile the row lands in. Tiles by row count (`GEMM_TILES` ladders)
  only where a probe on the device finds they give the same bits.
- `rms_norm`: a fixed number of rows per program, the row's sum of squares in one block of
  next_pow2(H) (`triton_norm_rope.py`: the same per q/k head vector, then RoPE, in one pass).
- `silu_mul`: element-wise.
- attention (`triton_attention.py`): keys in pages of the cache's block size, in fixed splits
  from key 0, merged in split order, so a query's result depends on its position alone.
- `row_lse`: log-sum-exp per row over fixed `BLOCK_V` chunks in order (online max and sum).

Without a CUDA device the kernels run on CPU tensors through Triton's interpreter
(`TRITON_INTERPRET=1`, set here before Triton is imported when no GPU is visible), or, after
`triton_target.enable("sm_90")`, are compiled for that GPU and launched nowhere (`parity compile`:
registers, spills, shared memory and tensor-core use of every binary, without a GPU). Arguments
that change with the batch (row, query and block counts, batch strides) are never specialised,
so one binary serves every batch size: the learner and the engine run the same machine code. That proves the
blocking design in CI; it does not prove GPU bits or speed. There `_dot` replaces `tl.dot` by an
explicit float32 product-sum over K: the interpreter's `tl.dot` calls numpy's BLAS, which rounds
a row differently by where it sits in the tile (and mishandles bfloat16 operands). Products of
bf16 values are exact in float32, the values a bf16 tensor-core product accumulates.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from ..errors import ConfigError

if not torch.cuda.is_available() and not os.environ.get("PARITY_TRITON_COMPILE_ONLY"):
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ConfigError("the Triton kernels need Triton's interpreter on a machine without CUDA, "
                          "but triton was imported before it could be turned on: set "
                          "TRITON_INTERPRET=1 before starting Python")
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError as err:  # pragma: no cover - depends on the install
    raise ConfigError("the aligned kernels on CUDA are written in Triton, which is not installed "
                      "(pip install triton)") from err

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""True when the kernels run through Triton's CPU interpreter (no GPU)."""

LAUNCH: dict = {} if INTERPRET else {"enable_fp_fusion": False}
"""Options every compiled launch passes: no contraction of a product and a sum into one fused
multiply-add. Triton's default flips from on (3.9) to off (3.10); pinned, a kernel's bits do not
change with the installed Triton's default, and element-wise math rounds as PyTorch's separate
ops and the interpreter do. Matrix products are unaffected (MMA, or explicit FMA for IEEE fp32)."""


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python (`triton.cdiv` called from the host costs microseconds a launch)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


_NO_CONTEXT = contextlib.nullcontext()


def _on(*tensors: torch.Tensor):
    """The launch context for these tensors: their CUDA device made current when it is not (a
    kernel launches on the current device, which need not be the tensors'), after checking what
    a compiled kernel takes (the interpreter would accept more: a float64 dot, mixed operand
    dtypes). Cheap on the common path: it runs before every launch."""
    first = tensors[0]
    dtype = first.dtype
    if dtype not in _TL_DTYPES or any(t.dtype != dtype for t in tensors):
        bad = next((t.dtype for t in tensors if t.dtype not in _TL_DTYPES), None)
        if bad is not None:
            raise ConfigError(f"the Triton kernels take float32, bfloat16 or float16 tensors, not {bad}")
        other = next(t.dtype for t in tensors if t.dtype != dtype)
        raise ConfigError(f"the Triton kernels need operands of one dtype, got {dtype} and {other}")
    if first.is_cuda and first.device.index != torch.cuda.current_device():
        return torch.cuda.device(first.device)
    return _NO_CONTEXT


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy when its first element is not 16-byte aligned. Triton specialises
    pointers on 16-byte alignment, which changes how a binary loads and may change how it lays out
    a reduction: rows starting mid-buffer (a slice of logits, say) would get a binary of their own
    and could get other bits than the same rows elsewhere. The copy keeps one binary for every call."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


Tile = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM."""

GEMM_TILES: dict[tuple[str, int, int], tuple[tuple[int | None, Tile], ...]] = {}
"""Tiles chosen for particular weight shapes, from `parity bench gemm` on a GPU: (dtype name, N, K)
-> rungs ((max_rows, tile), ..., (None, tile)); a product of M rows takes the first rung with
M <= max_rows (None: any M). Other shapes take the default tile. One rung is a tile for every M.
Several rungs (small tiles for decode, where many programs are wanted, large ones for prefill)
keep a row's bits independent of M only if every rung's tile reduces an element the same way:
same BLOCK_K, same matrix instruction. That is a property of the GPU, so it is never assumed: a
probe on the device (`ladder_holds`) compares the rungs' products bit for bit at first use, and
where they differ the last rung serves every M. Code, not configuration: the learner and every
rollout worker read the same table."""


def gemm_tiles(dtype: torch.dtype, n: int, k: int, m: int | None = None,
               device: torch.device | None = None) -> Tile:
    """The GEMM tile for a weight [n, k] and `m` rows: a function of the device kind, the dtype and
    the weight's shape, and of M only through a ladder of `GEMM_TILES` that the device's probe
    confirmed gives every M the same bits (that is the whole invariance argument for the GEMM: a
    row is reduced by the same sequence of products whatever M is)."""
    rungs = GEMM_TILES.get((str(dtype).removeprefix("torch."), n, k))
    if rungs:
        if m is None or len(rungs) == 1 or not ladder_holds(dtype, n, k, device):
            return rungs[-1][1]
        return next(t for top, t in rungs if top is None or m <= top)
    if INTERPRET:
        return 64, 128, 64, 4, 1  # big tiles: the interpreter's cost is per program, not per flop
    if dtype == torch.float32:
        return 64, 64, 16, 4, 3  # FMA in one chain over K whatever BLOCK_K; 32 spilled 16 bytes
    return 64, 128, 64, 4, 3


_LADDERS: dict[tuple, str] = {}
"""(device, dtype, N, K, rungs) -> the probe's verdict: 'same bits' or why not."""


def ladder_holds(dtype: torch.dtype, n: int, k: int, device: torch.device | None = None) -> bool:
    """Whether every rung of the ladder for (dtype, n, k) gives the same bits on `device`: the
    products of 192 rows by a weight of about min(n, 1024) outputs (N's divisibility by 16 kept,
    so the probe runs the model's binaries), without and with a bias, entries spread over
    2^-8..2^8 so that a different order of accumulation shows, under `torch.equal`, once per
    process. During a CUDA graph's capture nothing can be compared: the last rung serves (right
    either way) and the probe runs at the next eager call. Compiling without a GPU (`parity
    compile`) launches nothing, so there every rung is taken as holding: that run checks
    resources, not bits."""
    rungs = GEMM_TILES[(str(dtype).removeprefix("torch."), n, k)]
    if device is None or (device.type == "cuda" and device.index is None):  # a tensor's has one
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype, n, k, rungs)  # on every launch: kept cheap
    verdict = _LADDERS.get(key)
    if verdict is None:
        from . import triton_target

        if triton_target.active() is not None:
            return True
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        verdict = _LADDERS[key] = _probe_ladder(dtype, n, k, rungs, device)
    return verdict == "same bits"


def _probe_ladder(dtype: torch.dtype, n: int, k: int, rungs, device: torch.device) -> str:
    """'same bits', or why the ladder's rungs cannot share the rows (see `ladder_holds`)."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    name = "x".join

    def spread(*shape: int) -> torch.Tensor:
        scale = torch.exp2(torch.randint(-8, 9, shape, generator=gen).float())
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    first = None
    with torch.no_grad():
        for _, t in rungs:
            try:  # the float32 sums too: a bf16 output hides most differences in them
                if first is None:  # inside the try: no memory for the probe is a refusal too
                    n_probe = min(n, 1024 + n % 16)
                    x, w, b = spread(192, k), spread(n_probe, k), spread(n_probe)
                out = torch.cat([matmul(x, w, tiles=t).float(), matmul(x, w, b, tiles=t).float(),
                                 matmul(x, w, tiles=t, out_dtype=torch.float32)])
            except Exception as err:  # noqa: BLE001 - a tile this GPU refuses (shared memory), no memory
                return f"{name(map(str, t))} does not run here ({type(err).__name__})"
            if first is None:
                first = out
            elif not torch.equal(out, first):
                return f"{name(map(str, t))} differs from {name(map(str, rungs[0][1]))}"
    return "same bits"


def describe_tiles() -> str:
    """The GEMM tiles in force, in words (`parity check` prints it)."""
    if not GEMM_TILES:
        return "GEMM: one default tile per dtype"
    probed = [f"{dt} {n}x{k}: {v}" for (_dev, d, n, k, rungs), v in _LADDERS.items()
              for dt in [str(d).removeprefix("torch.")] if GEMM_TILES.get((dt, n, k)) == rungs]
    return (f"GEMM: tiles for {len(GEMM_TILES)} weight shapes"
            + (f"; tiles by row count probed ({'; '.join(probed)})" if probed else ""))


_ROWS = 64 if INTERPRET else 4
"""Rows per program of the row-wise kernels (norm, SwiGLU, log-sum-exp): a constant, so a row's
reduction (over its own columns) is laid out the same whatever the row count."""


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b. On a GPU `tl.dot` (tensor cores; ieee for float32). In the interpreter an
    explicit float32 product-sum over K (numpy's BLAS, which `tl.dot` calls there, rounds a row
    differently by where it sits in the tile; a GPU's MMA units do not)."""
    if INTERP:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# ----------------------------------------------------------------------------- GEMM
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                   sxm, sxk, swn, swk, som, son,
                   HAS_BIAS: tl.constexpr, INTERP: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: logits reach 2^31 elements
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one K order, from 0 up in fixed steps: no split-K
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = _dot(a, b, acc, INTERP, IEEE)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: Tile | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for 2-D x [M, K], weight [N, K]; float32 accumulation, output in
    x's dtype (or `out_dtype`: float32 gives the sums unrounded). A row's bits do not depend on M
    or on the other rows. `tiles` overrides `gemm_tiles` (`parity bench gemm` tries candidates,
    the ladder probe compares rungs; the model never passes it)."""
    x = _aligned(x)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps, stages = tiles or gemm_tiles(x.dtype, n, k, m, x.device)
    grid = (_cdiv(m, bm), _cdiv(n, bn))
    with _on(x, weight):
        _matmul_kernel[grid](
            x, weight, bias if bias is not None else x, out, m, n, k,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, INTERP=INTERPRET,
            IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=warps, num_stages=stages, **LAUNCH)
    return out


# ----------------------------------------------------------------------------- RMSNorm
@triton.jit(do_not_specialize=["R"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, H, sx, so, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) / H
    inv = 1.0 / tl.sqrt(mean_sq + eps)
    normed = (x * inv[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)  # Qwen3: cast, scale
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * so + cols[None, :],
             (w[None, :] * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, statistics in float32, result in x's dtype."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    x2 = _aligned(x2 if x2.stride(-1) == 1 else x2.contiguous())
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        with _on(x2):
            _rms_norm_kernel[(_cdiv(x2.shape[0], _ROWS),)](
                x2, weight, out, x2.shape[0], h, x2.stride(0), out.stride(0), eps,
                ROWS=_ROWS, BLOCK=_pow2(h), **LAUNCH)
    return out.view(x.shape)


# ----------------------------------------------------------------------------- SwiGLU
@triton.jit(do_not_specialize=["R"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, R, n_cols, sg, su, so,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < n_cols)
    g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + rows[:, None] * so + cols[None, :], (silu * u).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` in float32, returned in gate's dtype. Rows may be strided views."""
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = 1024 if INTERPRET else 256
    if g2.shape[0]:
        with _on(g2, u2):
            _silu_mul_kernel[(_cdiv(g2.shape[0], _ROWS), _cdiv(n, block))](
                g2, u2, out, g2.shape[0], n, g2.stride(0), u2.stride(0), out.stride(0),
                ROWS=_ROWS, BLOCK=block, **LAUNCH)
    return out.view(gate.shape)


# ----------------------------------------------------------------------------- log-sum-exp
@triton.jit(do_not_specialize=["R"])
def _row_lse_kernel(x_ptr, out_ptr, R, V, sx, inv_t, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live = rows < R
    cols = tl.arange(0, BLOCK_V)
    m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    s_i = tl.zeros((ROWS,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):  # fixed chunks, in order: the order depends on V alone
        c = v0 + cols
        z = tl.load(x_ptr + rows[:, None] * sx + c[None, :], mask=live[:, None] & (c[None, :] < V),
                    other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        m_new = tl.where(live, m_new, 0.0)  # dead rows stay finite
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(out_ptr + rows, m_i + tl.log(tl.where(live, s_i, 1.0)), mask=live)


def row_lse(logits: torch.Tensor, inv_t: float) -> torch.Tensor:
    """logsumexp(logits * inv_t) per row of a 2-D tensor, float32."""
    x = _aligned(logits if logits.stride(-1) == 1 else logits.contiguous())
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        rows = _ROWS if INTERPRET else 1  # a GPU: one row per program, the vocabulary is long
        with _on(x):
            _row_lse_kernel[(_cdiv(x.shape[0], rows),)](
                x, out, x.shape[0], x.shape[1], x.stride(0), inv_t,
                ROWS=rows, BLOCK_V=1024 if INTERPRET else 2048, **LAUNCH)
    return out
