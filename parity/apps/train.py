"""`parity train`: one RL run from a TOML config (or defaults) with `--set` overrides, or
`--resume RUN_DIR` from its latest checkpoint. Progress per step; a summary table at the end."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import hardware
from ..config import load_config
from ..config.loading import parse_override
from ..errors import ParityError
from ..metrics.report import write_report
from ..metrics.summary import run_rows, step_line
from ..ops.common import gemm_linear
from ..rl.controller import Controller, Interrupted
from .heldout import check_unseen
from .sft import resolve_base
from .ui import Progress, table

RESUMABLE_MODEL_KEYS = ("model.device", "model.kernels")
"""The model fields a resumed run may change (`--set`); the rest are the checkpoint's."""


def main(args) -> int:
    if args.resume:
        if args.config or args.overwrite:
            raise ParityError("give either a config (or --overwrite) or --resume RUN_DIR, not both")
        overrides = dict(parse_override(o) for o in args.set or [])
        fixed = sorted(k for k in overrides if k.startswith("model.") and k not in RESUMABLE_MODEL_KEYS)
        if fixed:
            raise ParityError(f"--resume: {fixed[0]} is fixed by the checkpoint; only "
                              f"{', '.join(RESUMABLE_MODEL_KEYS)} of the model can change on resume")
        here = Path(args.resume).resolve()
        if "run_dir" in overrides and Path(str(overrides["run_dir"])).resolve() != here:  # (was ignored)
            raise ParityError(f"--resume: run_dir is fixed: a run continues in its own directory, "
                              f"{args.resume}")
        if not (Path(args.resume) / "config.toml").is_file():  # (was "RUN/config.toml: no such config file")
            raise ParityError(f"--resume {args.resume}: no run there (a run directory holds config.toml)")
        cfg = load_config(Path(args.resume) / "config.toml", {**overrides, "run_dir": args.resume})
        controller = Controller(resolve_base(cfg), resume=True)
    else:
        cfg = resolve_base(load_config(args.config, args.set or []))
        check_unseen(cfg)
        controller = Controller(cfg, overwrite=args.overwrite)
    warning = None if cfg.model.device.startswith("cuda") else \
        hardware.bf16_warning(cfg.model.dtype, linear=gemm_linear)  # (a CPU's figure, not a GPU's)
    if warning:
        print(f"parity: warning: {warning}", file=sys.stderr, flush=True)
    print(f"parity: {controller.task_description}", flush=True)
    bar = Progress("step", cfg.steps, completed=controller.start_step, text="starting the rollout worker")
    try:
        metrics = controller.run(progress=lambda step, m: bar.update(step, step_line(m, timing=True)))
    except Interrupted as stop:
        print(f"parity: interrupted ({stop.signal_name}); checkpoint saved to {stop.path} "
              f"(continue with: parity train --resume {cfg.run_dir})", file=sys.stderr)
        return 143 if stop.signal_name == "SIGTERM" else 130
    finally:
        bar.close()
    write_report(cfg.run_dir)
    print(table(["figure", "value"], [list(r) for r in run_rows(metrics)]))
    print(f"done: {cfg.run_dir}/metrics.jsonl, report.md, report.png, checkpoint-{cfg.steps}/")
    return 0
