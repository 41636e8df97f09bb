"""`parity bench async`: learner steps/hour, synchronous vs asynchronous training, per backend.

The same task and model train for `--steps` updates synchronously (lag 0, local backend, one
worker) and asynchronously (each lag in `--lags`, on each of `--backends` with each of
`--workers` rollout workers) on long-tail response lengths; modes take turns per repetition.
Steady-state throughput excludes the first step (process or actor start-up). Also reported: the
share of time each side waited for the other, the largest lag seen, and weight sync — seconds per
publication, how long a worker paused to load weights, bytes moved per step.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .. import hardware
from ..config import LearnerConfig, ModelSection, RolloutSection, TrainConfig
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..rl.controller import Controller
from .ui import status, table


@dataclass
class AsyncRow:
    mode: str
    """'sync' (lag 0, local backend, one worker: the baseline) or 'async'."""
    backend: str
    workers: int
    max_policy_lag: int
    steps: int
    steps_per_hour: float
    learner_wait_frac: float
    """Share of the steady wall time the learner spent waiting for batches."""
    rollout_wait_frac: float
    """Share of the rollout workers' time (waiting + generating, summed over their batches) spent
    waiting for weights: a per-worker share, so it stays <= 1 with several workers and when a
    batch's wait began before the timed steps."""
    observed_lag_max: float
    publish_s: float
    """Median seconds the learner spent publishing one version to the workers."""
    rollout_pause_s: float
    """Median seconds per batch a worker paused to load new weights."""
    bytes_moved: float
    """Weight bytes sent to the workers per learner step (one version per worker)."""
    gflops: float = 0.0
    """Useful model GFLOP/s of the whole run (rollout forwards + learner forward/backward of every
    sequence, `throughput/model_flops`), steady state."""
    gemm_gflops: float = 0.0
    """This machine's GEMM rate for the dtype, measured in the same run."""

    @property
    def gemm_fraction(self) -> float:
        return self.gflops / self.gemm_gflops if self.gemm_gflops else 0.0


def _share(wait: float, busy: float) -> float:
    return wait / (wait + busy) if wait + busy > 0 else 0.0


def _measure(cfg: TrainConfig) -> tuple[float, ...]:
    metrics = Controller(cfg).run()
    steady = metrics[-1]["time/wall_s"] - metrics[0]["time/wall_s"]
    rest = metrics[1:]  # the first step includes process / actor start-up
    return (3600 * len(rest) / steady, sum(m["time/wait_s"] for m in rest) / steady,
            _share(sum(m["time/rollout_wait_s"] for m in rest), sum(m["time/generate_s"] for m in rest)),
            max(m["lag/max"] for m in metrics),
            statistics.median(m["sync/publish_s"] for m in rest),
            statistics.median(m["sync/rollout_pause_s"] for m in rest), rest[-1]["sync/bytes_moved"],
            sum(m["throughput/model_flops"] for m in rest) / steady / 1e9)


def bench_async(preset: str = "small", steps: int = 12, lags: Sequence[int] = (8, 64), prompts: int = 8,
                group: int = 4, max_tokens: int = 128, reps: int = 3, dtype: str = "float32",
                backends: Sequence[str] = ("local",), workers: Sequence[int] = (1,),
                progress: Callable[[str], None] | None = None,
                device: str = "cpu") -> tuple[list[AsyncRow], dict, dict]:
    """Train the same task and model for `steps` updates synchronously (lag 0, local backend, one
    worker) and asynchronously (each lag in `lags`, on each backend with each worker count) on
    long-tail response lengths; modes take turns per repetition. Steady-state throughput excludes
    the first step (process or actor start-up). The kernel/lag decomposition is off in every mode:
    it is a diagnostic, and in async runs it costs the rollout side an extra scoring forward that
    sync runs do not pay (12-15% of a worker's generation time), which would bias the ratio. On a
    GPU (`device`) the learner and its local rollout workers share it."""
    modes = [("local", 1, 0)] + [(b, n, lag) for b in backends for n in workers for lag in lags]
    if progress:
        progress(f"async bench: {dtype} GEMM rate")
    threads = torch.get_num_threads()  # the runs set this process's (the learner's) thread count
    gemm = hardware.gemm_rate(dtype_from_name(dtype), device=device)
    per_mode: dict[tuple, list[tuple[float, ...]]] = {m: [] for m in modes}
    for r in range(reps):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # (the order reversed every other time)
            backend, n, lag = mode
            if progress:
                progress(f"async bench: {backend} x{n}, lag {lag}, repetition {r + 1}/{reps}")
            with tempfile.TemporaryDirectory() as tmp:
                per_mode[mode].append(_measure(TrainConfig(
                    steps=steps, max_policy_lag=lag, run_dir=tmp, eval_every=0,
                    model=ModelSection(preset=preset, dtype=dtype, device=device),
                    rollout=RolloutSection(prompts_per_step=prompts, group_size=group, max_tokens=max_tokens,
                                           lengths="geometric", backend=backend, workers=n),
                    learner=LearnerConfig(micro_batch_size=8, decompose_every=0))))
    torch.set_num_threads(threads)
    rows = []
    for (backend, n, lag), vals in per_mode.items():
        med = [statistics.median(v[k] for v in vals) for k in range(8)]
        rows.append(AsyncRow("sync" if lag == 0 else "async", backend, n, lag, steps, med[0], med[1], med[2],
                             max(v[3] for v in vals), med[4], med[5], med[6], med[7], gemm))
    sync = rows[0].steps_per_hour
    ratios = {f"{r.backend}_x{r.workers}_lag{r.max_policy_lag}_over_sync": r.steps_per_hour / sync
              for r in rows[1:]}
    # each repetition's own ratio (its async run over its sync run, which ran beside it): the spread
    spreads = {}
    for key, mode in zip(ratios, modes[1:], strict=True):
        per_rep = [a[0] / s[0] for a, s in zip(per_mode[mode], per_mode[modes[0]], strict=True)]
        spreads[key] = (min(per_rep), max(per_rep))
    return rows, ratios, spreads


def main(args) -> int:
    """`parity bench async`."""
    if args.reps < 1:
        raise ParityError("--reps must be at least 1")
    if args.steps < 2:
        raise ParityError("--steps must be at least 2 (the first step is start-up and not timed)")
    if any(lag < 1 for lag in args.lags):
        raise ParityError("--lags must be positive (lag 0, synchronous, always runs)")
    dtype_from_name(args.dtype, "--dtype")
    hardware.check_device(args.device, "--device")
    if any(b not in ("local", "ray") for b in args.backends) or any(n < 1 for n in args.workers):
        raise ParityError("--backends takes local and/or ray, --workers positive integers")
    for name, values in (("--lags", args.lags), ("--backends", args.backends), ("--workers", args.workers)):
        if len(set(values)) != len(values):
            raise ParityError(f"{name} names a value twice: {','.join(map(str, values))}")
    rows, ratios, spreads = bench_async(args.preset, args.steps, args.lags, args.prompts, args.group,
                                        args.max_tokens, args.reps, args.dtype, args.backends, args.workers,
                                        progress=status, device=args.device)
    status("")
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "cores": os.cpu_count(), "device": args.device,
                          "rows": [{**asdict(r), "gemm_fraction": r.gemm_fraction} for r in rows],
                          "ratios": ratios, "ratio_ranges": spreads}, indent=2))
        return 0
    print(f"parity bench async: {args.preset} {args.dtype} ({args.device}), {args.steps} learner steps of "
          f"{args.prompts}x{args.group} responses, geometric lengths up to {args.max_tokens} tokens; "
          f"steady state (first step excluded), median of {args.reps}")
    print(f"machine: {hardware.line()}")
    print(table(["mode", "backend", "workers", "max lag", "steps/hour", "learner waits", "rollout waits",
                 "lag seen", "publish ms", "load ms", "MB moved/step", "GFLOP/s", "of GEMM rate"],
                [[r.mode, r.backend, str(r.workers), str(r.max_policy_lag), f"{r.steps_per_hour:,.0f}",
                  f"{100 * r.learner_wait_frac:.0f}%", f"{100 * r.rollout_wait_frac:.0f}%",
                  f"{r.observed_lag_max:.0f}", f"{1000 * r.publish_s:.2f}", f"{1000 * r.rollout_pause_s:.1f}",
                  f"{r.bytes_moved / 2**20:.1f}", f"{r.gflops:,.1f}", f"{r.gemm_fraction:.0%}"]
                 for r in rows]))
    print(f"GEMM rate (2048^3, same run): {args.dtype} {rows[0].gemm_gflops:,.0f} GFLOP/s; GFLOP/s counts "
          f"4 forwards per sequence token (rollout, learner forward and backward)")
    for k, v in ratios.items():
        low, high = spreads[k]
        print(f"{k}: {v:.2f}" + (f" (each repetition's own: {low:.2f}-{high:.2f})" if args.reps > 1 else ""))
    return 0
