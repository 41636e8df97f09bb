"""The study's grid and its configuration: one `StudyRun` per row, the `StudyConfig` a study
file describes (`load_study`), and `run_config`, the training config of one cell (row x seed).
`parity study` (apps/study.py) runs the cells and writes the report.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import (
    LOSS_NAMES,
    TASK_NAMES,
    TrainConfig,
    config_from_dict,
    read_toml,
    set_dotted,
)
from ..dtypes import DTYPE_NAMES
from ..errors import ConfigError
from ..ops import check_backend

ROW_KEYS = {"max_policy_lag": "the row's lag", "deterministic": "the row's staleness",
            "seed": "the study's seeds (--seeds)", "run_dir": "the row's name and the study's out_dir",
            "model.kernels": "the row's kernels", "learner.loss": "the row's loss",
            "learner.mechanism": "the study (always on)", "task.name": "the study's task",
            "model.dtype": "the row's dtype", "steps": "the row's steps"}
"""Training keys every row sets from the study's fields and its own (key -> where it comes from),
so a row's `train` may not, nor the study's [train] table (bar model.dtype and steps: the default
of rows that do not set their own)."""


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
    train: dict[str, Any] = field(default_factory=dict)
    """Training keys of this row alone, dotted, over the study's [train] table (an objective's
    parameters, say: "learner.loss_config.ppo_eps_high" = 0.28); not the keys the fields above set."""

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
        if not isinstance(self.train, dict) or not all(isinstance(k, str) for k in self.train):
            raise ConfigError(f"study run {self.name!r}: train must be a table of training keys, "
                              f"got {self.train!r}")
        if taken := sorted(set(self.train) & set(ROW_KEYS)):
            raise ConfigError(f"study run {self.name!r}: train sets {taken[0]}, which comes from "
                              f"{ROW_KEYS[taken[0]]}")


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
    where = os.path.expanduser(out_dir or data.get("out_dir", "runs/study"))  # (~ was a directory named ~)
    if not isinstance(data.get("train", {}), dict):
        raise ConfigError(f"study train: expected a [train] table of config keys, got {data['train']!r}")
    shared = data.get("train", {})
    if taken := sorted(set(shared) & (set(ROW_KEYS) - {"model.dtype", "steps"})):  # (set, then replaced)
        raise ConfigError(f"study [train] sets {taken[0]}, which every row sets from "
                          f"{ROW_KEYS[taken[0]]}: set it there")
    train = {**DEFAULT_TRAIN, **shared}
    if quick:
        train.update(QUICK_TRAIN)
        if train.get("model.checkpoint") == "base":  # a smoke base of the task's own recipe
            name = "quick-base-math" if (task or data.get("task", "tool")) == "math" else "quick-base"
            train["model.checkpoint"] = str(Path(where) / name)
    cfg = StudyConfig(quick=quick,
        out_dir=where,
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
    for key, value in {**study.train, **run.train}.items():
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
