"""`parity study`: the published comparisons as a grid of training runs, and one report.

The default grid (every run from the same base policy, task, seeds and budget; bfloat16 on both
sides with float32 master weights, as the published runs):

    | run               | kernels  | lag | staleness | objective                     |
    | sync              | aligned  | 0   | -         | reinforce_zero                |
    | async-8           | aligned  | 8   | natural   | reinforce_zero                |
    | fixed-64          | aligned  | 64  | fixed     | reinforce_zero                |
    | std-fixed-64      | standard | 64  | fixed     | reinforce_zero (unclipped IS) |
    | std-fixed-64-tis  | standard | 64  | fixed     | tis                           |
    | fixed-64-tis      | aligned  | 64  | fixed     | tis (truncation without kernels) |
    | std-fixed-64-gate | standard | 64  | fixed     | seq_gate                      |
    | fixed-64-fp32, std-fixed-64-fp32: the same in float32, shorter (the mechanism by dtype) |

"natural" staleness is whatever lag asynchronous training reaches on this machine (at most the
bound); "fixed" samples every batch after warm-up with weights exactly `lag` versions old
(deterministic mode: generation running `lag` batches ahead, as on separate hardware).

Runs execute one after another (each is a normal `parity train` run with its own directory).
The table is computed from the runs' `metrics.jsonl` files with the definitions the published
results use (`metrics.summary.row_figures`); `results.json`, `report.md` and `study.png` are
written beside them. Nothing in the report is typed by hand.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import hardware
from ..config import (
    LOSS_NAMES,
    TASK_NAMES,
    TrainConfig,
    config_from_dict,
    read_toml,
    set_dotted,
    with_overrides,
)
from ..dtypes import DTYPE_NAMES
from ..errors import CheckpointError, ConfigError, ParityError
from ..metrics.report import write_report, write_study_report
from ..metrics.sinks import read_metrics
from ..metrics.summary import aggregate, row_figures, step_line, study_table_markdown
from ..ops import check_backend
from ..ops.common import gemm_linear
from ..rl import checkpoint
from ..rl.controller import Controller
from .sft import RECIPES, base_dir, is_built, resolve_base, train_sft
from .ui import Progress

log = logging.getLogger(__name__)


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
    staleness: str = "natural"
    """'natural': the lag is whatever this machine produces, up to `lag` (asynchronous training);
    'fixed': every batch after warm-up is sampled by weights exactly `lag` versions old (the
    worker always runs `lag` batches ahead: generation on separate hardware)."""
    dtype: str | None = None
    """Compute dtype of this row (None: the study's `model.dtype`)."""
    steps: int | None = None
    """Learner steps of this row (None: the study's `steps`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"study runs: name must be a non-empty string, got {self.name!r}")
        if not re.fullmatch(r"[\w+-][\w.+-]*", self.name):  # it names a folder inside --out
            raise ConfigError(f"study runs: name {self.name!r} must be letters, digits and . _ + - "
                              "(not starting with '.'): it names the run's folder inside --out")
        check_backend(self.kernels, f"study run {self.name!r}: kernels")
        if self.staleness not in ("natural", "fixed"):
            raise ConfigError(f"study run {self.name!r}: staleness must be 'natural' or 'fixed', "
                              f"got {self.staleness!r}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"study run {self.name!r}: dtype must be one of {', '.join(DTYPE_NAMES)}")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise ConfigError(f"study run {self.name!r}: steps must be a positive integer")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0:
            raise ConfigError(f"study run {self.name!r}: lag must be an integer >= 0, got {self.lag!r}")
        if self.loss not in LOSS_NAMES:
            raise ConfigError(f"study run {self.name!r}: unknown loss {self.loss!r}")


DEFAULT_GRID = [
    StudyRun("sync", "aligned", 0),
    StudyRun("async-8", "aligned", 8),
    StudyRun("fixed-64", "aligned", 64, staleness="fixed"),
    StudyRun("std-fixed-64", "standard", 64, staleness="fixed"),
    StudyRun("std-fixed-64-tis", "standard", 64, "tis", staleness="fixed"),
    # TIS on aligned kernels: what truncation does at this lag with no kernel mismatch to correct
    StudyRun("fixed-64-tis", "aligned", 64, "tis", staleness="fixed"),
    StudyRun("std-fixed-64-gate", "standard", 64, "seq_gate", staleness="fixed"),
    # the mechanism in float32, for comparison with bfloat16 (shorter runs)
    StudyRun("fixed-64-fp32", "aligned", 64, staleness="fixed", dtype="float32", steps=100),
    StudyRun("std-fixed-64-fp32", "standard", 64, staleness="fixed", dtype="float32", steps=100),
]


@dataclass
class StudyConfig:
    """A study: the grid, the seeds, and the training config every run shares."""

    out_dir: str = "runs/study"
    """Where runs, results.json, report.md and study.png go."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds (prompts, sampling); every run is repeated per seed."""
    task: str = "tool"
    """'tool', 'math', or any task.name (your own: 'dataset' or 'custom', with its task.* keys in
    the [train] table)."""
    runs: list[StudyRun] = field(default_factory=lambda: list(DEFAULT_GRID))
    """The grid."""
    train: dict[str, Any] = field(default_factory=dict)
    """Training config keys shared by every run (the [train] table; dotted keys allowed)."""
    quick: bool = False
    """Smoke-sized: tiny runs from a base policy of a few SFT steps built in out_dir (CI)."""

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, str) or not self.out_dir.strip():
            raise ConfigError(f"study.out_dir must be a directory path, got {self.out_dir!r}")
        if not isinstance(self.seeds, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.seeds):
            raise ConfigError(f"study.seeds must be a list of integers >= 0, got {self.seeds!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"study.seeds must be non-empty and without repeats, got {self.seeds!r}")
        if self.task not in TASK_NAMES:
            raise ConfigError(f"study.task must be one of {', '.join(TASK_NAMES)}, got {self.task!r}")
        names = [r.name for r in self.runs]
        if not names or len(set(names)) != len(names):
            raise ConfigError("study.runs must be non-empty with unique names")


DEFAULT_TRAIN = {
    "steps": 350,
    "eval_every": 175,
    "eval_prompts": 100,
    "model.checkpoint": "base",
    "model.dtype": "bfloat16",
    "rollout.prompts_per_step": 6,
    "rollout.group_size": 4,
    "rollout.max_tokens": 48,
    "learner.lr": 5e-5,
    "learner.micro_batch_size": 12,
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
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise ConfigError("study runs: expected [[runs]] tables, each with a name")
        fields = {f.name for f in dataclasses.fields(StudyRun)}
        for i, r in enumerate(runs, 1):
            if "name" not in r:
                raise ConfigError(f"study runs: [[runs]] table {i} has no name")
            if set(r) - fields:
                raise ConfigError(f"study runs: {r['name']}: unknown key {sorted(set(r) - fields)[0]} "
                                  f"(known: {', '.join(sorted(fields))})")
        runs = [StudyRun(**r) for r in runs]
    if not isinstance(out_dir or data.get("out_dir", "runs/study"), str):  # (--quick makes a Path of it)
        raise ConfigError(f"study.out_dir must be a directory path, got {data['out_dir']!r}")
    if not isinstance(data.get("train", {}), dict):
        raise ConfigError(f"study train: expected a [train] table of config keys, got {data['train']!r}")
    train = {**DEFAULT_TRAIN, **data.get("train", {})}
    if quick:
        train.update(QUICK_TRAIN)
        if train.get("model.checkpoint") == "base":  # a smoke base of the task's own recipe
            name = "quick-base-math" if (task or data.get("task", "tool")) == "math" else "quick-base"
            train["model.checkpoint"] = str(Path(out_dir or data.get("out_dir", "runs/study")) / name)
    cfg = StudyConfig(quick=quick,
        out_dir=out_dir or data.get("out_dir", "runs/study"),
        seeds=seeds or ([0] if quick else data.get("seeds", [0, 1, 2])),
        task=task or data.get("task", "tool"),
        train=train,
        **({"runs": runs} if runs is not None else {}),
    )
    # every run's config must build before the first starts (--quick: before its base, as if built)
    check = replace(cfg, train={**train, "model.checkpoint": "base"}) if quick else cfg
    for run in cfg.runs:
        try:
            run_config(check, run, cfg.seeds[0])
        except ConfigError as exc:
            raise ConfigError(f"study run {run.name}: {exc} (a study sets training keys in its file's "
                              f"[train] table, dotted, e.g. \"task.data\" = \"x.jsonl\")") from None
    return cfg


def run_config(study: StudyConfig, run: StudyRun, seed: int) -> TrainConfig:
    """The TrainConfig of one grid cell."""
    data: dict[str, Any] = {}
    for key, value in study.train.items():
        set_dotted(data, key, value)
    for key, value in {
        "max_policy_lag": run.lag,
        "deterministic": run.staleness == "fixed",
        "seed": seed,
        "run_dir": str(Path(study.out_dir) / f"{run.name}-seed{seed}"),
        "model.kernels": run.kernels,
        "learner.loss": run.loss,
        "learner.mechanism": True,
        "task.name": study.task,
        **({"model.dtype": run.dtype} if run.dtype else {}),
        **({"steps": run.steps} if run.steps and not study.quick else {}),
    }.items():
        set_dotted(data, key, value)
    if study.task == "math" and data.get("model", {}).get("checkpoint") == "base":
        data["model"]["checkpoint"] = "base-math"  # the base that learned column-sum addition
    return config_from_dict(data)


# --------------------------------------------------------------------------- running
def _restart(cfg: TrainConfig) -> dict:
    """How an unfinished run goes on: from its latest checkpoint when that is sound and short of
    the end, and the run has no report.md and wrote the very config it is asked for (an
    interrupted study continues where it stopped); else over from the start, its old checkpoints
    cleared (another study's run in the same directory, a --quick one say, is never continued)."""
    run_dir = Path(cfg.run_dir)
    earlier = checkpoint.found(run_dir)
    written = run_dir / "config.toml"
    same = _wrote(written, cfg)
    if earlier and same and not (run_dir / "report.md").exists() \
            and int(earlier[-1].name.split("-")[1]) < cfg.steps:
        try:
            checkpoint.verify(earlier[-1])
            return {"resume": True}
        except CheckpointError as exc:
            log.warning("%s; starting the run over", exc)
    return {"overwrite": True}


def code_version() -> str:
    """Which code ran: the git commit of the checkout parity runs from (saying so when the package
    has uncommitted changes), else the package version."""
    import subprocess

    from .. import __version__

    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "parity"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return f"parity {__version__}"
    if rev.returncode != 0:
        return f"parity {__version__}"
    return f"commit {rev.stdout.strip()}" + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _finished(cfg: TrainConfig) -> bool:
    """Whether the run in cfg.run_dir is this very run, finished: its report.md written, every step
    recorded, and its config.toml the one asked for (the base policy named by its directory, as the
    run wrote it). A run of another study in the same directory (other settings, the other task)
    is not this one's, and runs again."""
    run_dir = Path(cfg.run_dir)
    name = cfg.model.checkpoint
    if name in RECIPES:
        cfg = with_overrides(cfg, {"model.checkpoint": str(base_dir(RECIPES[name]))})
    return (run_dir / "report.md").exists() and len(read_metrics(run_dir)) == cfg.steps \
        and _wrote(run_dir / "config.toml", cfg)


def _wrote(written: Path, cfg: TrainConfig) -> bool:
    """Whether the config.toml at `written` is `cfg`, read as a config (its text changes when a
    newer parity adds a field: a run written before would have looked like another run's)."""
    try:
        return written.exists() and config_from_dict(read_toml(written)) == cfg
    except ParityError:
        return False


def _train(cfg: TrainConfig, name: str, progress: bool) -> None:
    bar = Progress(name, cfg.steps, every=max(1, cfg.steps // 4)) if progress else None
    try:
        Controller(cfg, **_restart(cfg)).run(
            progress=(lambda step, m: bar.update(step, step_line(m))) if bar else None)
    finally:
        if bar is not None:
            bar.close()
    write_report(cfg.run_dir)  # the run's own report.md: also what marks it finished


def run_study(study: StudyConfig, progress: bool = True, train: bool = True) -> dict:
    """Run every grid cell (skipping ones already finished in out_dir) and write the report.
    With `train=False` nothing is trained: the report covers the finished runs only (a row's
    figures are over its finished seeds; rows with none are left out)."""
    out = Path(study.out_dir)
    if out.exists() and not out.is_dir():
        raise ParityError(f"{out} exists and is not a directory: choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ParityError(f"{out} cannot be written: {exc.strerror or exc}; choose another --out") from None
    if study.quick and train:
        quick_base = Path(study.train.get("model.checkpoint", out / "quick-base"))
        if not is_built(quick_base):
            log.info("--quick: building a smoke base policy (10 SFT steps) in %s", quick_base)
            recipe = RECIPES["base-math" if study.task == "math" else "base"]
            train_sft(quick_base, dataclasses.replace(recipe, steps=10, batch_size=8, warmup_steps=2),
                      eval_problems=0)
        for run in study.runs:
            run_config(study, run, study.seeds[0])
    t0 = time.perf_counter()
    results: dict[str, Any] = {"config": asdict(study), "machine": hardware.describe(),
                               "code": code_version(), "runs": {}}
    total = len(study.runs) * len(study.seeds)
    k = 0
    figures: dict[str, list[dict[str, float]]] = {run.name: [] for run in study.runs}
    seeds_done: dict[str, list[int]] = {run.name: [] for run in study.runs}
    for seed in study.seeds:  # seed-major: a study cut short still has every row
        for run in study.runs:
            k += 1
            cfg = run_config(study, run, seed)
            if _finished(cfg):
                log.info("[%d/%d] %s seed %d: already done (%s)", k, total, run.name, seed, cfg.run_dir)
            elif not train:
                continue
            else:
                log.info("[%d/%d] %s seed %d: %s kernels, lag %d, %s", k, total, run.name, seed,
                         run.kernels, run.lag, run.loss)
                _train(resolve_base(cfg), f"{run.name}/{seed}", progress)
            figures[run.name].append(row_figures(read_metrics(cfg.run_dir)))
            seeds_done[run.name].append(seed)
    rows = [run for run in study.runs if figures[run.name]]
    if not rows:
        raise ParityError(f"{out}: no finished study runs to report on")
    for run in rows:
        results["runs"][run.name] = {"run": asdict(run), "seeds": seeds_done[run.name],
                                     "figures": aggregate(figures[run.name])}
    sync = results["runs"].get("sync")
    if sync:
        base = sync["figures"]["steps_per_hour"]["mean"]
        for r in results["runs"].values():
            r["figures"]["throughput_vs_sync"] = {
                "mean": r["figures"]["steps_per_hour"]["mean"] / base, "spread": float("nan"), "values": []}
    results["seconds"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    curves = {run.name: read_metrics(run_config(study, run, results["runs"][run.name]["seeds"][0]).run_dir)
              for run in rows}
    write_study_report(out, f"parity study ({study.task} task, seeds {study.seeds})", results, curves)
    return results


def main(args) -> int:
    """`parity study`."""
    study = load_study(args.config, quick=args.quick, task=args.task, seeds=args.seeds, out_dir=args.out)
    print(f"parity: study of {len(study.runs)} runs x {len(study.seeds)} seeds on the {study.task} task "
          f"-> {study.out_dir}", flush=True)
    dtypes = {run.dtype or study.train.get("model.dtype", "float32") for run in study.runs}
    warning = None if args.report_only or "bfloat16" not in dtypes else hardware.bf16_warning(
        "bfloat16", "the study's model.dtype", linear=gemm_linear)
    if warning:
        print(f"parity: warning: {warning}", file=sys.stderr, flush=True)
    results = run_study(study, train=not args.report_only)
    print(study_table_markdown(results))
    written = [name for name in ("report.md", "study.png", "mechanism.png", "results.json")
               if (Path(study.out_dir) / name).exists()]
    print(f"done in {results['seconds']:.0f} s: {study.out_dir}/{', '.join(written)}")
    return 0
