"""`parity demo`: the whole story in one command, on a laptop-class CPU in minutes.

1. Gets the base policy (`parity sft`'s cached checkpoint; built on first use).
2. Runs asynchronous REINFORCE Zero (token-level IS without clipping, group-mean baseline) with
   aligned kernels at policy lag 8 on the tool-use task (sandboxed Python tool), evaluating
   greedy pass@1 on the held-out set before, during and after.
3. Ends with a table read from the run's metrics (`metrics.summary.demo_rows`): held-out pass@1
   before and after, the rollout-to-learner KL at matching versions (exactly 0 with aligned
   kernels), importance-weight peak/median, throughput, plus the run report.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import LearnerConfig, ModelSection, RolloutSection, TaskSection, TrainConfig, with_overrides
from ..envs.sandbox import Sandbox
from ..errors import ConfigError, ParityError
from ..metrics.report import write_report
from ..metrics.summary import demo_rows, step_line
from ..model.loading import checkpoint_dir
from ..rl import checkpoint
from ..rl.checkpoint import DEMO_MARK
from ..rl.controller import Controller
from .sft import RECIPES, get_base_policy, names_recipe
from .ui import Progress, table

log = logging.getLogger(__name__)


@dataclass
class DemoOptions:
    steps: int = 40
    """Learner steps."""
    max_policy_lag: int = 8
    """Policy lag bound."""
    kernels: str = "aligned"
    """Kernel backend ('standard' is the baseline)."""
    run_dir: str = "runs/demo"
    """Run directory."""
    eval_prompts: int = 200
    """Held-out problems per evaluation."""
    seed: int = 0
    """Seed of prompts and sampling."""
    base: str | None = None
    """A base checkpoint to start from instead of the cached `parity sft` policy."""
    overwrite: bool = False
    """Replace another command's run found in `run_dir` (a demo's own earlier run, marked by
    `DEMO_MARK`, is always replaced)."""




def _recipe(base: str) -> dict:
    """The `parity sft` recipe a base checkpoint was trained with ({} when unknown)."""
    try:
        record = json.loads((Path(base) / "sft.json").read_text())
    except (OSError, ValueError):
        return {}
    recipe = record.get("config", {}) if isinstance(record, dict) else {}
    return recipe if isinstance(recipe, dict) else {}  # (a damaged sft.json: the defaults)


def demo_config(opts: DemoOptions, base: str, overrides: list[str] = ()) -> TrainConfig:
    """The training config the demo runs: the tool task at the difficulty the base policy was
    trained on, async REINFORCE Zero; `overrides` are `--set key=value` items."""
    recipe = _recipe(base)
    cfg = TrainConfig(
        steps=opts.steps, max_policy_lag=opts.max_policy_lag, seed=opts.seed, run_dir=opts.run_dir,
        eval_every=max(1, opts.steps // 2), eval_prompts=opts.eval_prompts,
        model=ModelSection(checkpoint=str(base), kernels=opts.kernels),
        rollout=RolloutSection(prompts_per_step=8, group_size=8, max_tokens=64, max_num_seqs=64),
        task=TaskSection(name="tool", level=int(recipe.get("tool_level", 2)),
                         kinds=sorted(recipe.get("tool_use", {"mul": 1, "sum": 1}))),
        learner=LearnerConfig(loss="reinforce_zero", lr=5e-5, micro_batch_size=16, max_grad_norm=1.0))
    return with_overrides(cfg, list(overrides)) if overrides else cfg


OWN_OPTIONS = {"run_dir": "--run-dir", "steps": "--steps", "max_policy_lag": "--lag", "seed": "--seed",
               "model.kernels": "--kernels", "model.checkpoint": "--model", "eval_prompts": "--eval-prompts"}
"""Config keys the demo's own options set (`--set` of one of them silently won over its option)."""


def run_demo(opts: DemoOptions, overrides: list[str] = ()) -> dict:
    """Run the demo; returns {'metrics', 'summary', 'base', 'seconds', 'run_dir', 'max_policy_lag'}."""
    for item in overrides:  # (before the base policy, which may take minutes to build)
        key = item.split("=", 1)[0].strip()
        if key in OWN_OPTIONS:
            raise ConfigError(f"--set {key}: the demo sets it with {OWN_OPTIONS[key]}")
        if key == "task.name":  # (its title, table and task.level are the tool task's)
            raise ConfigError("--set task.name: the demo is the tool-use task; `parity train --set "
                              "task.name=...` trains another")
    earlier = Path(opts.run_dir)
    found = checkpoint.found(earlier) if not (earlier / DEMO_MARK).exists() and not opts.overwrite else []
    if found:  # (before the base policy's build, in the demo's own words)
        raise ParityError(f"{earlier} holds {found[-1].name} of another command's run: replace it with "
                          f"--overwrite, or choose another --run-dir")
    if demo_config(opts, "base", overrides).task.require_isolation:  # refused before the base's build
        try:  # (minutes) where the tool calls cannot be isolated
            Sandbox()
        except ParityError as exc:
            raise ParityError(f"{exc}; for the demo: `parity demo --set task.require_isolation=false` "
                              "(make demo ARGS=\"--set task.require_isolation=false\")") from None
    t0 = time.perf_counter()
    # (a recipe's name, as every other --model takes: 'base' was refused as unresolved)
    if opts.base and not names_recipe(opts.base):  # (before "base policy X" is said)
        checkpoint_dir(opts.base)
    base = get_base_policy(RECIPES[opts.base]) if names_recipe(opts.base) else opts.base or get_base_policy()
    log.info("base policy %s (%.0f s)", base, time.perf_counter() - t0)
    cfg = demo_config(opts, str(base), overrides)
    run_dir = Path(cfg.run_dir)
    own = (run_dir / DEMO_MARK).exists()  # (by the mark alone: another command's run in runs/demo was lost)
    controller = Controller(cfg, overwrite=own or opts.overwrite)  # else refuses a run it would mix with
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARK).touch()
    log.info("%s", controller.task_description)
    log.info("%s %s, %s kernels, policy lag %d, %d step(s) x %d episodes (run dir %s)",
             "asynchronous" if cfg.max_policy_lag else "synchronous", objective_name(cfg), cfg.model.kernels,
             cfg.max_policy_lag, cfg.steps, cfg.rollout.batch_size, cfg.run_dir)
    bar = Progress("train", cfg.steps, every=5)
    try:
        metrics = controller.run(progress=lambda step, m: bar.update(step, step_line(m)))
    finally:
        bar.close()
    write_report(cfg.run_dir)
    return {"metrics": metrics, "summary": demo_rows(metrics), "base": str(base),
            "seconds": time.perf_counter() - t0, "objective": objective_name(cfg), "run_dir": cfg.run_dir,
            "max_policy_lag": cfg.max_policy_lag}


def objective_name(cfg) -> str:
    """The objective as the demo names it ('REINFORCE Zero', or `--set learner.loss=...`'s name),
    with its KL penalty when `learner.kl_coef` is set and its updates per batch when more than one."""
    loss, beta = cfg.learner.loss, cfg.learner.kl_coef
    updates = cfg.learner.mini_batches * cfg.learner.epochs
    return ("REINFORCE Zero" if loss == "reinforce_zero" else loss) + (f" + {beta:g}·KL" if beta else "") + \
        (f", {updates} updates per batch" if updates > 1 else "")


def main(args) -> int:
    """`parity demo`."""
    opts = DemoOptions(steps=args.steps, max_policy_lag=args.lag, kernels=args.kernels, run_dir=args.run_dir,
                       eval_prompts=args.eval_prompts, seed=args.seed, base=args.model,
                       overwrite=args.overwrite)
    result = run_demo(opts, args.set or [])
    print()
    mode = "async" if result["max_policy_lag"] else "synchronous"
    print(table([f"parity demo: tool-use task, {mode} {result['objective']}", "value"],
                [list(r) for r in result["summary"]]))
    run_dir = result["run_dir"]
    print(f"done in {result['seconds']:.0f} s: {run_dir}/report.md, {run_dir}/report.png, "
          f"{run_dir}/metrics.jsonl")
    return 0
