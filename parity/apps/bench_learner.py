"""`parity bench learner`: the learner's forward+backward tokens/s, aligned vs standard.

Both backends train on the same weights and the same batch (`sequence_logprobs` of B sequences
of L tokens, the mean log-prob's gradient), repetitions interleaved (A B, B A, ...), medians
compared, per preset and dtype (bfloat16 with float32 master weights, as the learner runs it).
Each row also gives the aligned side's achieved GFLOP/s (3x the forward FLOPs of
`ModelConfig.forward_flops_per_token`) and its fraction of this machine's GEMM rate for the dtype,
measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .. import hardware
from ..config import LearnerConfig
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..model import Model, ModelConfig, sequence_logprobs
from ..ops import BACKENDS, describe_aligned
from .timing import busy_note, gemm_rate_again
from .ui import RateRow, collect, exit_status, gemm_line, status, table, term_as_interrupt


@dataclass
class LearnerRow(RateRow):
    preset: str
    dtype: str
    batch: int
    length: int
    aligned_tok_s: float
    standard_tok_s: float
    flops_per_token: float = 0.0
    gemm_gflops: float = 0.0
    """This machine's GEMM rate for the dtype, measured in the same run."""


def _step_fn(model: Model, seqs: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        lps = sequence_logprobs(model, seqs)
        (-torch.cat(lps).mean()).backward()
        model.zero_grad(set_to_none=True)
        hardware.sync(model.device)
    return run


def bench_learner(presets: Sequence[str] = ("small",), dtypes: Sequence[str] = ("float32", "bfloat16"),
                  batch: int = 8, length: int = 128, reps: int = 5,
                  progress: Callable[[str], None] | None = None, device: str = "cpu",
                  stopped: list[str] | None = None) -> list[LearnerRow]:
    """One row per preset and dtype. Interrupted (Ctrl-C, or SIGTERM under `term_as_interrupt`)
    with a `stopped` list, it returns the rows finished so far and says so there. Each dtype's GEMM
    rate is measured after its rows and again after all of them (`gemm_rate_again`)."""
    rows = collect(_rows(presets, dtypes, batch, length, reps, progress, device), stopped)
    if not stopped:
        gemm_rate_again(rows, device)
    return rows


def _rows(presets, dtypes, batch, length, reps, progress, device):
    for preset in presets:
        cfg = ModelConfig.preset(preset)
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, cfg.vocab_size, (length,), generator=gen) for _ in range(batch)]
        for dtype_name in dtypes:
            LearnerConfig(compute_dtype=dtype_name)  # validates the name
            base = Model(cfg, kernels=BACKENDS[0], dtype=dtype_from_name(dtype_name), seed=0, device=device)
            models = {k: base if k == BACKENDS[0] else base.twin(k) for k in BACKENDS}
            fns = {k: _step_fn(m, seqs) for k, m in models.items()}
            times: dict[str, list[float]] = {k: [] for k in fns}
            for r in range(reps + 1):  # round 0 warms up; the order reversed every other round
                for k, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
                    if progress:
                        progress(f"learner {preset} {dtype_name} {k} {r}/{reps}")
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times[k].append(time.perf_counter() - t0)
            tokens = batch * length
            if progress:
                progress(f"learner {dtype_name} GEMM rate")
            gemm = hardware.gemm_rate(dtype_from_name(dtype_name), device=device)
            del models, fns
            yield LearnerRow(preset, dtype_name, batch, length, tokens / statistics.median(times["aligned"]),
                             tokens / statistics.median(times["standard"]),
                             3 * cfg.forward_flops_per_token((length - 1) / 2), gemm)


def memory_floor(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Bytes a preset's rows hold at least at once: the two backends' weights and one model's
    gradients (or, while the second model is built in float32, then cast, the first's weights and
    the new one's float32 ones), and for `tokens` the float32 logits, their log-softmax and both
    their gradients. (Measured peaks here: 1.2-1.4x this at the 0.6B shape and 2 layers of
    Qwen3-30B-A3B, batch 8 x 128.)"""
    item = torch.empty((), dtype=dtype).element_size()
    return max(3 * item, item + 4) * cfg.num_parameters + 4 * tokens * cfg.vocab_size * 4


def main(args) -> int:
    """`parity bench learner`."""
    for name in args.dtypes:
        dtype_from_name(name, "--dtypes")
    if args.length < 2:  # (was "sequence 0: needs at least 2 tokens", naming no option)
        raise ParityError(f"--length must be at least 2 (a sequence scores its tokens after the first), "
                          f"got {args.length}")
    for p in args.presets:
        if args.length > ModelConfig.preset(p).max_position_embeddings:
            raise ParityError(f"--length {args.length} exceeds preset {p}'s max_position_embeddings")
    device = str(hardware.check_device(args.device, "--device"))
    if torch.device(device).type == "cpu":  # a refusal now, not the kernel's OOM kill mid-run
        free = hardware.available_memory()
        for p, name in ((p, n) for p in args.presets for n in args.dtypes):
            need = memory_floor(ModelConfig.preset(p), dtype_from_name(name), args.batch * args.length)
            if need > free:
                hint = "" if name == "bfloat16" else "; with --dtypes bfloat16 the weights take half"
                raise ParityError(f"--presets {p}: its {name} rows need at least {need / 2**30:.1f} GiB "
                                  f"(two copies of the weights, one of the gradients, the logits), "
                                  f"{free / 2**30:.1f} GiB is available{hint}")
    if args.gemm_tiles:
        from .bench_gemm import apply_tiles
        status(f"GEMM tiles: {apply_tiles(args.gemm_tiles)} weight shapes from {args.gemm_tiles}")
    stopped: list[str] = []
    with term_as_interrupt():  # a time limit's SIGTERM: report the rows done so far
        rows = bench_learner(args.presets, args.dtypes, args.batch, args.length, args.reps,
                             progress=lambda m: status(f"bench {m}"), device=device, stopped=stopped)
    status("")
    if args.json:
        print(json.dumps({"machine": hardware.describe(),
                          "threads": torch.get_num_threads(), "aligned_kernels": describe_aligned(device),
                          "rows": [{**asdict(r), "ratio": r.ratio, "aligned_gflops": r.aligned_gflops,
                                    "gemm_fraction": r.gemm_fraction} for r in rows],
                          "stopped": stopped}, indent=2))
        return exit_status(stopped)
    print(f"parity bench learner: forward+backward of {args.batch} x {args.length} tokens, medians of "
          f"{args.reps} interleaved repetitions, {torch.get_num_threads()} threads")
    print(f"machine: {hardware.line()}")
    print(f"aligned kernels: {describe_aligned(device)}")
    print(table(["preset", "dtype", "aligned tok/s", "standard tok/s", "aligned/standard",
                 "aligned GFLOP/s", "of GEMM rate"],
                [[r.preset, r.dtype, f"{r.aligned_tok_s:,.0f}", f"{r.standard_tok_s:,.0f}", f"{r.ratio:.3f}",
                  f"{r.aligned_gflops:,.1f}", f"{r.gemm_fraction:.0%}"] for r in rows]))
    print(gemm_line(rows))
    if note := busy_note():
        print(note)
    for why in stopped:
        print(f"{why}: the rows not listed were not measured")
    return exit_status(stopped)
