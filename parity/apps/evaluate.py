"""`parity eval`: held-out greedy pass@1 and mean@k (95% CIs) of a checkpoint on a task."""

from __future__ import annotations

import json
import sys
import time

from ..config import config_from_dict
from ..config.loading import parse_override, read_toml, set_dotted
from ..engine.sequence import SamplingParams
from ..errors import ConfigError
from ..metrics.summary import pass_at_1_text
from ..model import load_model
from ..rl.build import build_env
from ..rl.evaluate import evaluate
from .sft import resolve_base
from .ui import table


def main(args) -> int:
    for item in args.set or []:  # (training keys were accepted and ignored; `level=7` read as unknown)
        key = parse_override(item)[0]
        if not key.startswith(("task.", "model.")):
            raise ConfigError(f"--set {key}: eval takes task.* and model.* keys only (task.{key} for "
                              "the task's; --n, --temperature, --max-tokens for sampling)")
    if args.k:  # checked before the greedy pass, whose result a bad temperature threw away
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    task = dict(read_toml(args.config).get("task", {})) if args.config else {}
    if not isinstance(task, dict):
        raise ConfigError(f"{args.config}: [task] must be a table")
    if args.task or not task:
        task = {"name": args.task or "tool"} if args.task != task.get("name") else task
    task.update({**({"level": args.level} if args.level else {}),
                 **({"math_task": args.math_task} if args.math_task else {})})
    data = {"task": task, "model": {"checkpoint": args.model, "kernels": args.kernels},
            "eval_prompts": args.n}
    for item in args.set or []:  # with --n in one step (--set task.heldout_size=300 --n 300 is valid)
        set_dotted(data, *parse_override(item))
    cfg = resolve_base(config_from_dict(data))
    model = load_model(cfg.model.checkpoint, kernels=cfg.model.kernels)
    env = build_env(cfg, model.config.vocab_size)
    print(f"parity: {env.describe()}", file=sys.stderr if args.json else sys.stdout, flush=True)
    t0 = time.perf_counter()
    r = evaluate(model, env, args.n, k=args.k, temperature=args.temperature, max_tokens=args.max_tokens,
                 seed=args.seed)
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [["pass@1 (greedy)", pass_at_1_text(r)]]
    if args.k:
        rows.append([f"mean@{args.k} (T={args.temperature})",
                     f"{r[f'eval/mean@{args.k}']:.1%} ± {r[f'eval/mean@{args.k}_ci95']:.1%}"])
    rows += [["problems", f"{r['eval/problems']:.0f}"], ["answered", f"{r['eval/answered']:.1%}"],
             ["tool calls / episode", f"{r['eval/tool_calls']:.2f}"],
             ["tool errors / episode", f"{r['eval/tool_errors']:.2f}"]]
    print(table([f"{env.name} (held-out, 95% CI)", "value"], rows))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0
