"""The aligned GEMM in Triton: one reduction order per output element, whatever M is.

A row of `x @ W.T` is reduced by the same sequence of tile products whatever M is and whichever
tile the row lands in: a tile per (dtype, weight shape) with a fixed K step from 0 up, no
split-K, no autotuning by M. Two kernels compute it:

- `_matmul_kernel`: one output tile per program, operands loaded through pointers (any GPU, and
  the interpreter's CPU tensors).
- `_matmul_tma_kernel` (tiles marked "tma"): operands brought in by the Tensor Memory Accelerator
  (sm_90 and later: no address arithmetic, no masks, out-of-range rows read as zeros, as the
  masked loads' `other`), persistent (one program per SM walking the output tiles, so one tile's
  stores overlap the next one's loads) — the form that approaches cuBLAS on large products
  (prefill, the learner). Its K loop is the pointer kernel's; whether its products also round
  like the pointer kernel's (and so may share a ladder with them) is what the device's probe
  and `parity bench gemm`'s bits classes find out, never assumed.

Tiles may change with M only through a `GEMM_TILES` ladder that a probe on the device confirms
gives every M the same bits (`ladder_holds`).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .triton_kernels import INTERPRET, LAUNCH, _aligned, _cdiv, _dot, _on, tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton < 3.3: the pointer kernel only
    TensorDescriptor = None

Tile = tuple[int, ...]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM, and "tma" as a sixth entry for
the persistent TMA kernel."""

KINDS = ("tma",)
"""What may follow the five numbers of a tile: the kernel that runs it (none: the pointer kernel)."""


def tile_name(tile: Tile) -> str:
    """(128, 256, 64, 8, 3, 'tma') -> '128x256x64x8x3+tma' (how benches and errors name a tile)."""
    return "x".join(map(str, tile[:5])) + "".join(f"+{kind}" for kind in tile[5:])


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
            tile = rungs[-1][1]
        else:
            tile = next(t for top, t in rungs if top is None or m <= top)
        if len(tile) == 5 or isinstance(_tma(_device(device)), int):
            return tile
        # a TMA tile (the table holds what one GPU kind measured) on a GPU without TMA: the default
    if INTERPRET:
        return 64, 128, 64, 4, 1  # big tiles: the interpreter's cost is per program, not per flop
    if dtype == torch.float32:
        return 64, 64, 16, 4, 3  # FMA in one chain over K whatever BLOCK_K; 32 spilled 16 bytes
    return 64, 128, 64, 4, 3


def _device(device: torch.device | None) -> torch.device:
    """`device` with its index (a tensor's has one); None: the current CUDA device, or the CPU."""
    if device is None or (device.type == "cuda" and device.index is None):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


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
    device = _device(device)
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
                return f"{tile_name(t)} does not run here ({type(err).__name__})"
            if first is None:
                first = out
            elif not torch.equal(out, first):
                return f"{tile_name(t)} differs from {tile_name(rungs[0][1])}"
    return "same bits"


def describe_tiles() -> str:
    """The GEMM tiles in force, in words (`parity check` prints it)."""
    if not GEMM_TILES:
        return "GEMM: one default tile per dtype"
    probed = [f"{dt} {n}x{k}: {v}" for (_dev, d, n, k, rungs), v in _LADDERS.items()
              for dt in [str(d).removeprefix("torch.")] if GEMM_TILES.get((dt, n, k)) == rungs]
    return (f"GEMM: tiles for {len(GEMM_TILES)} weight shapes"
            + (f"; tiles by row count probed ({'; '.join(probed)})" if probed else ""))


# ----------------------------------------------------------------------------- kernels
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


@triton.jit(do_not_specialize=["M", "PROGRAMS"])
def _matmul_tma_kernel(x_desc, w_desc, b_ptr, out_ptr, M, N, K, som, son, PROGRAMS,
                       HAS_BIAS: tl.constexpr, INTERP: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles = tiles_m * tl.cdiv(N, BLOCK_N)
    # persistent: PROGRAMS programs walk the output tiles, row tiles of one weight tile in turn
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m = tile % tiles_m
        pid_n = tile // tiles_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # the pointer kernel's K order: from 0 up, no split-K
            a = x_desc.load([pid_m * BLOCK_M, k0])  # rows past M (and K) arrive as zeros
            b = w_desc.load([pid_n * BLOCK_N, k0]).T
            if INTERP:  # numpy sums in memory order: lay W's tile out as the pointer kernel's
                b = tl.reshape(tl.reshape(b, (BLOCK_K * BLOCK_N,)), (BLOCK_K, BLOCK_N))
            acc = _dot(a, b, acc, INTERP, IEEE)
        # stored in two column halves: the flattened pipeline keeps the epilogue's staging apart
        # from the loads' buffers, and a whole 128x256 float32 tile (the probe's sums) would not fit
        halves = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)).to(tl.int64)
        _store_half(halves[0], b_ptr, out_ptr, rm, rn, M, N, som, son, HAS_BIAS)
        _store_half(halves[1], b_ptr, out_ptr, rm, rn + BLOCK_N // 2, M, N, som, son, HAS_BIAS)


@triton.jit
def _store_half(acc, b_ptr, out_ptr, rm, rn, M, N, som, son, HAS_BIAS: tl.constexpr):
    """The pointer kernel's epilogue on columns `rn`: bias added in float32, one rounding."""
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_TMA_PROGRAMS: dict[torch.device, int | str] = {}
"""device -> `_tma`'s answer, once per process (a CPU entry holds for the process: the interpreter
and compile-only Triton for one architecture are each set up once, before the kernels' import)."""


def _tma(device: torch.device) -> int | str:
    """Programs of the persistent TMA kernel on `device` (its SM count; 3 in the interpreter, so
    that programs loop over tiles; 132 when compiling without a GPU), or why it has no TMA."""
    programs = _TMA_PROGRAMS.get(device)
    if programs is not None:
        return programs
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        arch, programs = props.major * 10 + props.minor, props.multi_processor_count
    else:
        from . import triton_target

        target = triton_target.active()
        arch, programs = (90, 3) if INTERPRET or target is None else (target.capability, 132)
    if TensorDescriptor is None:
        programs = "GEMM tiles marked +tma need Triton >= 3.3 (tensor descriptors)"
    elif arch < 90:
        programs = (f"GEMM tiles marked +tma need the Tensor Memory Accelerator (sm_90 or later); "
                    f"this GPU is sm_{arch}")
    _TMA_PROGRAMS[device] = programs
    return programs


def _rows_for_tma(t: torch.Tensor) -> torch.Tensor:
    """`t` as TMA reads it: unit stride along K, rows apart by at least a row and 16-byte aligned
    (a dense copy where not: a transposed or expanded tensor, or one row viewed out of a column,
    which PyTorch calls contiguous whatever its row stride)."""
    rows, k = t.shape
    if t.stride(1) != 1 or t.stride(0) < k or (t.stride(0) * t.element_size()) % 16:
        t = torch.empty(rows, k, dtype=t.dtype, device=t.device).copy_(t)
    if (k * t.element_size()) % 16:
        raise ConfigError(f"GEMM tiles marked +tma need rows of a multiple of 16 bytes; K = "
                          f"{k} in {str(t.dtype).removeprefix('torch.')} is not")
    return _aligned(t)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: Tile | None = None, out_dtype: torch.dtype | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for 2-D x [M, K], weight [N, K]; float32 accumulation, output in
    x's dtype (or `out_dtype`: float32 gives the sums unrounded). A row's bits do not depend on M
    or on the other rows. `tiles` overrides `gemm_tiles` (`parity bench gemm` tries candidates,
    the ladder probe compares rungs; the model never passes it); a tile ending in "tma" runs the
    persistent TMA kernel (sm_90 and later, and the interpreter). `out`: a dense [M, N] tensor to
    write into (checks pass one filled with NaN, so that an element no program wrote shows)."""
    x = _aligned(x)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride() != (n, 1) or out.data_ptr() % 16:
        raise ConfigError(f"matmul: out must be a dense, 16-byte aligned [{m}, {n}] tensor")
    if m == 0 or n == 0:
        return out
    if k == 0:  # no products: the bias (or zeros) rounded to the output, as the kernels would
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    bm, bn, bk, warps, stages, *kind = tiles or gemm_tiles(x.dtype, n, k, m, x.device)
    consts = dict(HAS_BIAS=bias is not None, INTERP=INTERPRET, IEEE=x.dtype == torch.float32,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **LAUNCH)
    if kind != ["tma"] and kind:
        raise ConfigError(f"unknown GEMM kernel in tiles {tile_name((bm, bn, bk, warps, stages, *kind))}"
                          f" (known: {', '.join(KINDS)})")
    if kind:
        x, weight = _rows_for_tma(x), _rows_for_tma(weight)
        programs = _tma(x.device)
        if isinstance(programs, str):
            raise ConfigError(programs)
        programs = min(programs, _cdiv(m, bm) * _cdiv(n, bn))
        with _on(x, weight):
            _matmul_tma_kernel[(programs,)](
                TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, bk]),
                TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [bn, bk]),
                bias if bias is not None else out, out, m, n, k, out.stride(0), out.stride(1),
                programs, **consts)
        return out
    with _on(x, weight):
        _matmul_kernel[(_cdiv(m, bm), _cdiv(n, bn))](
            x, weight, bias if bias is not None else x, out, m, n, k,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            **consts)
    return out


