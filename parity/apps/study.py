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
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import hardware
from ..config import (
    TrainConfig,
    config_from_dict,
    read_toml,
    with_overrides,
)
from ..errors import CheckpointError, ParityError
from ..metrics.report import write_report, write_study_report
from ..metrics.sinks import read_metrics
from ..metrics.summary import aggregate, row_figures, step_line, study_table_markdown
from ..ops.common import gemm_linear
from ..rl import checkpoint
from ..rl.controller import Controller
from . import sft_child
from .sft import RECIPES, base_dir, is_built, resolve_base
from .study_grid import StudyConfig, load_study, run_config
from .ui import Progress

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- running
def _restart(cfg: TrainConfig) -> dict:
    """How an unfinished run goes on: from its latest checkpoint when that is sound and not past
    the end (at the end: a run stopped in its last step or final evaluation, which a resume
    finishes), and the run has no report.md and wrote the very config it is asked for (an
    interrupted study continues where it stopped); else over from the start, its old checkpoints
    cleared (another study's run in the same directory, a --quick one say, is never continued)."""
    run_dir = Path(cfg.run_dir)
    earlier = checkpoint.found(run_dir)
    written = run_dir / "config.toml"
    same = _wrote(written, cfg)
    if earlier and same and not (run_dir / "report.md").exists() \
            and int(earlier[-1].name.split("-")[1]) <= cfg.steps:  # (at the end: stopped before its report)
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
    run_dir, cfg = Path(cfg.run_dir), _as_written(cfg)
    return (run_dir / "report.md").exists() and len(read_metrics(run_dir)) == cfg.steps \
        and _wrote(run_dir / "config.toml", cfg)


def _as_written(cfg: TrainConfig) -> TrainConfig:
    """`cfg` as its run writes it to config.toml: a base policy named by its directory."""
    name = cfg.model.checkpoint
    return with_overrides(cfg, {"model.checkpoint": str(base_dir(RECIPES[name]))}) if name in RECIPES else cfg


def _other_runs(study: StudyConfig) -> list[str]:
    """The grid's run directories that hold a run of other settings (its config.toml another
    config: another study's, a --quick one's, the other task's), which training would replace."""
    cells = [run_config(study, run, seed) for seed in study.seeds for run in study.runs]
    return [c.run_dir for c in cells if (Path(c.run_dir) / "config.toml").exists()
            and not _wrote(Path(c.run_dir) / "config.toml", _as_written(c))]


def _wrote(written: Path, cfg: TrainConfig) -> bool:
    """Whether the config.toml at `written` is `cfg`, read as a config (its text changes when a
    newer parity adds a field: a run written before would have looked like another run's)."""
    try:
        return written.exists() and _resolved(config_from_dict(read_toml(written))) == _resolved(cfg)
    except ParityError:
        return False


def _resolved(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its run directory and starting checkpoint as absolute paths: `--out out` and
    `--out /abs/out` are one study (the second was refused as another config's runs)."""
    over = {"run_dir": str(Path(cfg.run_dir).resolve())}
    if cfg.model.checkpoint and cfg.model.checkpoint not in RECIPES and Path(cfg.model.checkpoint).exists():
        over["model.checkpoint"] = str(Path(cfg.model.checkpoint).resolve())
    return with_overrides(cfg, over)


def _train(cfg: TrainConfig, name: str, progress: bool) -> None:
    bar = Progress(name, cfg.steps, every=max(1, cfg.steps // 4)) if progress else None
    try:
        Controller(cfg, **_restart(cfg)).run(
            progress=(lambda step, m: bar.update(step, step_line(m))) if bar else None)
    finally:
        if bar is not None:
            bar.close()
    write_report(cfg.run_dir)  # the run's own report.md: also what marks it finished


def run_study(study: StudyConfig, progress: bool = True, train: bool = True, overwrite: bool = False) -> dict:
    """Run every grid cell (skipping ones already finished in out_dir) and write the report.
    With `train=False` nothing is trained: the report covers the finished runs only (a row's
    figures are over its finished seeds; rows with none are left out). A cell whose directory
    holds a run of other settings is refused before anything trains, unless `overwrite` (a
    --quick study into a full one's directory replaced its finished runs without a word)."""
    out = Path(study.out_dir)
    if out.exists() and not out.is_dir():
        raise ParityError(f"{out} exists and is not a directory: choose another --out")
    if not train and not out.exists():  # (a report of nothing made the directory first)
        raise ParityError(f"{out}: no such directory, so no finished study runs to report on")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ParityError(f"{out} cannot be written: {exc.strerror or exc}; choose another --out") from None
    other = _other_runs(study) if train and not overwrite else []
    if other:
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        raise ParityError(f"{other[0]}{more} holds a run of other settings (its config.toml differs): "
                          "choose another --out, or --overwrite to train those runs again")
    if study.quick and train:
        quick_base = Path(study.train.get("model.checkpoint", out / "quick-base"))
        if not is_built(quick_base):
            log.info("--quick: building a smoke base policy (10 SFT steps) in %s", quick_base)
            recipe = RECIPES["base-math" if study.task == "math" else "base"]
            sft_child.build(quick_base, dataclasses.replace(recipe, steps=10, batch_size=8, warmup_steps=2),
                            eval_problems=0, progress_on_stderr=True)
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
    results = run_study(study, train=not args.report_only, overwrite=args.overwrite)
    print(study_table_markdown(results))
    written = [name for name in ("report.md", "study.png", "mechanism.png", "results.json")
               if (Path(study.out_dir) / name).exists()]
    print(f"done in {results['seconds']:.0f} s: {study.out_dir}/{', '.join(written)}")
    return 0
