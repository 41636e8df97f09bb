"""`parity eval`: held-out greedy pass@1 and mean@k (95% CIs) of a checkpoint on a task."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from ..config import config_from_dict
from ..config.loading import parse_override, read_toml, set_dotted
from ..engine.sequence import SamplingParams
from ..errors import CheckpointError, ConfigError
from ..metrics.summary import pass_at_1_text
from ..model import load_model
from ..rl import checkpoint
from ..rl.build import build_env
from ..rl.evaluate import evaluate
from .heldout import check_unseen
from .sft import resolve_base
from .ui import table


def _newest(run, config: Path, names_run_dir: bool) -> str:
    """The newest checkpoint of the run whose config.toml `config` is (beside it, or in the run_dir
    it names: not the default one, which may hold anyone's run) that is intact, else the checkpoint it
    started from."""
    saved = checkpoint.found(config.parent) or (checkpoint.found(Path(run.run_dir)) if names_run_dir else [])
    problems = []
    for path in reversed(saved):  # the newest intact one, as a resume takes
        try:
            checkpoint.verify(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            print(f"parity: warning: {problems[0]}; evaluating the older {path.name}", file=sys.stderr,
                  flush=True)
        return str(path)
    if problems:
        raise CheckpointError(f"{problems[0]} (no older checkpoint of this run is intact)")
    if not run.model.checkpoint:
        raise ConfigError(f"{config}: no checkpoint beside it or in {run.run_dir}, and its model was a "
                          "random preset: name one with --model")
    return run.model.checkpoint


def main(args) -> int:
    for item in args.set or []:  # (training keys were accepted and ignored; `level=7` read as unknown)
        key = parse_override(item)[0]
        if key in ("model.checkpoint", "model.kernels", "model.preset"):  # (won over --model, or unused)
            raise ConfigError(f"--set {key}: eval takes the model from --model (or the run's config) and "
                              "its kernels from --kernels")
        if not key.startswith(("task.", "model.")):
            hint = f"task.{key} for the task's; " if "." not in key else ""  # (task.learner.lr was offered)
            raise ConfigError(f"--set {key}: eval takes task.* and model.* keys only ({hint}--n, "
                              "--temperature, --max-tokens for sampling)")
    if args.k:  # checked before the greedy pass, whose result a bad temperature threw away
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    run = config_from_dict(read_toml(args.config)) if args.config else None  # a run's whole config
    task = dataclasses.asdict(run.task) if run else {}
    if args.task and args.task != task.get("name"):
        task = {"name": args.task}
    if args.model:  # another checkpoint than the run's: its own tokenizer, not the one the run kept
        task.pop("tokenizer", None)
    task = {"name": "tool", **task, **({"level": args.level} if args.level is not None else {}),
            **({"math_task": args.math_task} if args.math_task else {})}
    if args.math_task and task["name"] != "math":  # (its default value would pass the task's check)
        raise ConfigError(f"--math-task is for --task math (this task is {task['name']!r})")
    where = args.model or ("base" if run is None else _newest(run, Path(args.config),
                                                              "run_dir" in read_toml(args.config)))
    data = {"task": task, "model": {"checkpoint": where, "kernels": args.kernels}, "eval_prompts": 1}
    for item in args.set or []:
        set_dotted(data, *parse_override(item))
    data["eval_prompts"] = args.n if args.n is not None else data["task"].get("heldout_size", 200)
    cfg = resolve_base(config_from_dict(data))
    check_unseen(cfg)
    if not args.model and args.config:
        print(f"parity: evaluating {cfg.model.checkpoint}", file=sys.stderr if args.json else sys.stdout)
    model = load_model(cfg.model.checkpoint, kernels=cfg.model.kernels, context=cfg.model.context)
    env = build_env(cfg, model.config.vocab_size)
    print(f"parity: {env.describe()}", file=sys.stderr if args.json else sys.stdout, flush=True)
    t0 = time.perf_counter()
    # args.n None: the whole held-out set (a heldout_data file's too)
    r = evaluate(model, env, args.n, k=args.k, temperature=args.temperature, max_tokens=args.max_tokens,
                 seed=args.seed)
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [["pass@1 (greedy)", pass_at_1_text(r)]]
    if args.k:
        rows.append([f"mean@{args.k} (T={args.temperature})",
                     f"{r[f'eval/mean@{args.k}']:.1%} (95% CI {r[f'eval/mean@{args.k}_lo95']:.1%}-"
                     f"{r[f'eval/mean@{args.k}_hi95']:.1%})"])
    rows += [["problems", f"{r['eval/problems']:.0f}"], ["answered", f"{r['eval/answered']:.1%}"],
             ["tool calls / episode", f"{r['eval/tool_calls']:.2f}"],
             ["tool errors / episode", f"{r['eval/tool_errors']:.2f}"]]
    rows += [[k.removeprefix("eval/"), f"{v:.4g}"] for k, v in r.items()  # the task's own figures
             if k.removeprefix("eval/") not in ("problems", "answered", "tool_calls", "tool_errors")
             and not k.startswith(("eval/pass@1", "eval/mean@"))]
    print(table([f"{env.name} (held-out, 95% CI)", "value"], rows))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0
