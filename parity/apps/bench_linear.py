"""`parity bench linear`: one product per weight shape of a preset, aligned beside standard, on CPU.

For each distinct weight shape of a preset (fused q/k/v, o_proj, fused gate/up, down_proj, LM head,
as `bench gemm` lists them) and each row count, this times the aligned backend's product
(`ops.gemm.linear`: on this machine padded GEMMs, the matrix-vector kernel, strict one-thread
calls or the AMX tiles, whichever its probes chose; the header names it) beside `F.linear` (the
standard path: the library's own GEMM), repetitions interleaved, medians, and checks that the
aligned rows are the same bits at every row count (those rows of the largest count's product,
`torch.equal`; exit 1 if not). It is the product-level view of `bench kernels`: where the aligned
path loses or gains, shape by shape.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .. import hardware
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..model import ModelConfig
from ..ops import gemm
from .bench_gemm import weight_shapes
from .timing import busy_note, interleaved
from .ui import collect, exit_status, status, table, term_as_interrupt


@dataclass
class LinearRow:
    shape: str
    n: int
    k: int
    rows: int
    aligned_us: float
    standard_us: float
    same_bits: bool
    """The aligned rows equal those rows of the largest row count's product."""


def bench_linear(preset: str, dtype: torch.dtype, row_counts, reps: int, progress=None):
    """One row per weight shape and row count, yielded as measured."""
    gen = torch.Generator().manual_seed(0)
    top = max(row_counts)
    for name, (n, k) in weight_shapes(ModelConfig.preset(preset)).items():
        x = torch.randn(top, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
        with torch.no_grad():
            full = gemm.linear(x, w)
            for m in row_counts:
                if progress:
                    progress(f"linear {name} ({n} x {k}) rows {m}")
                xs = x[:m].contiguous()
                calls = {"aligned": partial(gemm.linear, xs, w), "standard": partial(F.linear, xs, w)}
                sec = interleaved(calls, reps)
                yield LinearRow(name, n, k, m, 1e6 * sec["aligned"], 1e6 * sec["standard"],
                                torch.equal(gemm.linear(xs, w), full[:m]))


def main(args) -> int:
    """`parity bench linear`."""
    dtype = dtype_from_name(args.dtype, "--dtype")
    if min(args.rows) < 1 or args.reps < 1:
        raise ParityError("--rows and --reps must be at least 1")
    ModelConfig.preset(args.preset)  # (an unknown preset: its one-line error before any work)
    stopped: list[str] = []
    with term_as_interrupt():
        rows = collect(bench_linear(args.preset, dtype, args.rows, args.reps,
                                    progress=lambda m: status(f"bench {m}")),
                       stopped, "products", None)
    status("")
    ok = all(r.same_bits for r in rows)
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "preset": args.preset, "dtype": args.dtype,
                          "aligned_path": gemm.describe(), "rows": [asdict(r) for r in rows],
                          "stopped": stopped}, indent=2))
        return exit_status(stopped, ok)
    print(f"parity bench linear: {args.preset} weight shapes, {args.dtype}, medians of {args.reps} "
          f"interleaved repetitions, {torch.get_num_threads()} threads")
    print(f"machine: {hardware.line()}")
    print(f"aligned products: {gemm.describe()}")
    print(table(["shape", "N x K", "rows", "aligned us", "standard us", "aligned/standard speed",
                 "rows same bits"],
                [[r.shape, f"{r.n} x {r.k}", str(r.rows), f"{r.aligned_us:,.1f}", f"{r.standard_us:,.1f}",
                  f"{r.standard_us / r.aligned_us:.2f}", "yes" if r.same_bits else "NO"] for r in rows]))
    if note := busy_note():
        print(note)
    for why in stopped:
        print(f"{why}: the products not listed were not measured")
    return exit_status(stopped, ok)
