"""`parity demo`: the whole story in one command, on a laptop-class CPU in minutes.

1. Gets the base policy (`parity sft`'s cached checkpoint; built on first use).
2. Runs asynchronous REINFORCE Zero (token-level IS without clipping, group-mean baseline) with
   aligned kernels at policy lag 8 on the tool-use task (sandboxed Python tool), evaluating
   greedy pass@1 on the held-out set before, during and after.
3. Ends with a table read from the run's metrics: held-out pass@1 before and after, the
   rollout-to-learner KL at matching versions (exactly 0 with aligned kernels), importance-weight
   peak/median, throughput, plus the run report (`report.md`, `report.png`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .config import load_config


@dataclass
class DemoOptions:
    steps: int = 40
    max_policy_lag: int = 8
    kernels: str = "aligned"
    run_dir: str = "runs/demo"
    eval_prompts: int = 200
    seed: int = 0
    base: str | None = None
    """A base checkpoint to start from instead of the cached `parity sft` policy."""


def _recipe(base: str) -> dict:
    """The `parity sft` recipe a base checkpoint was trained with ({} when unknown)."""
    try:
        return json.loads((Path(base) / "sft.json").read_text()).get("config", {})
    except (OSError, ValueError):
        return {}


def demo_config(opts: DemoOptions, base: str, overrides: list[str] = ()):
    """The training config the demo runs (printable with `to_toml`): the tool task at the
    difficulty the base policy was trained on."""
    recipe = _recipe(base)
    kinds = sorted(recipe.get("tool_use", {"mul": 1, "sum": 1}))
    settings = [f"task.level={int(recipe.get('tool_level', 2))}", f"task.kinds={json.dumps(kinds)}",
        f"steps={opts.steps}", f"max_policy_lag={opts.max_policy_lag}", f"seed={opts.seed}",
        f'run_dir="{opts.run_dir}"', f"eval_every={max(1, opts.steps // 2)}",
        f"eval_prompts={opts.eval_prompts}", f'model.checkpoint="{base}"', f'model.kernels="{opts.kernels}"',
        'task.name="tool"', "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_tokens=64",
        "rollout.max_num_seqs=64", 'learner.loss="reinforce_zero"', "learner.lr=5e-5",
        "learner.micro_batch_size=16", "learner.max_grad_norm=1.0",
    ]
    return load_config(None, settings + list(overrides))


def summary(metrics: list[dict]) -> list[tuple[str, str]]:
    """The demo's closing table, read from the run's metrics."""
    first, last = metrics[0], metrics[-1]
    before = first.get("eval/pass@1")
    after = last.get("eval/pass@1_final", last.get("eval/pass@1"))
    ci_b = first.get("eval/pass@1_ci95", float("nan"))
    ci_a = last.get("eval/pass@1_ci95_final", float("nan"))

    def series(key):
        return [m[key] for m in metrics if key in m]

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")

    k3 = series("mismatch/kernel_k3")
    kmax = series("mismatch/kernel_max_abs")
    peak = series("is_weight/peak_over_median")
    n = len(metrics)
    head, tail = metrics[: max(1, n // 10)], metrics[-max(1, n // 10):]

    def mean(rows, key):
        xs = [r[key] for r in rows if key in r]
        return sum(xs) / len(xs) if xs else float("nan")

    pts = (after - before) * 100 if before is not None and after is not None else float("nan")
    return [
        ("held-out pass@1 (greedy), before -> after",
         f"{before:.1%} ± {ci_b:.1%} -> {after:.1%} ± {ci_a:.1%}  ({pts:+.1f} points)"),
        ("rollout-learner KL at the sampling version (max)", f"{max(k3, default=float('nan')):.3g}"),
        ("kernel mismatch max |Δ log-prob| (all steps)", f"{max(kmax, default=float('nan')):.3g}"),
        ("importance weight peak/median (median step / worst step)",
         f"{med(peak):.4g} / {max(peak, default=float('nan')):.4g}"),
        ("policy lag max / mean", f"{max(m.get('lag/max', 0) for m in metrics):.0f} / "
                                  f"{mean(metrics, 'lag/mean'):.2f}"),
        ("reward, first 10% -> last 10%",
         f"{mean(head, 'reward/mean'):.3f} -> {mean(tail, 'reward/mean'):.3f}"),
        ("tool calls per episode, first 10% -> last 10%",
         f"{mean(head, 'rollout/tool_calls'):.2f} -> {mean(tail, 'rollout/tool_calls'):.2f}"),
        ("learner steps/hour; sampled tokens/s", f"{last.get('throughput/steps_per_hour', 0):,.0f}; "
                                                 f"{last.get('throughput/tokens_per_s', 0):,.0f}"),
        ("training wall time (s)", f"{last.get('time/wall_s', 0):.0f}"),
    ]


def run_demo(opts: DemoOptions, overrides: list[str] = (), log=print, progress_factory=None) -> dict:
    """Run the demo; returns {'metrics', 'summary', 'base', 'seconds'}."""
    from .rl.controller import Controller
    from .sft import get_base_policy

    t0 = time.perf_counter()
    sft_progress = progress_factory("sft") if progress_factory else None
    base = opts.base or get_base_policy(log=log, progress=sft_progress)
    log(f"parity: base policy {base} ({time.perf_counter() - t0:.0f} s)")
    cfg = demo_config(opts, str(base), overrides)
    controller = Controller(cfg)
    log(f"parity: {controller.task_description}")
    log(f"parity: asynchronous REINFORCE Zero, {cfg.model.kernels} kernels, policy lag "
        f"{cfg.max_policy_lag}, {cfg.steps} steps x {cfg.rollout.batch_size} episodes "
        f"(run dir {cfg.run_dir})")
    progress = progress_factory("train", cfg.steps) if progress_factory else None
    metrics = controller.run(progress=progress)
    return {"metrics": metrics, "summary": summary(metrics), "base": str(base),
            "seconds": time.perf_counter() - t0, "run_dir": cfg.run_dir}
