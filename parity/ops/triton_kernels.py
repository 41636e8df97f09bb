"""Aligned kernels in Triton: the GPU form of `aligned.py`, one reduction order per output element.

Each kernel fixes how an output element is reduced from the shapes that describe the *element*
alone (K for a GEMM, the hidden size for a norm, the key position for attention, the vocabulary
for a log-sum-exp), never from how many rows, queries or sequences share the launch:

- the GEMM (`triton_gemm.py`): a tile per (dtype, weight shape) with a fixed K step, no split-K
  and no autotuning by M; a row of `x @ W.T` is reduced by the same sequence of tile products
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


@triton.jit
def _probe_kernel(out_ptr, n):
    acc = tl.zeros((1,), tl.float32)
    for _ in range(0, n):  # a loop bound read from an argument, as the GEMM's K loop is
        acc += 1.0
    tl.store(out_ptr + tl.arange(0, 1), acc)


def _probe_interpreter(kernel=_probe_kernel) -> None:
    """Launch one trivial kernel through the interpreter; a ConfigError if it cannot run there.

    Triton 3.6's interpreter turns a kernel's integer argument into a one-element numpy array and
    calls int() on it, which numpy 2.4 made an error: every kernel here would then fail deep inside
    the interpreter on its first launch. Found here, once, it is one line naming the versions."""
    import numpy

    out = torch.zeros(1)
    try:
        kernel[(1,)](out, 2)
    except Exception as err:  # whatever the interpreter raises, reported in one line
        raise ConfigError(f"Triton {triton.__version__}'s interpreter (the Triton kernels' CPU path) "
                          f"cannot run a kernel under numpy {numpy.__version__}: {err}; install "
                          "'numpy<2.4' or a newer Triton (3.9 works)") from None
    if out.item() != 2.0:
        raise ConfigError(f"Triton {triton.__version__}'s interpreter computed {out.item()} for 1 + 1 "
                          "in a probe kernel: its CPU path cannot be trusted here")


def _patch_the_language_once_a_launch() -> None:
    """Have the interpreter patch `triton.language` once a launch, not again at each helper call.

    Triton's interpreter (3.9) swaps the language's builtins for interpreted ones at each launch and
    puts them back after it; a call of a `@triton.jit` helper inside the kernel (`_dot`, the
    attention's split step) patched them again, scanning every member of `tl`, `tl.tensor` and
    `tl.math` each time: tests/parity/test_triton.py took 198 s on one AVX2 core, 148 s without
    those scans. A helper whose
    language modules (`tl`, `tl.core`: Triton's own helpers, `tl.sum` say, see `tl.core` alone) the
    running launch has patched now runs on that patch; the first call of one that sees others patches
    them as before (the interpreter never undoes a helper's patch), and outside a launch, or on a
    Triton without these hooks, the interpreter does as it always did."""
    import threading

    from triton.runtime import interpreter as ti

    hooks = all(hasattr(ti, name) for name in ("GridExecutor", "InterpretedFunction", "InterpreterError"))
    if not (hooks and hasattr(ti.InterpretedFunction, "rewrite")) or hasattr(ti.GridExecutor.__call__,
                                                                            "__wrapped__"):
        return  # (a Triton without these hooks, or done already)
    launch, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
    state = threading.local()  # per thread: the language modules each running launch has patched

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patched_launch(self, *args, **kwargs):
        stack = state.__dict__.setdefault("stack", [])
        stack.append(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    def helper_call(self, *args, **kwargs):
        stack = getattr(state, "stack", None)
        if not stack:
            return device_call(self, *args, **kwargs)
        mine = langs(self.fn)
        if not mine or not mine <= stack[-1]:  # (none: the interpreter's own one-line refusal)
            stack[-1] |= mine  # patched by this call, and left so (as the interpreter leaves it)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter's own device call reports it
            raise ti.InterpreterError(repr(e)) from e

    patched_launch.__wrapped__, helper_call.__wrapped__ = launch, device_call  # (the tests' control)
    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = patched_launch, helper_call


if INTERPRET:
    _patch_the_language_once_a_launch()
    _probe_interpreter()


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


_ROWS = 64 if INTERPRET else 4
"""Rows per program of the row-wise kernels (norm, SwiGLU, log-sum-exp): a constant, so a row's
reduction (over its own columns) is laid out the same whatever the row count."""


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b. On a GPU `tl.dot` (tensor cores; ieee for float32). In the interpreter an
    explicit float32 product-sum over K (numpy's BLAS, which `tl.dot` calls there, rounds a row
    differently by where it sits in the tile; a GPU's MMA units do not). numpy sums a product in
    its memory order, which follows its operands': `b` must be laid out [K, N] row by row (as a
    pointer load makes it), or the same values sum in another order."""
    if INTERP:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


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
