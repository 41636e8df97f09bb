"""`parity bench gemm`: the aligned Triton GEMM's candidate tiles at a model's weight shapes.

The aligned GEMM's tile may depend on the weight's shape (N, K) and the dtype, and on M only through
a ladder of tiles that gives every M the same bits (`triton_gemm.GEMM_TILES`): a decode step wants
many small tiles (the 0.6B shape's o_proj and down_proj run 8 programs of the default 64x128 tile at
batch 64, on a GPU of 132 SMs), a prefill wants large ones. For each distinct weight shape of a
preset (fused q/k/v, o_proj, fused gate/up, down_proj, LM head) this times every candidate tile at
decode and prefill row counts beside `F.linear` (cuBLAS on a GPU), replayed from CUDA graphs on a
GPU (as the engine's decode steps are: no launch cost in the figure) over copies of the weight that
overflow the GPU's L2 cache (a decode step streams every layer's weights from memory:
`timing.l2_copies`), repetitions interleaved, medians; checks that each candidate's rows are the
same bits at every row count (`torch.equal` against the rows of the largest; exit 1 if one's are
not) and its float32 sums against float32 arithmetic (a wrong tile is reported, never timed or
chosen, exit 1); sorts the candidates into classes of identical float32 sums (class A: the first
candidate's, the default); reports a candidate the device refuses (shared memory) and goes on. Per
shape it names the best single tile (geometric mean of aligned/standard over the row counts) and the
best ladder within one class: the fastest tile of that class at each row count. Both are selection
figures (the best of several noisy ratios reads high); the ladder's own figure is the whole model's,
side by side, in `bench kernels --gemm-tiles` (scripts/gpu_check.sh runs it right after). `--json`
writes the ladders as `gemm_tiles`, the table `GEMM_TILES` takes (`--gemm-tiles FILE` of `bench
kernels` and `bench learner` applies it in their process; a GPU session pastes the printed entries
into the code). Per shape and row count, each round times cuBLAS once and every candidate, in the
other order every other round. A SIGTERM (a time limit) ends the run with what is done: the finished
shapes are reported (`stopped` says so). On a CPU the kernels run through Triton's interpreter: a
smoke run at small shapes, no timing worth reading.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .. import hardware
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..model import ModelConfig
from .timing import l2_copies, rotating, seconds_per_call
from .ui import collect, exit_status, status, table, term_as_interrupt

CANDIDATES = {
    "bfloat16": ["64x128x64x4x3", "64x64x64x4x4", "64x32x64x4x4", "64x16x64x4x6", "64x256x64x4x3",
                 "128x128x64x8x3", "128x256x64x8x3", "128x128x64x8x4+tma", "128x256x64x8x3+tma"],
    "float32": ["64x64x16x4x3", "32x64x16x4x3", "64x32x16x4x3", "32x32x16x4x3"],
}
"""Tiles tried by default, BLOCK_M x BLOCK_N x BLOCK_K x warps x stages, the default first; each
compiles for sm_90 without spills (docs/benchmarks.md). One BLOCK_K per dtype, so that on a GPU
whose matrix instructions sum the same way at every tile width they can share a ladder: narrow
tiles (64x16: 64 programs for the 0.6B shape's N = 1,024 weights) for decode, wide for prefill,
where the persistent TMA kernel (+tma, sm_90 and later) is the one built to approach cuBLAS."""


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
    bits: str = ""
    """Its class of identical float32 sums at this shape: 'A' the first candidate's, then 'B', ..."""
    correct: bool = True
    """False when its float32 sums are not the product's (beyond any order of summation)."""


@dataclass
class Ladder:
    """The fastest tile per row count among candidates of one bits class: the rungs of a
    `GEMM_TILES` entry, ((max_rows or None, tiles), ...)."""
    shape: str
    n: int
    k: int
    dtype: str
    bits: str
    rungs: list  # [[max_rows | None, "BMxBNxBKxWxS"], ...], increasing, the last None
    ratios: dict  # rows -> aligned/standard of the rung serving it
    geomean: float

    def entry(self) -> str:
        """The ladder as a line of `GEMM_TILES`, ready to paste."""
        rungs = ", ".join(f"({top}, {parse_tiles(t)})" for top, t in self.rungs)
        return f"({self.dtype!r}, {self.n}, {self.k}): ({rungs},),"


def parse_tiles(text: str, what: str = "--candidates") -> tuple:
    """'64x128x64x4x3' -> (64, 128, 64, 4, 3) and '128x256x64x8x3+tma' -> (128, 256, 64, 8, 3,
    'tma'), with a one-line error naming `what` otherwise."""
    from ..ops.triton_gemm import KINDS

    numbers, *kind = text.lower().split("+")
    try:
        parts = tuple(int(p) for p in numbers.split("x"))
    except ValueError:
        parts = ()
    if len(parts) != 5 or any(p <= 0 for p in parts) or any(p & (p - 1) for p in parts[:3]) \
            or len(kind) > 1 or not set(kind) <= set(KINDS):
        raise ParityError(f"{what}: {text!r} is not BLOCK_MxBLOCK_NxBLOCK_Kxwarpsxstages with "
                          f"power-of-two blocks, optionally +{'/+'.join(KINDS)} (e.g. 64x128x64x4x3)")
    if kind and not all(16 <= p <= 256 for p in parts[:3]):  # a TMA box is 1..256 a side; dot needs 16
        raise ParityError(f"{what}: {text!r}: a +tma tile's blocks must be 16 to 256 (the "
                          f"Tensor Memory Accelerator's box)")
    return (*parts, *kind)


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


def _check(tg, t: tuple, x: torch.Tensor, w: torch.Tensor, probe: torch.Tensor, rows: tuple[int, ...],
           classes: list) -> TileRow:
    """One candidate's checks (shape fields left for the caller): its float32 sums of all of `x`
    against float32 arithmetic (a tile that computes something else, or leaves elements unwritten
    — outputs start as NaN, not as a freed buffer that may hold the last candidate's right answer
    — is reported and never timed or chosen), its rows at each row count against those of the
    largest (`torch.equal`), and its bits class on `probe`."""
    def product(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=dtype, device=a.device)
        return tg.matmul(a, w, tiles=t, out=out)

    sums = product(x, torch.float32)
    wf = w.float()
    step = max(1, (1 << 26) // max(1, w.shape[0]))  # rows per reference chunk: <= 256 MiB a tensor
    for r0 in range(0, x.shape[0], step):
        xf = x[r0:r0 + step].float()
        err = (sums[r0:r0 + step] - xf @ wf.T).abs()
        allowed = 1e-4 * (xf.abs() @ wf.abs().T) + 1e-30  # far above any order of float32 sums
        bad = ~(err <= allowed)  # NaN (an element never written) fails too
        if bool(bad.any()):
            r, c = divmod(int(bad.flatten().nonzero()[0]), w.shape[0])
            return TileRow("", 0, 0, "", "", {}, False, 0.0, f"wrong sums: row {r0 + r} column {c} is "
                           f"{float(sums[r0 + r, c]):.6g}, float32 arithmetic {float((xf @ wf.T)[r, c]):.6g}",
                           correct=False)
    full = product(x, x.dtype)
    invariant = all(torch.equal(product(x[:m], x.dtype), full[:m]) for m in rows)
    sums = product(probe, torch.float32)
    same = next((i for i, c in enumerate(classes) if torch.equal(c, sums)), None)
    if same is None:
        classes.append(sums)
        same = len(classes) - 1
    return TileRow("", 0, 0, "", "", {}, invariant, bits=chr(ord("A") + same))


def bench_gemm(preset: str = "qwen3-0.6b", dtype_name: str = "bfloat16",
               rows: tuple[int, ...] = (64, 256, 8192), candidates: list[str] | None = None,
               reps: int = 5, device: str = "cpu", progress=None, stopped=None) -> list[TileRow]:
    """Every candidate at every weight shape of `preset`: checked (rows across M, bits class),
    then timed per row count in rounds of cuBLAS and every candidate in turn (cuBLAS timed once a
    round, not once per candidate). `stopped` (a list) gets an entry if the run is interrupted
    (SIGTERM under `main`): the shapes finished by then are returned, the one under way dropped."""
    from ..ops import triton_gemm as tg

    cfg = ModelConfig.preset(preset)
    dtype = dtype_from_name(dtype_name, "--dtype")
    tiles = [parse_tiles(c) for c in (candidates or CANDIDATES.get(dtype_name, CANDIDATES["float32"]))]
    gen = torch.Generator().manual_seed(0)
    shapes = weight_shapes(cfg)
    done = collect(_shape_rows(tg, shapes, dtype, dtype_name, tiles, rows, reps, device, progress, gen,
                               stopped), stopped, "shapes", len(shapes))
    return [r for shape_rows in done for r in shape_rows]


def _shape_rows(tg, shapes, dtype, dtype_name, tiles, rows, reps, device, progress, gen, stopped=None):
    """Per weight shape, its candidates' rows (checked, then timed). A candidate whose timing
    fails gets that error; when cuBLAS's own timing fails (the device is in error: the rest would
    only fail too), the shapes so far are what there is, and `stopped` says why."""
    done = []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype).to(device)
        x = torch.randn(max(rows), k, generator=gen).to(dtype).to(device)
        spread = torch.exp2(torch.randint(-8, 9, (64, k), generator=gen).float())  # orders show
        probe = (torch.randn(64, k, generator=gen) * spread).to(dtype).to(device)
        classes: list[torch.Tensor] = []  # one float32 product of `probe` per bits class
        shape_rows: list[TileRow] = []
        for t in tiles:
            label = tg.tile_name(t)
            if progress:
                progress(f"{name} {n}x{k} tiles {label}: bits")
            try:
                row = _check(tg, t, x, w, probe, rows, classes)
            except Exception as err:  # noqa: BLE001 - a tile this GPU (or the interpreter) refuses
                msg = f"{type(err).__name__}: {err}".splitlines()[0][:160]
                row = TileRow(name, n, k, dtype_name, label, {}, False, 0.0, msg)
            row.shape, row.n, row.k, row.dtype, row.tiles = name, n, k, dtype_name, label
            shape_rows.append(row)
        runnable = [r for r in shape_rows if not r.error]
        failed: dict[str, str] = {}  # tile -> why its timing failed
        ws = [w] + [w.clone() for _ in range(l2_copies(w.numel() * w.element_size(), device) - 1)]
        for m in rows:
            if progress:
                progress(f"{name} {n}x{k} M={m}: timing {len(runnable)} tiles beside cuBLAS")
            fns = {"standard": rotating([partial(F.linear, x[:m], v) for v in ws])}
            for r in runnable:
                tile = parse_tiles(r.tiles)
                fns[r.tiles] = rotating([partial(tg.matmul, x[:m], v, tiles=tile) for v in ws])
            times: dict[str, list[float]] = {key: [] for key in fns}
            for rep in range(reps):  # interleaved: standard, each candidate; then the other way round
                for key, fn in (list(fns.items()) if rep % 2 == 0 else list(fns.items())[::-1]):
                    try:
                        times[key].append(seconds_per_call(fn, device))
                    except Exception as err:  # noqa: BLE001 - a tile that fails timing (a graph capture)
                        msg = f"{type(err).__name__}: {err}".splitlines()[0][:160]
                        if key == "standard" or stopped is None:  # the device itself: nothing more to time
                            if stopped is None:
                                raise
                            stopped.append(f"cuBLAS failed at {name} M={m} ({msg}): {len(done)} shapes done")
                            return
                        del fns[key]
                        failed[key] = msg
            standard = statistics.median(times["standard"])
            for r in runnable:
                if r.tiles in failed:
                    r.error = failed[r.tiles]
                    continue
                r.ratios[m] = standard / statistics.median(times[r.tiles])
            runnable = [r for r in runnable if not r.error]
        for r in runnable:
            r.geomean = math.exp(statistics.fmean(math.log(v) for v in r.ratios.values()))
        done.append(name)
        yield shape_rows


def best(rows: list[TileRow]) -> dict[str, TileRow]:
    """Per shape, the row-invariant candidate with the best geometric mean."""
    chosen: dict[str, TileRow] = {}
    for r in rows:
        if r.rows_invariant and (r.shape not in chosen or r.geomean > chosen[r.shape].geomean):
            chosen[r.shape] = r
    return chosen


def ladders(rows: list[TileRow]) -> dict[str, Ladder]:
    """Per shape, the best ladder: within each bits class, the fastest row-invariant tile at each
    row count (a rung up to that count, the last for any M; equal neighbours merged), the class
    whose ladder has the best geometric mean over the row counts."""
    chosen: dict[str, Ladder] = {}
    for shape in dict.fromkeys(r.shape for r in rows):
        ok = [r for r in rows if r.shape == shape and r.rows_invariant and not r.error]
        for bits in sorted({r.bits for r in ok}):
            group = [r for r in ok if r.bits == bits]
            counts = sorted(group[0].ratios)
            pick = {m: max(group, key=lambda r, m=m: r.ratios[m]) for m in counts}
            rungs: list = []
            for i, m in enumerate(counts):
                top = None if i == len(counts) - 1 else m
                if rungs and rungs[-1][1] == pick[m].tiles:
                    rungs[-1][0] = top
                else:
                    rungs.append([top, pick[m].tiles])
            ratios = {m: pick[m].ratios[m] for m in counts}
            geo = math.exp(statistics.fmean(math.log(r) for r in ratios.values()))
            if shape not in chosen or geo > chosen[shape].geomean:
                first = group[0]
                chosen[shape] = Ladder(shape, first.n, first.k, first.dtype, bits, rungs, ratios, geo)
    return chosen


def table_entries(chosen: dict[str, Ladder]) -> list:
    """The ladders as JSON-ready `GEMM_TILES` entries: [dtype, N, K, [[max_rows, [5 ints
    (and "tma")]], ...]]."""
    return [[lad.dtype, lad.n, lad.k, [[top, list(parse_tiles(t))] for top, t in lad.rungs]]
            for lad in chosen.values()]


def apply_tiles(path: str) -> int:
    """Load `gemm_tiles` from a `parity bench gemm --json` file into `GEMM_TILES` for this process
    (the benches' `--gemm-tiles`); returns the number of entries. One-line errors for a missing
    or malformed file."""
    from ..ops import triton_gemm as tg

    try:
        with open(path) as f:
            text = f.read()
        # (a log with lines before or after the JSON, as a device call's may hold: the document
        # that opens on the first line starting with "{")
        start = next((m.start() for m in re.finditer(r"\n\{", "\n" + text)), 0)
        doc, _ = json.JSONDecoder().raw_decode(text, start)
    except (OSError, ValueError) as err:
        raise ParityError(f"--gemm-tiles: cannot read {path}: {err}") from err
    entries = doc.get("gemm_tiles") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ParityError(f"--gemm-tiles: {path} has no 'gemm_tiles' list (write it with "
                          f"`parity bench gemm --json`)")
    def count(v) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{v!r} is not a positive integer")
        return v

    table_ = {}
    for entry in entries:
        try:
            dtype, n, k, rungs = entry
            n, k = count(n), count(k)
            ladder = tuple((None if top is None else count(top),
                            parse_tiles("x".join(str(count(v)) for v in t[:5])
                                        + "".join(f"+{v}" if isinstance(v, str) else f"x{v}" for v in t[5:]),
                                        f"--gemm-tiles ({path})"))
                           for top, t in rungs)
            tops = [top for top, _ in ladder]
            if not ladder or tops[-1] is not None or None in tops[:-1] or tops[:-1] != sorted(tops[:-1]):
                raise ValueError("rungs must rise and end with None")
            dtype_from_name(dtype, "--gemm-tiles")
            table_[(str(dtype), n, k)] = ladder
        except (TypeError, ValueError) as err:
            raise ParityError(f"--gemm-tiles: bad entry {entry!r} in {path}: {err}") from err
    tg.GEMM_TILES.update(table_)
    return len(table_)


INTERPRETED_FLOP = 2e10
"""The most interpreted work (2 N K M per product, every candidate, every repetition) `bench gemm`
takes on a CPU, where Triton's interpreter runs some 2e7 multiply-adds a second here: the defaults
(the 0.6B shapes at rows up to 8,192, nine tiles) would run for days."""


def main(args) -> int:
    """`parity bench gemm`."""
    if not args.rows or any(m <= 0 for m in args.rows):
        raise ParityError("--rows must be positive integers")
    for c in args.candidates or []:
        parse_tiles(c)
    device = str(hardware.check_device(args.device, "--device"))
    if torch.device(device).type == "cpu":  # (a smoke run: refused where it would not end)
        tiles = len(args.candidates or CANDIDATES.get(args.dtype, CANDIDATES["float32"]))
        shapes = weight_shapes(ModelConfig.preset(args.preset)).values()
        work = sum(2 * n * k for n, k in shapes) * sum(args.rows) * tiles * (args.reps + 1)
        if work > INTERPRETED_FLOP:
            rows = ",".join(map(str, args.rows))
            raise ParityError(f"on a CPU the tiles run in Triton's interpreter (a smoke run, no timing worth "
                              f"reading): {args.preset} at --rows {rows} with {tiles} candidate(s) is "
                              f"{work:.1e} FLOP of interpreted work, hours or days; give small shapes "
                              f"(--preset tiny --rows 4,16) or --device cuda")
    stopped: list[str] = []
    with term_as_interrupt():  # a time limit's SIGTERM: report the shapes done so far
        rows = bench_gemm(args.preset, args.dtype, tuple(args.rows), args.candidates, args.reps, device,
                          progress=lambda m: status(f"bench gemm: {m}"), stopped=stopped)
    status("")
    chosen, by_rows = best(rows), ladders(rows)
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "device": device, "preset": args.preset,
                          "rows": [asdict(r) for r in rows],
                          "best": {s: asdict(r) for s, r in chosen.items()},
                          "ladders": {s: asdict(r) for s, r in by_rows.items()},
                          "gemm_tiles": table_entries(by_rows), "stopped": stopped}, indent=2))
        return exit_status(stopped, all(r.correct and (r.rows_invariant or r.error) for r in rows))
    print(f"parity bench gemm: {args.preset} weight shapes, {args.dtype}, aligned/standard per row count "
          f"(medians of {args.reps} interleaved repetitions; {device})")
    print(f"machine: {hardware.line()}")
    print(table(["shape", "N x K", "tiles", *[f"M={m}" for m in args.rows], "geomean", "rows same bits",
                 "bits"],
                [[r.shape, f"{r.n}x{r.k}", r.tiles, *[f"{r.ratios[m]:.3f}" if m in r.ratios else "-"
                                                       for m in args.rows],
                  f"{r.geomean:.3f}", "yes" if r.rows_invariant else "-" if r.error else "NO", r.bits or "-"]
                 for r in rows]))
    for r in rows:
        if r.error:
            print(f"{r.shape} {r.tiles}: {'could not run: ' if r.correct else ''}{r.error}")
    for why in stopped:
        print(f"{why}: the shapes not listed were not measured")
    print("best single tile per shape: "
          + ", ".join(f"{s} {r.tiles} ({r.geomean:.3f})" for s, r in chosen.items()))
    print("best ladder per shape (tiles of one bits class; the GEMM_TILES entries, used where the "
          "device's probe confirms the bits):")
    for lad in by_rows.values():
        print(f"    {lad.entry()}  # {lad.shape}, class {lad.bits}, geomean {lad.geomean:.3f}")
    return exit_status(stopped, all(r.correct and (r.rows_invariant or r.error) for r in rows))
