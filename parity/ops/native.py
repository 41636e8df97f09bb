"""Loader for the fixed-order C kernels (`csrc/aligned_kernels.c`; `csrc/amx_gemm.c`: a bf16 GEMM on
AMX tiles where the CPU has them; `csrc/gemm_f32.c`: the strict float32 GEMM), built on first use.

The C files are compiled with the machine's C compiler (`-O3 -march=native -ffp-contract=off
-fopenmp`) into a per-user cache keyed by the source, the flags and the CPU, and called through
ctypes on float32 and bf16 tensors. Set `PARITY_NATIVE=0` to use the pure-PyTorch aligned kernels
instead; if no compiler is found parity falls back to them too. Either way both the engine and
the learner in one process run the same implementation, so parity holds; `parity check` says
which one is active.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import ConfigError
from .common import check_linear_args, score_scale

_SRC = Path(__file__).with_name("csrc") / "aligned_kernels.c"
_SOURCES = (_SRC, _SRC.with_name("amx_gemm.c"), _SRC.with_name("gemm_f32.c"))
_HEADERS = (_SRC.with_name("transpose16.h"),)  # (hashed with the sources: a change rebuilds)
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno",
          "-fopenmp", "-shared", "-fPIC"]
_lib = None
_reason = "not loaded yet"
_enabled = os.environ.get("PARITY_NATIVE", "1") != "0"


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("PARITY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "parity")
    return Path(root) / "native"


def _build(sources: tuple[Path, ...] = _SOURCES, headers: tuple[Path, ...] = _HEADERS) -> ctypes.CDLL:
    """Compile `sources` (the tests build mutated copies, their controls) into the cache and load them."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found")
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*sources, *headers))
                         + " ".join(_FLAGS).encode() + _cpu_signature().encode())
    out = _cache_dir() / f"aligned_kernels-{key.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            proc = subprocess.run([cc, *_FLAGS, "-o", str(tmp_so), *map(str, sources), "-lm"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {' and '.join(src.name for src in sources)} failed: "
                                   f"{proc.stderr.strip()[:200]}")
            os.replace(tmp_so, out)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(str(out))
    f, i64, p = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p
    for name in ("parity_attention_f32", "parity_attention_bf16"):
        getattr(lib, name).argtypes = [p, ctypes.c_int] + [p] * 6 + [i64] * 8 + [f, f, ctypes.c_int]
    lib.parity_row_lse.argtypes = lib.parity_row_lse_bf16.argtypes = [p, p, i64, i64, f, ctypes.c_int]
    for name in ("parity_token_lp_backward_f32", "parity_token_lp_backward_bf16"):
        getattr(lib, name).argtypes = [p, p, p, p, p, i64, i64, f, ctypes.c_int]
    for name in ("parity_rms_norm_f32", "parity_rms_norm_bf16"):
        getattr(lib, name).argtypes = [p, p, p, i64, i64, i64, i64, i64, f, p, p, ctypes.c_int]
    for name in ("parity_silu_mul_f32", "parity_silu_mul_bf16"):
        getattr(lib, name).argtypes = [p, p, p, i64, i64, i64, ctypes.c_int]
    for name in ("parity_swiglu_backward_f32", "parity_swiglu_backward_bf16"):
        getattr(lib, name).argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
    for name in ("parity_rms_norm_backward_f32", "parity_rms_norm_backward_bf16"):
        getattr(lib, name).argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, f, ctypes.c_int]
    for name in ("parity_gemv_f32", "parity_gemv_bf16w"):
        getattr(lib, name).argtypes = [p, p, p, p, i64, i64, i64, i64, ctypes.c_int]
    lib.parity_amx_ready.argtypes = []
    lib.parity_amx_linear_bf16.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
    lib.parity_gemm_f32.argtypes = [p, p, p, p, i64, i64, i64, i64, ctypes.c_int]
    lib.parity_moe_experts_f32.argtypes = [p, p, p, i64, i64, p, p] + [i64] * 5 + [p] * 5 + [ctypes.c_int]
    lib.parity_moe_experts_f32.restype = i64
    return lib


def library():
    """The loaded kernels, or None (pure-PyTorch fallback); built once per process."""
    global _lib, _reason
    if not _enabled:
        return None
    if _lib is None and _reason == "not loaded yet":
        try:
            _lib = _build()
            _reason = "native C kernels"
        except (RuntimeError, OSError) as exc:
            _reason = f"pure-PyTorch fallback ({exc})"
    return _lib


def set_enabled(flag: bool | None) -> bool:
    """Use (True) or bypass (False) the native kernels from now on; returns the previous value (None:
    only that). Switch only between whole experiments: log-probs computed by the two implementations
    differ in the last bits, so the engine and the learner must not straddle a switch (a local rollout
    worker takes its learner's setting at its start)."""
    global _enabled
    previous, _enabled = _enabled, _enabled if flag is None else flag
    return previous


def describe() -> str:
    """Which implementation of the aligned kernels this process uses, in words."""
    if not _enabled:
        return "pure-PyTorch aligned kernels (native disabled)"
    library()
    return _reason


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _need(ok: bool, what: str) -> None:
    """A shape the C code relies on (it reads through raw pointers: a wrong one reads out of bounds,
    returns garbage or crashes the process), checked here as a one-line ValueError."""
    if not ok:
        raise ValueError(what)


def paged_attention(q, k_blocks, v_blocks, tables, q_pos, with_lse: bool = False, window: int = 0,
                    softcap: float = 0.0, scale: float | None = None):
    """Causal GQA attention reading keys/values in place through block tables (with a sliding
    `window` > 0: over each query's last `window` keys; scores q.k times `scale`, None: 1/sqrt(D);
    with `softcap` > 0 capped to softcap * tanh(score / softcap)).

    q [B, M, Hq, D] (float32 or bfloat16, read as is; other dtypes as float32); key blocks
    [NB, Hkv, D, bs] and value blocks [NB, Hkv, bs, D] (float32 or bfloat16); tables [B, nblk] block
    ids; q_pos [B, M] (negative = padding row, zero).
    Returns float32 [B, M, Hq, D]; with `with_lse` also each row's natural log-sum-exp of the
    scaled scores, float32 [B, M, Hq] (+inf on padding rows), which the learner's backward uses.
    """
    kv_dtype = k_blocks.dtype if k_blocks.dtype in _SUFFIX else torch.float32
    q = (q if q.dtype in _SUFFIX else q.float()).contiguous()  # (a bf16 q is widened in the kernel)
    k_blocks, v_blocks = k_blocks.to(kv_dtype).contiguous(), v_blocks.to(kv_dtype).contiguous()
    tables = tables.to(torch.int64).contiguous()
    pos = q_pos.to(torch.int64).contiguous()
    b, m, hq, d = q.shape
    nb, hkv, bs = k_blocks.shape[0], k_blocks.shape[1], k_blocks.shape[-1]
    _need(k_blocks.shape == (nb, hkv, d, bs) and v_blocks.shape == (nb, hkv, bs, d) and hq % hkv == 0,
          f"attention: q {tuple(q.shape)} does not fit key blocks {tuple(k_blocks.shape)} and value "
          f"blocks {tuple(v_blocks.shape)}")
    _need(tables.dim() == 2 and tables.shape[0] == b and pos.shape == (b, m),
          f"attention: {b} sequences of {m} queries, got tables {tuple(tables.shape)} and positions "
          f"{tuple(pos.shape)}")
    out = torch.empty(b, m, hq, d, dtype=torch.float32)  # (padding rows: zeros, written by the kernel)
    lse = torch.empty(b, m, hq, dtype=torch.float32) if with_lse else None
    getattr(library(), f"parity_attention_{_SUFFIX[kv_dtype]}")(
        _ptr(q), int(q.dtype == torch.bfloat16), _ptr(k_blocks), _ptr(v_blocks), _ptr(tables), _ptr(pos),
        _ptr(out), None if lse is None else _ptr(lse), b, m, hq, k_blocks.shape[1], d, tables.shape[1],
        k_blocks.shape[3], int(window), score_scale(d, scale), float(softcap), torch.get_num_threads())
    return (out, lse) if with_lse else out


def to_blocks(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense k/v [B, L, Hkv, D] -> key blocks [B*nblk, Hkv, D, bs], value blocks [B*nblk, Hkv, bs, D]."""
    bsz, length, hkv, d = k.shape
    nblk = length // block_size
    kb = k.view(bsz, nblk, block_size, hkv, d).permute(0, 1, 3, 4, 2).reshape(bsz * nblk, hkv, d, block_size)
    vb = v.view(bsz, nblk, block_size, hkv, d).permute(0, 1, 3, 2, 4).reshape(bsz * nblk, hkv, block_size, d)
    return kb, vb


def attention(q, k, v, q_pos, block_size: int, with_lse: bool = False, window: int = 0, softcap: float = 0.0,
              scale: float | None = None):
    """Dense form: k/v [B, L, Hkv, D] (L a multiple of block_size), laid out as blocks in order."""
    bsz, nblk = k.shape[0], k.shape[1] // block_size
    tables = torch.arange(bsz * nblk).view(bsz, nblk)
    return paged_attention(q, *to_blocks(k, v, block_size), tables, q_pos, with_lse, window, softcap, scale)


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(x, outer, inner, outer stride, inner stride) of RMSNorm rows: [T, heads, n] may be strided
    (heads read out of a fused QKV output), anything else is made contiguous rows."""
    n = x.shape[-1]
    if x.dim() == 3:
        x = x if x.stride(-1) == 1 else x.contiguous()
        return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    x = x.contiguous()
    return x, x.numel() // n, 1, n, 0


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `rms_norm(x, weight, eps)` for the output gradient `grad` (same shape as x):
    (grad_x in x's dtype and shape, grad_weight float32 [n]). One pass per row."""
    _need(weight.numel() == x.shape[-1] and grad.shape == x.shape,
          f"rms_norm backward: x {tuple(x.shape)}, weight {tuple(weight.shape)}, grad {tuple(grad.shape)}")
    x, outer, inner, so, si = _row_layout(x)
    n = x.shape[-1]
    threads = torch.get_num_threads()
    w = weight.to(x.dtype).contiguous()
    grad = grad.to(x.dtype).contiguous()
    grad_x = torch.empty(x.shape, dtype=x.dtype)
    parts = torch.zeros(threads, n, dtype=torch.float32)  # one partial sum of grad_w per thread
    getattr(library(), f"parity_rms_norm_backward_{_SUFFIX[x.dtype]}")(
        _ptr(x), _ptr(w), _ptr(grad), _ptr(grad_x), _ptr(parts), outer, inner, n, so, si, eps, threads)
    return grad_x, parts.sum(0)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of `silu_mul(gate, up)` where gate and up are the two halves of one [rows, 2 * cols]
    tensor: returns the gradient of that whole tensor, [rows, 2 * cols] in its dtype."""
    rows, cols = gate.shape
    _need(up.shape == gate.shape and grad.shape == gate.shape,
          f"swiglu backward: gate {tuple(gate.shape)}, up {tuple(up.shape)}, grad {tuple(grad.shape)}")
    grad = grad.to(gate.dtype).contiguous()
    out = torch.empty(rows, 2 * cols, dtype=gate.dtype)
    getattr(library(), f"parity_swiglu_backward_{_SUFFIX[gate.dtype]}")(
        _ptr(gate), _ptr(up), _ptr(grad), _ptr(out), rows, cols, gate.stride(0), torch.get_num_threads())
    return out


def fused_halves(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether gate and up are the two halves of one row-major [rows, 2 * cols] tensor."""
    return (gate.dim() == 2 and up.shape == gate.shape and up.dtype == gate.dtype
            and gate.stride() == up.stride() == (2 * gate.shape[1], 1)
            and up.data_ptr() == gate.data_ptr() + gate.shape[1] * gate.element_size())


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels handle these tensors (CPU, float32 or bfloat16): a CUDA
    tensor's pointer handed to C code would crash the process, not raise."""
    return all(t.dtype in _SUFFIX and t.device.type == "cpu" for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Qwen3 RMSNorm of x [..., n] (float32 or bfloat16; rows may be strided) -> contiguous.

    With `rope` = (cos, sin), float32 [T, n] for x [T, heads, n], the result is also rotated."""
    n = x.shape[-1]
    _need(weight.numel() == n, f"rms_norm: weight has {weight.numel()} entries for rows of {n}")
    if rope is not None and x.dim() != 3:
        raise ValueError("rms_norm with rope needs x of shape [T, heads, n]")
    x, outer, inner, so, si = _row_layout(x)  # [T, heads, n] may be q/k heads inside a fused QKV
    w = weight.to(x.dtype).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    cos_p = sin_p = None
    if rope is not None:
        cos, sin = (t.float().contiguous() for t in rope)
        _need(cos.shape == sin.shape == (x.shape[0], n) and n <= 512,
              f"rms_norm with rope: cos/sin {tuple(cos.shape)} for x {tuple(x.shape)} (at most 512 wide)")
        cos_p, sin_p = _ptr(cos), _ptr(sin)
    getattr(library(), f"parity_rms_norm_{_SUFFIX[x.dtype]}")(
        _ptr(x), _ptr(w), _ptr(out), outer, inner, n, so, si, eps, cos_p, sin_p,
        torch.get_num_threads())
    return out


def row_lse(z: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """logsumexp(z * inv_temperature) per row of float32 or bfloat16 z [N, V] -> float32 [N]
    (a bfloat16 row is read as it is: each value widened exactly, never copied)."""
    z = z.contiguous() if z.dtype in _SUFFIX else z.float().contiguous()
    lse = torch.empty(z.shape[:-1], dtype=torch.float32)
    fn = library().parity_row_lse if z.dtype == torch.float32 else library().parity_row_lse_bf16
    fn(_ptr(z), _ptr(lse), z.numel() // z.shape[-1], z.shape[-1], inv_temperature, torch.get_num_threads())
    return lse


def token_logprobs_backward(z: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor,
                            grad: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """Gradient w.r.t. z [N, V] of `z[r, tokens[r]] * inv_t - lse[r]` for the output gradient
    grad [N]: inv_t * grad[r] * (onehot - softmax(z * inv_t)), one pass, in z's dtype."""
    z = z.contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    grad = grad.float().contiguous()
    _need(z.dim() == 2 and tokens.shape == grad.shape == lse.shape == z.shape[:1],
          f"token log-prob backward: z {tuple(z.shape)}, tokens {tuple(tokens.shape)}, "
          f"lse {tuple(lse.shape)}")
    if tokens.numel():
        lo, hi = tokens.aminmax()
        _need(int(lo) >= 0 and int(hi) < z.shape[1], f"token log-prob backward: token ids "
              f"{int(lo)}..{int(hi)} outside the vocabulary of {z.shape[1]}")
    out = torch.empty(z.shape, dtype=z.dtype)
    getattr(library(), f"parity_token_lp_backward_{_SUFFIX[z.dtype]}")(
        _ptr(z), _ptr(tokens), _ptr(lse.contiguous()), _ptr(grad), _ptr(out), z.shape[0], z.shape[1],
        inv_temperature, torch.get_num_threads())
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kc: int) -> torch.Tensor:
    """`x @ weight.T (+ bias)` in float32 for x [m <= 8, K], weight [N, K] (float32, or bfloat16
    widened exactly as it is read: the float32 product of the bf16 values, with no float32 copy of
    the weight): per element, bias then the K-blocks of `kc` positions left to right, each a fused
    multiply-add chain from zero (the BLAS GEMM's order where `gemm._gemv_order_holds` says so).
    Returns float32 [m, N]."""
    m, k = x.shape
    assert m <= 8 and weight.dtype in (torch.float32, torch.bfloat16)
    check_linear_args(x, weight, bias)
    x, weight = x.float().contiguous(), weight.contiguous()
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    kernel = library().parity_gemv_f32 if weight.dtype == torch.float32 else library().parity_gemv_bf16w
    kernel(_ptr(x), _ptr(weight), None if bias is None else _ptr(bias), _ptr(out),
           m, k, weight.shape[0], kc, torch.get_num_threads())
    return out


def gemm_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             kc: int) -> torch.Tensor | None:
    """`x @ weight.T (+ bias)` for float32 x [M, K], weight [N, K], bias [N] or None, any M, in
    `gemv`'s per-element order (bias, then K blocks of `kc` left to right, each a fused multiply-add
    chain from zero; `csrc/gemm_f32.c`), both cores. None where it is not built (no AVX-512F)."""
    check_linear_args(x, weight, bias)
    _need(x.dim() == 2 and x.dtype == weight.dtype == torch.float32
          and (bias is None or bias.dtype == torch.float32),
          f"gemm_f32: float32 x [M, K] and weight, got {x.dtype} {tuple(x.shape)}, {weight.dtype}")
    _need(all(t.device.type == "cpu" for t in (x, weight) + (() if bias is None else (bias,))),
          f"gemm_f32: CPU tensors, got x on {x.device}, weight on {weight.device}")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    code = library().parity_gemm_f32(_ptr(x), _ptr(weight), None if bias is None else _ptr(bias), _ptr(out),
                                     x.shape[0], x.shape[1], weight.shape[0], kc, torch.get_num_threads())
    if code == -1:
        raise MemoryError(f"gemm_f32: no memory for the packed weights of a {tuple(weight.shape)} product")
    return None if code == -2 else out


_amx_granted: bool | None = None  # the tile state granted to this process (None: not asked yet)


def amx_ready() -> bool:
    """Whether the AMX bf16 GEMM runs here: built (the compiler targets AMX-BF16) and the process
    granted the tile state by Linux. PARITY_AMX=0 turns it off (to compare with the paths before)."""
    global _amx_granted
    flag = os.environ.get("PARITY_AMX", "1")
    if flag not in ("", "0", "1"):
        raise ConfigError(f"PARITY_AMX must be 1 or 0, got {flag!r}")
    lib = library() if flag != "0" else None
    if lib is None:
        return False
    if _amx_granted is None:  # (asked of Linux once: a grant lasts the process, and its forks)
        _amx_granted = lib.parity_amx_ready() == 1
    return _amx_granted


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for bfloat16 x [M, K], weight [N, K], bias [N] on AMX tiles
    (`csrc/amx_gemm.c`): every element one float32 sum over K chunks of 32 in ascending order, the
    bias added and the sum rounded once, whatever M or the thread count (denormals flushed, as the
    tiles do). Returns bf16 [M, N]. Raises where `amx_ready()` is false."""
    check_linear_args(x, weight, bias)
    bf16 = x.dtype == weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == x.dtype)
    _need(x.dim() == 2 and bf16,
          f"amx_linear: bf16 x [M, K] and weight, got {x.dtype} {tuple(x.shape)}, {weight.dtype}")
    _need(all(t.device.type == "cpu" for t in (x, weight) + (() if bias is None else (bias,))),
          f"amx_linear: CPU tensors, got x on {x.device}, weight on {weight.device}")
    if not amx_ready():  # (the first tile instruction without Linux's grant ends the process)
        raise RuntimeError("amx_linear: no AMX tiles here (not built for this CPU, not granted, "
                           "PARITY_AMX=0 or the native kernels off)")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    b = None if bias is None else _ptr(bias)
    code = library().parity_amx_linear_bf16(_ptr(x), _ptr(weight), b, _ptr(out), x.shape[0], x.shape[1],
                                            weight.shape[0], torch.get_num_threads())
    if code:
        raise MemoryError(f"amx_linear: no memory for the packed copies of a {tuple(x.shape)} product") \
            if code == -1 else RuntimeError("amx_linear: the tiles may not be used in this process")
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [rows, cols] float32/bfloat16 (may be two halves of one tensor)."""
    if not (gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
            and gate.stride(0) == up.stride(0) and up.dtype == gate.dtype):
        gate, up = gate.reshape(-1, gate.shape[-1]).contiguous(), up.reshape(-1, up.shape[-1]).contiguous()
    rows, cols = gate.shape
    _need(up.shape == gate.shape, f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    out = torch.empty(rows, cols, dtype=gate.dtype)
    getattr(library(), f"parity_silu_mul_{_SUFFIX[gate.dtype]}")(
        _ptr(gate), _ptr(up), _ptr(out), rows, cols, gate.stride(0), torch.get_num_threads())
    return out
