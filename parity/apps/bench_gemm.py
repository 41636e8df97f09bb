"""`parity bench gemm`: the aligned Triton GEMM's candidate tiles at a model's weight shapes.

The aligned GEMM's tile may depend on the weight's shape (N, K) and the dtype, never on M
(`triton_kernels.gemm_tiles`): a decode step wants many small tiles (the 0.6B shape's o_proj and
down_proj run 8 programs of the default 64x128 tile at batch 64, on a GPU of 132 SMs), a prefill
wants large ones, and one tile must serve both. For each distinct weight shape of a preset (fused
q/k/v, o_proj, fused gate/up, down_proj, LM head) this times every candidate tile at decode and
prefill row counts beside `F.linear` (cuBLAS on a GPU), replayed from CUDA graphs on a GPU (as
the engine's decode steps are: no launch cost in the figure), repetitions interleaved, medians; checks
that each candidate's rows are the same bits at every row count (`torch.equal` against the rows
of the largest; exit 1 if one's are not); reports a candidate the device refuses (shared memory)
and goes on; and names per shape the candidate with the best geometric mean of
aligned/standard over the row counts — the entry a GPU session writes into `GEMM_TILES`.
On a CPU the kernels run through Triton's interpreter: a smoke run at small shapes, no timing worth
reading.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .. import hardware
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..model import ModelConfig
from .ui import status, table

CANDIDATES = {
    "bfloat16": ["64x128x64x4x3", "64x64x64x4x4", "64x32x64x4x4", "64x256x64x4x3", "128x128x64x8x3",
                 "128x256x64x8x3"],
    "float32": ["64x64x16x4x3", "32x64x16x4x3", "64x32x16x4x3", "32x32x16x4x3"],
}
"""Tiles tried by default, BLOCK_M x BLOCK_N x BLOCK_K x warps x stages, the default first; each
compiles for sm_90 without spills (docs/benchmarks.md)."""


@dataclass
class TileRow:
    shape: str
    n: int
    k: int
    dtype: str
    tiles: str
    ratios: dict  # rows -> aligned/standard (throughput)
    rows_invariant: bool
    geomean: float = 0.0
    error: str = ""
    """Why the candidate could not run here (e.g. more shared memory than the GPU has), if so."""


def parse_tiles(text: str) -> tuple[int, int, int, int, int]:
    """'64x128x64x4x3' -> (64, 128, 64, 4, 3), with a one-line error for anything else."""
    try:
        parts = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        parts = ()
    if len(parts) != 5 or any(p <= 0 for p in parts) or any(p & (p - 1) for p in parts[:3]):
        raise ParityError(f"--candidates: {text!r} is not BLOCK_MxBLOCK_NxBLOCK_Kxwarpsxstages "
                          f"with power-of-two blocks (e.g. 64x128x64x4x3)")
    return parts  # type: ignore[return-value]


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The distinct dense weight shapes of a forward, name -> (N, K)."""
    d, h = cfg.head_dim, cfg.hidden_size
    shapes = {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h),
              "o_proj": (h, cfg.num_attention_heads * d),
              "gate_up": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
              "lm_head": (cfg.vocab_size, h)}
    seen, out = set(), {}
    for name, nk in shapes.items():
        if nk not in seen:
            seen.add(nk)
            out[name] = nk
    return out


def _seconds(fn, device, target: float = 0.02) -> float:
    """Seconds per call of `fn`, over enough calls to take about `target` seconds. On a GPU the
    calls are replayed from one CUDA graph, as the engine's decode steps are: a launch-bound
    timing at small M would measure the host's launch cost (Triton's is dearer than cuBLAS's),
    not the tile."""
    fn()
    hardware.sync(device)
    t0 = time.perf_counter()
    fn()
    hardware.sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, min(200, int(target / once)))
    if torch.device(device).type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()  # warm
        hardware.sync(device)
        t0 = time.perf_counter()
        graph.replay()
        hardware.sync(device)
        return (time.perf_counter() - t0) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    hardware.sync(device)
    return (time.perf_counter() - t0) / calls


def bench_gemm(preset: str = "qwen3-0.6b", dtype_name: str = "bfloat16",
               rows: tuple[int, ...] = (64, 256, 8192), candidates: list[str] | None = None,
               reps: int = 5, device: str = "cpu", progress=None) -> list[TileRow]:
    from ..ops import triton_kernels as tk

    cfg = ModelConfig.preset(preset)
    dtype = dtype_from_name(dtype_name, "--dtype")
    tiles = [parse_tiles(c) for c in (candidates or CANDIDATES.get(dtype_name, CANDIDATES["float32"]))]
    gen = torch.Generator().manual_seed(0)
    out: list[TileRow] = []
    for name, (n, k) in weight_shapes(cfg).items():
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype).to(device)
        x = torch.randn(max(rows), k, generator=gen).to(dtype).to(device)
        for t in tiles:
            if progress:
                progress(f"{name} {n}x{k} tiles {'x'.join(map(str, t))}")
            label = "x".join(map(str, t))
            try:
                full = tk.matmul(x, w, tiles=t)
            except Exception as err:  # noqa: BLE001 - a tile this GPU (or the interpreter) refuses
                msg = f"{type(err).__name__}: {err}".splitlines()[0][:160]
                out.append(TileRow(name, n, k, dtype_name, label, {}, False, 0.0, msg))
                continue
            invariant = all(torch.equal(tk.matmul(x[:m], w, tiles=t), full[:m]) for m in rows)
            ratios = {}
            for m in rows:
                fns = {"aligned": lambda xm=x[:m], w=w, t=t: tk.matmul(xm, w, tiles=t),
                       "standard": lambda xm=x[:m], w=w: F.linear(xm, w)}
                times = {k: [] for k in fns}
                for _ in range(reps):  # interleaved: A B A B ...
                    for key, fn in fns.items():
                        times[key].append(_seconds(fn, device))
                ratios[m] = statistics.median(times["standard"]) / statistics.median(times["aligned"])
            geo = math.exp(statistics.fmean(math.log(r) for r in ratios.values()))
            out.append(TileRow(name, n, k, dtype_name, label, ratios, invariant, geo))
    return out


def best(rows: list[TileRow]) -> dict[str, TileRow]:
    """Per shape, the row-invariant candidate with the best geometric mean."""
    chosen: dict[str, TileRow] = {}
    for r in rows:
        if r.rows_invariant and (r.shape not in chosen or r.geomean > chosen[r.shape].geomean):
            chosen[r.shape] = r
    return chosen


def main(args) -> int:
    """`parity bench gemm`."""
    if not args.rows or any(m <= 0 for m in args.rows):
        raise ParityError("--rows must be positive integers")
    for c in args.candidates or []:
        parse_tiles(c)
    device = str(hardware.check_device(args.device, "--device"))
    rows = bench_gemm(args.preset, args.dtype, tuple(args.rows), args.candidates, args.reps, device,
                      progress=lambda m: status(f"bench gemm: {m}"))
    status("")
    chosen = best(rows)
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "device": device, "preset": args.preset,
                          "rows": [asdict(r) for r in rows],
                          "best": {s: asdict(r) for s, r in chosen.items()}}, indent=2))
        return 0 if all(r.rows_invariant or r.error for r in rows) else 1
    print(f"parity bench gemm: {args.preset} weight shapes, {args.dtype}, aligned/standard per row count "
          f"(medians of {args.reps} interleaved repetitions; {device})")
    print(f"machine: {hardware.line()}")
    print(table(["shape", "N x K", "tiles", *[f"M={m}" for m in args.rows], "geomean", "rows same bits"],
                [[r.shape, f"{r.n}x{r.k}", r.tiles, *[f"{r.ratios[m]:.3f}" if m in r.ratios else "-"
                                                       for m in args.rows],
                  f"{r.geomean:.3f}", "yes" if r.rows_invariant else "-" if r.error else "NO"]
                 for r in rows]))
    for r in rows:
        if r.error:
            print(f"{r.shape} {r.tiles}: could not run: {r.error}")
    print("best per shape: " + ", ".join(f"{s} {r.tiles} ({r.geomean:.3f})" for s, r in chosen.items()))
    return 0 if all(r.rows_invariant or r.error for r in rows) else 1
