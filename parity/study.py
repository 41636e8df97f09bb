"""`parity study`: the published comparisons as a grid of training runs, and one report.

The default grid (every run from the same base policy, task, seeds and budget):

    | run         | kernels  | lag | objective                      |
    | sync        | aligned  | 0   | reinforce_zero                 |
    | async-8     | aligned  | 8   | reinforce_zero                 |
    | async-64    | aligned  | 64  | reinforce_zero                 |
    | std-64      | standard | 64  | reinforce_zero (unclipped IS)  |
    | std-64-tis  | standard | 64  | tis                            |
    | std-64-gate | standard | 64  | seq_gate                       |

Runs execute one after another (each is a normal `parity train` run with its own directory).
The table is computed from the runs' `metrics.jsonl` files with the definitions the published
results use (see `row_figures`); `results.json`, `report.md` and `study.png` are written beside
them. Nothing in the report is typed by hand.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import _set_dotted, config_from_dict, read_toml
from .errors import ConfigError


@dataclass
class StudyRun:
    """One row of the grid."""

    name: str
    """Row label."""
    kernels: str = "aligned"
    """'aligned' or 'standard'."""
    lag: int = 0
    """max_policy_lag (0 = synchronous)."""
    loss: str = "reinforce_zero"
    """Learner objective."""

    def __post_init__(self) -> None:
        from .rl.losses import LOSSES

        if self.kernels not in ("aligned", "standard"):
            raise ConfigError(f"study run {self.name!r}: kernels must be 'aligned' or 'standard', "
                              f"got {self.kernels!r}")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0:
            raise ConfigError(f"study run {self.name!r}: lag must be an integer >= 0, got {self.lag!r}")
        if self.loss not in LOSSES:
            raise ConfigError(f"study run {self.name!r}: unknown loss {self.loss!r}")


DEFAULT_GRID = [
    StudyRun("sync", "aligned", 0),
    StudyRun("async-8", "aligned", 8),
    StudyRun("async-64", "aligned", 64),
    StudyRun("std-64", "standard", 64),
    StudyRun("std-64-tis", "standard", 64, "tis"),
    StudyRun("std-64-gate", "standard", 64, "seq_gate"),
]


@dataclass
class StudyConfig:
    """A study: the grid, the seeds, and the training config every run shares."""

    out_dir: str = "runs/study"
    """Where runs, results.json, report.md and study.png go."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds (prompts, sampling); every run is repeated per seed."""
    task: str = "tool"
    """'tool' or 'math'."""
    runs: list[StudyRun] = field(default_factory=lambda: list(DEFAULT_GRID))
    """The grid."""
    train: dict[str, Any] = field(default_factory=dict)
    """Training config keys shared by every run (the [train] table; dotted keys allowed)."""
    quick: bool = False
    """Smoke-sized: tiny runs from a base policy of a few SFT steps built in out_dir (CI)."""

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ConfigError("study.seeds must not be empty")
        if self.task not in ("tool", "math"):
            raise ConfigError(f"study.task must be 'tool' or 'math', got {self.task!r}")
        names = [r.name for r in self.runs]
        if not names or len(set(names)) != len(names):
            raise ConfigError("study.runs must be non-empty with unique names")


DEFAULT_TRAIN = {
    "steps": 60,
    "eval_every": 20,
    "eval_prompts": 100,
    "model.checkpoint": "base",
    "rollout.prompts_per_step": 8,
    "rollout.group_size": 8,
    "rollout.max_tokens": 64,
    "learner.lr": 5e-5,
    "learner.micro_batch_size": 16,
}

QUICK_TRAIN = {
    "steps": 3,
    "eval_every": 2,
    "eval_prompts": 4,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.max_tokens": 12,
}


def load_study(
    path: str | None,
    quick: bool = False,
    task: str | None = None,
    seeds: list[int] | None = None,
    out_dir: str | None = None,
) -> StudyConfig:
    """A StudyConfig from TOML (top-level out_dir/seeds/task, [train] table, [[runs]] tables)."""
    data: dict[str, Any] = read_toml(path, "study config") if path is not None else {}
    unknown = sorted(set(data) - {"out_dir", "seeds", "task", "runs", "train"})
    if unknown:
        raise ConfigError(f"unknown study key {unknown[0]}")
    runs = data.get("runs")
    if runs is not None:
        try:
            runs = [StudyRun(**r) for r in runs]
        except TypeError as exc:
            raise ConfigError(f"study runs: {exc}") from None
    train = {**DEFAULT_TRAIN, **data.get("train", {})}
    if quick:
        train.update(QUICK_TRAIN)
        if train.get("model.checkpoint") == "base":
            train["model.checkpoint"] = str(Path(out_dir or data.get("out_dir", "runs/study")) / "quick-base")
    cfg = StudyConfig(quick=quick,
        out_dir=out_dir or data.get("out_dir", "runs/study"),
        seeds=seeds or ([0] if quick else data.get("seeds", [0, 1, 2])),
        task=task or data.get("task", "tool"),
        train=train,
        **({"runs": runs} if runs is not None else {}),
    )
    if not quick:
        for run in cfg.runs:  # every run's config must build before the first one starts
            run_config(cfg, run, cfg.seeds[0])
    return cfg


def run_config(study: StudyConfig, run: StudyRun, seed: int):
    """The TrainConfig of one grid cell."""
    data: dict[str, Any] = {}
    for key, value in study.train.items():
        _set_dotted(data, key, value)
    for key, value in {
        "max_policy_lag": run.lag,
        "seed": seed,
        "run_dir": str(Path(study.out_dir) / f"{run.name}-seed{seed}"),
        "model.kernels": run.kernels,
        "learner.loss": run.loss,
        "task.name": study.task,
    }.items():
        _set_dotted(data, key, value)
    if study.task == "tool":
        data.setdefault("task", {}).setdefault("level", 1)
    return config_from_dict(data)


# --------------------------------------------------------------------------- figures
def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def row_figures(metrics: list[dict]) -> dict[str, float]:
    """The published figures of one run, from its metrics (definitions as published):

    - is_peak_over_median: peak over median of the per-step max importance weight;
    - kl_last_over_first: rollout-to-learner KL (k3), mean of the last 10% of updates over the
      mean of the first 10%;
    - kernel_mismatch_max: max |Δ log-prob| between rollout and learner at the same weights;
    - grad_norm_max: largest gradient norm before clipping;
    - reward_first5 / reward_last5: mean reward over the first / last 5% of updates;
    - pass1_start / pass1_peak / pass1_end: held-out greedy pass@1;
    - wall_s, steps_per_hour; lag_mean, lag_max: observed policy lag.
    """
    n = len(metrics)
    series = lambda key: [m[key] for m in metrics if key in m]  # noqa: E731
    w = series("is_weight/max")
    k3 = series("mismatch/k3")
    c10, c5 = max(1, round(n * 0.10)), max(1, round(n * 0.05))
    kl_first, kl_last = _mean(k3[:c10]), _mean(k3[-c10:])
    rewards = series("reward/mean")
    evals = series("eval/pass@1")
    final = metrics[-1].get("eval/pass@1_final")
    if final is not None:
        evals = evals + [final]
    last = metrics[-1]
    return {
        "steps": float(n),
        "is_peak_over_median": max(w) / statistics.median(w) if w else float("nan"),
        "kl_first": kl_first,
        "kl_last": kl_last,
        "kl_last_over_first": kl_last / kl_first if kl_first > 0 else (1.0 if kl_last == 0 else float("inf")),
        "kernel_mismatch_max": max(series("mismatch/kernel_max_abs"), default=float("nan")),
        "grad_norm_max": max(series("train/grad_norm"), default=float("nan")),
        "reward_first5": _mean(rewards[:c5]),
        "reward_last5": _mean(rewards[-c5:]),
        "pass1_start": evals[0] if evals else float("nan"),
        "pass1_peak": max(evals) if evals else float("nan"),
        "pass1_end": evals[-1] if evals else float("nan"),
        "wall_s": last.get("time/wall_s", float("nan")),
        "steps_per_hour": last.get("throughput/steps_per_hour", float("nan")),
        "lag_mean": _mean(series("lag/mean")),
        "lag_max": max(series("lag/max"), default=0.0),
    }


def aggregate(per_seed: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean, spread (min..max half-range) and values over seeds, per figure."""
    out = {}
    for key in per_seed[0]:
        vals = [r[key] for r in per_seed]
        finite = [v for v in vals if not math.isnan(v)]
        out[key] = {
            "mean": _mean(vals),
            "spread": (max(finite) - min(finite)) / 2 if finite else float("nan"),
            "values": vals,
        }
    return out


# --------------------------------------------------------------------------- running
def run_study(study: StudyConfig, log=print, progress_factory=None) -> dict:
    """Run every grid cell (skipping ones already finished in out_dir) and write the report."""
    from .metrics.report import read_metrics
    from .rl.controller import Controller

    out = Path(study.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if study.quick:
        from .sft import SFTConfig, is_built, train_sft

        quick_base = Path(study.train.get("model.checkpoint", out / "quick-base"))
        if not is_built(quick_base):
            log(f"parity: --quick: building a smoke base policy (10 SFT steps) in {quick_base}")
            train_sft(quick_base, SFTConfig(steps=10, batch_size=8, warmup_steps=2), eval_problems=0)
        for run in study.runs:
            run_config(study, run, study.seeds[0])
    t0 = time.perf_counter()
    results: dict[str, Any] = {"config": asdict(study), "runs": {}}
    total = len(study.runs) * len(study.seeds)
    k = 0
    figures: dict[str, list[dict[str, float]]] = {run.name: [] for run in study.runs}
    for seed in study.seeds:  # seed-major: a study cut short still has every row
        for run in study.runs:
            k += 1
            cfg = run_config(study, run, seed)
            done_marker = Path(cfg.run_dir) / "report.md"
            if done_marker.exists() and len(read_metrics(cfg.run_dir)) == cfg.steps:
                log(f"[{k}/{total}] {run.name} seed {seed}: already done ({cfg.run_dir})")
            else:
                log(f"[{k}/{total}] {run.name} seed {seed}: {run.kernels} kernels, lag {run.lag}, {run.loss}")
                progress = progress_factory(f"{run.name}/{seed}", cfg.steps) if progress_factory else None
                Controller(cfg).run(progress=progress)
            figures[run.name].append(row_figures(read_metrics(cfg.run_dir)))
    for run in study.runs:
        results["runs"][run.name] = {"run": asdict(run), "seeds": study.seeds,
                                     "figures": aggregate(figures[run.name])}
    sync = results["runs"].get("sync")
    if sync:
        base = sync["figures"]["steps_per_hour"]["mean"]
        for r in results["runs"].values():
            r["figures"]["throughput_vs_sync"] = {
                "mean": r["figures"]["steps_per_hour"]["mean"] / base,
                "spread": float("nan"),
                "values": [],
            }
    results["seconds"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_study_report(study, results)
    return results


# --------------------------------------------------------------------------- report
COLUMNS = [
    ("IS weight peak/median", "is_peak_over_median", "{:.4g}"),
    ("KL last/first 10%", "kl_last_over_first", "{:.3g}"),
    ("kernel mismatch max abs Δ", "kernel_mismatch_max", "{:.3g}"),
    ("max grad norm", "grad_norm_max", "{:.4g}"),
    ("reward first 5%", "reward_first5", "{:.3f}"),
    ("reward last 5%", "reward_last5", "{:.3f}"),
    ("pass@1 start", "pass1_start", "{:.1%}"),
    ("pass@1 peak", "pass1_peak", "{:.1%}"),
    ("pass@1 end", "pass1_end", "{:.1%}"),
    ("wall s", "wall_s", "{:.0f}"),
    ("steps/hour", "steps_per_hour", "{:,.0f}"),
    ("vs sync", "throughput_vs_sync", "{:.2f}x"),
    ("lag mean", "lag_mean", "{:.1f}"),
    ("lag max", "lag_max", "{:.0f}"),
]

PLOTS = [
    ("reward", "reward/mean"),
    ("held-out pass@1", "eval/pass@1"),
    ("rollout-learner KL (k3)", "mismatch/k3"),
    ("IS weight peak/median", "is_weight/peak_over_median"),
    ("grad norm (pre-clip)", "train/grad_norm"),
]


def _cell(fig: dict[str, float], fmt: str, seeds: int) -> str:
    mean, spread = fig["mean"], fig["spread"]
    if mean is None or math.isnan(mean):
        return "-"
    text = fmt.format(mean)
    if seeds > 1 and not math.isnan(spread) and spread > 0:
        text += " ± " + fmt.format(spread).rstrip("x")
    return text


def table_markdown(results: dict) -> str:
    seeds = len(results["config"]["seeds"])
    head = "| run | kernels | lag | objective | " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "|" + "---|" * (4 + len(COLUMNS))
    rows = []
    for name, r in results["runs"].items():
        cells = [
            _cell(r["figures"][key], fmt, seeds) if key in r["figures"] else "-" for _, key, fmt in COLUMNS
        ]
        rows.append(
            f"| {name} | {r['run']['kernels']} | {r['run']['lag']} | {r['run']['loss']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join([head, sep, *rows])


def write_study_report(study: StudyConfig, results: dict) -> None:
    from .metrics.report import read_metrics

    out = Path(study.out_dir)
    png = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(PLOTS), figsize=(5 * len(PLOTS), 4))
        for ax, (title, key) in zip(axes, PLOTS):
            for run in study.runs:
                cfg = run_config(study, run, study.seeds[0])
                rows = read_metrics(cfg.run_dir)
                xs = [m["step"] for m in rows if key in m]
                ax.plot(
                    xs,
                    [m[key] for m in rows if key in m],
                    label=run.name,
                    marker="." if len(xs) < 20 else None,
                )
            ax.set_title(title)
            ax.set_xlabel("update")
            if key in ("is_weight/peak_over_median", "train/grad_norm", "mismatch/k3"):
                ax.set_yscale("symlog", linthresh=1e-6)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        png = out / "study.png"
        fig.savefig(png, dpi=80)
        plt.close(fig)
    except ImportError:
        pass
    lines = [
        f"# parity study ({study.task} task, seeds {study.seeds})",
        "",
        f"Computed from the runs' metrics.jsonl by `parity study`; {results['seconds']:.0f} s in all.",
        "",
        table_markdown(results),
        "",
    ]
    if png is not None:
        lines += [f"![curves (seed {study.seeds[0]})](study.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
