"""`parity bench async`: learner steps/hour, synchronous vs asynchronous training.

The same task and model train for `--steps` updates synchronously (lag 0) and asynchronously
(each lag in `--lags`) on long-tail response lengths; modes take turns per repetition. Steady-state
throughput excludes the first step (process start-up). Also reported: the share of time each side
waited for the other, and the largest lag seen.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..config import LearnerConfig, ModelSection, RolloutSection, TrainConfig
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..rl.controller import Controller
from .ui import status, table


@dataclass
class AsyncRow:
    mode: str
    max_policy_lag: int
    steps: int
    steps_per_hour: float
    learner_wait_frac: float
    rollout_wait_frac: float
    observed_lag_max: float


def bench_async(preset: str = "small", steps: int = 12, lags: Sequence[int] = (8, 64), prompts: int = 8,
                group: int = 4, max_tokens: int = 128, reps: int = 1, dtype: str = "float32",
                progress: Callable[[str], None] | None = None) -> tuple[list[AsyncRow], dict]:
    """Train the same task and model for `steps` updates synchronously (lag 0) and
    asynchronously (each lag in `lags`) on long-tail response lengths; modes take turns per
    repetition. Steady-state throughput excludes the first step (process start-up)."""
    modes = [0, *lags]
    per_mode: dict[int, list[tuple[float, float, float, float]]] = {m: [] for m in modes}
    for r in range(reps):
        for lag in modes:
            if progress:
                progress(f"async bench: lag {lag}, repetition {r + 1}/{reps}")
            with tempfile.TemporaryDirectory() as tmp:
                cfg = TrainConfig(
                    steps=steps, max_policy_lag=lag, run_dir=tmp, eval_every=0,
                    model=ModelSection(preset=preset, dtype=dtype),
                    rollout=RolloutSection(prompts_per_step=prompts, group_size=group, max_tokens=max_tokens,
                                           lengths="geometric"),
                    learner=LearnerConfig(micro_batch_size=8))
                metrics = Controller(cfg).run()
            steady = metrics[-1]["time/wall_s"] - metrics[0]["time/wall_s"]
            rest = metrics[1:]
            per_mode[lag].append((3600 * len(rest) / steady,
                                  sum(m["time/wait_s"] for m in rest) / steady,
                                  sum(m["time/rollout_wait_s"] for m in rest) / steady,
                                  max(m["lag/max"] for m in metrics)))
    rows = []
    for lag in modes:
        vals = per_mode[lag]
        rows.append(AsyncRow("sync" if lag == 0 else "async", lag, steps,
                             statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals),
                             statistics.median(v[2] for v in vals), max(v[3] for v in vals)))
    sync = rows[0].steps_per_hour
    ratios = {f"async_lag{r.max_policy_lag}_over_sync": r.steps_per_hour / sync for r in rows[1:]}
    return rows, ratios


def main(args) -> int:
    """`parity bench async`."""
    if args.steps < 2:
        raise ParityError("--steps must be at least 2 (the first step is start-up and not timed)")
    if any(lag < 1 for lag in args.lags):
        raise ParityError("--lags must be positive (lag 0, synchronous, always runs)")
    dtype_from_name(args.dtype, "--dtype")
    rows, ratios = bench_async(args.preset, args.steps, args.lags, args.prompts, args.group, args.max_tokens,
                               args.reps, args.dtype, progress=status)
    status("")
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": [asdict(r) for r in rows],
                          "ratios": ratios}, indent=2))
        return 0
    print(f"parity bench async: {args.preset} {args.dtype}, {args.steps} learner steps of "
          f"{args.prompts}x{args.group} responses, geometric lengths up to {args.max_tokens} tokens; "
          f"steady state (first step excluded), median of {args.reps}")
    print(table(["mode", "max lag", "steps/hour", "learner waits", "rollout waits", "lag seen"],
                [[r.mode, str(r.max_policy_lag), f"{r.steps_per_hour:,.0f}",
                  f"{100 * r.learner_wait_frac:.0f}%", f"{100 * r.rollout_wait_frac:.0f}%",
                  f"{r.observed_lag_max:.0f}"] for r in rows]))
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    return 0
