"""The `parity` command: `demo`, `check` (invariance self-test), `sft`, `eval`, `train`, `generate`, `bench`.

Every user-facing failure (bad config, checkpoint, option) is printed as one line
`parity: error: ...` with exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from .errors import ParityError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _csv(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def _dtypes(names: list[str]) -> list[str]:
    if not names:
        raise ParityError("no dtype given: expected float32 and/or bfloat16")
    for n in names:
        if n not in _DTYPES:
            raise ParityError(f"unknown dtype {n!r}: expected float32 or bfloat16")
    return names


def _status(msg: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    return "\n".join(lines + [fmt.format(*r) for r in rows])


# ----------------------------------------------------------------------------- check
def cmd_check(args) -> int:
    from .check import CASES, run_checks
    from .model import Model, ModelConfig, load_model
    from .ops import native

    cases = args.cases or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ParityError(f"unknown check case {unknown[0]!r}: expected some of {', '.join(CASES)}")
    results, models = [], []
    for dtype_name in _dtypes(args.dtype):
        for kernels in ("aligned", "standard"):
            if args.model:
                model = load_model(args.model, kernels=kernels, dtype=_DTYPES[dtype_name])
                label = args.model
            else:
                model = Model(ModelConfig.preset(args.preset), kernels=kernels,
                              dtype=_DTYPES[dtype_name], seed=args.seed)
                label = f"preset {args.preset}"
            models.append(label)
            t0 = time.perf_counter()
            for r in run_checks(model, rounds=args.rounds, seed=args.seed, max_len=args.max_len,
                                cases=cases, progress=lambda m, k=kernels, d=dtype_name: _status(
                                    f"check {k} {d}: {m}")):
                results.append({"dtype": dtype_name, **r.as_dict(),
                                "seconds": round(time.perf_counter() - t0, 2)})
    _status("")
    aligned_bad = sum(r["mismatches"] for r in results if r["kernels"] == "aligned")
    if args.json:
        print(json.dumps({"model": models[0], "threads": torch.get_num_threads(),
                          "aligned_implementation": native.describe(),
                          "torch": torch.__version__, "passed": aligned_bad == 0,
                          "results": results}, indent=2))
    else:
        print(f"parity check: {models[0]}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {args.rounds} rounds per case; "
              f"aligned kernels: {native.describe()}")
        rows = [[r["case"], r["kernels"], r["dtype"], str(r["comparisons"]), str(r["mismatches"]),
                 f"{r['max_abs_diff']:.3g}"] for r in results]
        print(_table(["case", "kernels", "dtype", "comparisons", "mismatches", "max |Δ|"], rows))
        total = sum(r["comparisons"] for r in results if r["kernels"] == "aligned")
        std_bad = sum(r["mismatches"] for r in results if r["kernels"] == "standard")
        verdict = "PASS" if aligned_bad == 0 else "FAIL"
        print(f"{verdict}: aligned kernels {aligned_bad} mismatches in {total} comparisons; "
              f"standard kernels {std_bad} mismatches (the gap parity removes)")
    return 0 if aligned_bad == 0 else 1


# ----------------------------------------------------------------------------- bench
def cmd_bench_kernels(args) -> int:
    from .bench import bench_kernels
    from .model import ModelConfig

    for p in args.presets:
        limit = ModelConfig.preset(p).max_position_embeddings
        if args.prefill_len > limit or 32 + args.decode_steps > limit:
            raise ParityError(f"--prefill-len / --decode-steps exceed preset {p}'s "
                              f"max_position_embeddings={limit}")
    if not args.batches or any(b <= 0 for b in args.batches):
        raise ParityError("--batches must be positive integers")
    rows = bench_kernels(presets=args.presets, dtypes=_dtypes(args.dtypes), batches=args.batches,
                         prefill_len=args.prefill_len, decode_steps=args.decode_steps, reps=args.reps,
                         progress=lambda m: _status(f"bench kernels: {m}"))
    _status("")
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                          "rows": [r.as_dict() for r in rows]}, indent=2))
        return 0
    print(f"parity bench kernels: medians of {args.reps} interleaved repetitions, "
          f"{torch.get_num_threads()} threads; prefill {args.prefill_len} tokens/seq, "
          f"decode {args.decode_steps} steps")
    table = [[r.preset, r.dtype, r.phase, str(r.batch), f"{r.aligned_tok_s:,.0f}",
              f"{r.standard_tok_s:,.0f}", f"{r.ratio:.3f}"] for r in rows]
    print(_table(["preset", "dtype", "phase", "batch", "aligned tok/s", "standard tok/s",
                  "aligned/standard"], table))
    return 0


def cmd_bench_rollout(args) -> int:
    from .bench import bench_rollout
    from .model import ModelConfig

    limit = ModelConfig.preset(args.preset).max_position_embeddings
    if not args.mean_len >= 1:
        raise ParityError("--mean-len must be at least 1")
    if args.max_len + 64 > limit:
        raise ParityError(f"--max-len {args.max_len} plus 64 prompt tokens exceeds preset "
                          f"{args.preset}'s max_position_embeddings={limit}")
    if args.vs_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ParityError("--vs-transformers needs the transformers package "
                              "(pip install transformers)") from None
    rows, ratios = bench_rollout(args.preset, _dtypes(args.dtypes), args.num_seqs, args.max_num_seqs,
                                 args.mean_len, args.max_len, args.reps, args.vs_transformers,
                                 progress=lambda m: _status(f"bench rollout: {m}"))
    _status("")
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"threads": torch.get_num_threads(), "rows": [asdict(r) for r in rows],
                          "ratios": ratios}, indent=2))
        return 0
    print(f"parity bench rollout: {args.preset}, {args.num_seqs} requests, geometric response lengths "
          f"(mean {args.mean_len}, max {args.max_len}), max_num_seqs {args.max_num_seqs}, "
          f"medians of {args.reps} rounds")

    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    print(_table(["system", "dtype", "output tokens", "tok/s", "step p50 ms", "p90", "p99"],
                 [[r.system, r.dtype, str(r.output_tokens), f"{r.tok_s:,.0f}", ms(r.step_ms_p50),
                   ms(r.step_ms_p90), ms(r.step_ms_p99)] for r in rows]))
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    return 0


def cmd_bench_async(args) -> int:
    from dataclasses import asdict

    from .bench import bench_async

    if args.steps < 2:
        raise ParityError("--steps must be at least 2 (the first step is start-up and not timed)")
    if any(lag < 1 for lag in args.lags):
        raise ParityError("--lags must be positive (lag 0, synchronous, always runs)")
    rows, ratios = bench_async(args.preset, args.steps, args.lags, args.prompts, args.group,
                               args.max_tokens, args.reps, _dtypes([args.dtype])[0],
                               progress=lambda m: _status(m))
    _status("")
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": [asdict(r) for r in rows],
                          "ratios": ratios}, indent=2))
        return 0
    print(f"parity bench async: {args.preset} {args.dtype}, {args.steps} learner steps of "
          f"{args.prompts}x{args.group} responses, geometric lengths up to {args.max_tokens} tokens; "
          f"steady state (first step excluded), median of {args.reps}")
    print(_table(["mode", "max lag", "steps/hour", "learner waits", "rollout waits", "lag seen"],
                 [[r.mode, str(r.max_policy_lag), f"{r.steps_per_hour:,.0f}",
                   f"{100 * r.learner_wait_frac:.0f}%", f"{100 * r.rollout_wait_frac:.0f}%",
                   f"{r.observed_lag_max:.0f}"] for r in rows]))
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    return 0


# ----------------------------------------------------------------------------- generate
def _read_prompts(args, tokenizer) -> list[list[int]]:
    prompts: list[list[int]] = []
    for text in args.prompt or []:
        prompts.append(tokenizer.encode(text))
    for ids in args.prompt_ids or []:
        try:
            prompts.append([int(x) for x in ids.split(",") if x.strip()])
        except ValueError:
            raise ParityError(f"--prompt-ids: expected comma-separated integers, got {ids!r}") from None
    if args.prompts_file:
        try:
            lines = open(args.prompts_file, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise ParityError(f"{args.prompts_file}: {exc.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ParityError(f"{args.prompts_file}:{n}: invalid JSON ({exc.msg})") from None
                ids = item.get("prompt_ids") if isinstance(item, dict) else None
                if not isinstance(item, dict):
                    raise ParityError(f"{args.prompts_file}:{n}: expected a JSON object")
                if "prompt_ids" in item:
                    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                        raise ParityError(f"{args.prompts_file}:{n}: prompt_ids must be a list of integers")
                    prompts.append(ids)
                elif "prompt" in item:
                    prompts.append(tokenizer.encode(str(item["prompt"])))
                else:
                    raise ParityError(f"{args.prompts_file}:{n}: expected a 'prompt' or 'prompt_ids' field")
            else:
                prompts.append(tokenizer.encode(line))
    if not prompts:
        raise ParityError("no prompts: give --prompt, --prompt-ids or --prompts-file")
    return prompts


def cmd_generate(args) -> int:
    from .engine import Engine, SamplingParams
    from .model import Model, ModelConfig, load_model
    from .model.tokenizer import load_tokenizer

    dtype = _DTYPES[_dtypes([args.dtype])[0]]
    if args.model:
        model = load_model(args.model, kernels=args.kernels, dtype=dtype)
    else:
        model = Model(ModelConfig.preset(args.preset), kernels=args.kernels, dtype=dtype, seed=args.seed)
    tokenizer = load_tokenizer(args.model, model.config.vocab_size)
    prompts = _read_prompts(args, tokenizer)
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed + i, stop_strings=args.stop or [])
              for i in range(len(prompts))]
    engine = Engine(model, max_num_seqs=args.max_num_seqs, tokenizer=tokenizer)
    outs = engine.generate(prompts, params)
    if args.json:
        print(json.dumps([{"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids,
                           "logprobs": o.logprobs, "sampled_logprobs": o.sampled_logprobs,
                           "policy_versions": o.policy_versions, "finish_reason": o.finish_reason,
                           "text": o.text, "error": o.error} for o in outs], indent=1))
    else:
        for i, o in enumerate(outs):
            if o.error:
                print(f"[{i}] error: {o.error}")
            else:
                print(f"[{i}] ({o.finish_reason}, {len(o.token_ids)} tokens) {o.text!r}")
    return 0 if all(o.error is None for o in outs) else 1


# ----------------------------------------------------------------------------- train
def cmd_train(args) -> int:
    from .config import load_config
    from .rl.controller import Controller, Interrupted

    if args.resume:
        if args.config:
            raise ParityError("give either a config or --resume RUN_DIR, not both")
        cfg = load_config(Path(args.resume) / "config.toml", args.set or [])
        cfg.run_dir = args.resume
        controller = Controller(cfg, resume=True)
    else:
        cfg = load_config(args.config, args.set or [])
        controller = Controller(cfg)

    print(f"parity: {controller.task_description}", flush=True)

    def describe(m) -> str:
        if m.get("train/skipped_nonfinite"):
            return "non-finite loss or gradient: update skipped"
        return (f"loss {m['train/loss']:+.4f}  reward {m['reward/mean']:.3f}  "
                f"lag max {m.get('lag/max', 0):.0f}  "
                f"w peak/median {m.get('is_weight/peak_over_median', 1):.3f}  "
                f"kernel mismatch {m.get('mismatch/kernel_max_abs', float('nan')):.3g}  "
                f"wait {m['time/wait_s']:.2f}s")

    bar = None
    if sys.stdout.isatty():  # a live bar on a terminal, one line per step otherwise (logs, CI)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                       TextColumn("{task.description}"))
        task = bar.add_task("starting the rollout worker", total=cfg.steps, completed=controller.start_step)

    def progress(step, m):
        if bar is not None:
            bar.update(task, completed=step + 1, description=describe(m))
        else:
            print(f"step {step + 1:>4}/{cfg.steps}  {describe(m)}", flush=True)

    try:
        if bar is not None:
            with bar:
                metrics = controller.run(progress=progress)
        else:
            metrics = controller.run(progress=progress)
    except Interrupted as stop:
        print(f"parity: interrupted; checkpoint saved to {stop.path} "
              f"(continue with: parity train --resume {cfg.run_dir})", file=sys.stderr)
        return 130
    from .metrics.report import summary_rows

    print(_table(["figure", "value"], [list(r) for r in summary_rows(metrics)]))
    print(f"done: {cfg.run_dir}/metrics.jsonl, report.md, report.png, checkpoint-{cfg.steps}/")
    return 0


# ----------------------------------------------------------------------------- sft / eval / demo
class _Progress:
    """A rich bar on a terminal, a line every `every` steps otherwise (logs, CI)."""

    def __init__(self, name: str, total: int, every: int = 10):
        self.name, self.total, self.every = name, total, every
        self.bar = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn(name), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                TextColumn("{task.description}"))
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def update(self, step: int, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, description=text)
            if step + 1 >= self.total:
                self.bar.stop()
        elif (step + 1) % self.every == 0 or step + 1 == self.total or step == 0:
            print(f"{self.name} {step + 1:>4}/{self.total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _describe_train(m) -> str:
    if m.get("train/skipped_nonfinite"):
        return "non-finite loss or gradient: update skipped"
    text = (f"reward {m['reward/mean']:.3f}  lag max {m.get('lag/max', 0):.0f}  "
            f"w peak/median {m.get('is_weight/peak_over_median', 1):.3f}  "
            f"kernel mismatch {m.get('mismatch/kernel_max_abs', float('nan')):.3g}")
    if "eval/pass@1" in m:
        text += f"  held-out pass@1 {m['eval/pass@1']:.1%}"
    return text


def _sft_progress(total: int):
    bar = _Progress("sft", total, every=50)
    return lambda step, loss, elapsed: bar.update(step, f"loss {loss:.3f}  {elapsed:.0f}s")


def cmd_sft(args) -> int:
    from .sft import SFTConfig, base_dir, is_built, train_sft

    cfg = SFTConfig(steps=args.steps, seed=args.seed) if args.steps else SFTConfig(seed=args.seed)
    out = Path(args.out) if args.out else base_dir(cfg)
    if is_built(out) and not args.force:
        print(f"parity: base policy already built: {out} (--force rebuilds)")
    else:
        print(f"parity: training the base policy ({cfg.preset}, {cfg.steps} steps) into {out}", flush=True)
        train_sft(out, cfg, _sft_progress(cfg.steps), eval_problems=args.eval_problems)
    record = json.loads((out / "sft.json").read_text())
    rows = [[name, f"{r['eval/pass@1']:.1%} ± {r['eval/pass@1_ci95']:.1%}", f"{r['eval/tool_calls']:.2f}"]
            for name, r in record.get("heldout", {}).items()]
    if rows:
        print(_table(["task", "held-out pass@1 (greedy)", "tool calls"], rows))
    print(f"trained in {record['train_s']:.0f} s; checkpoint: {out}")
    return 0


def cmd_eval(args) -> int:
    from .config import load_config
    from .envs.rollout import evaluate
    from .model import load_model
    from .rl.controller import build_task

    settings = [f'task.name="{args.task}"', f'model.checkpoint="{args.model}"', f"eval_prompts={args.n}"]
    if args.level:
        settings.append(f"task.level={args.level}")
    if args.math_task:
        settings.append(f'task.math_task="{args.math_task}"')
    cfg = load_config(None, settings + (args.set or []))
    from .rl.controller import checkpoint_path

    model = load_model(checkpoint_path(cfg), kernels=args.kernels)
    env = build_task(cfg, model.config.vocab_size)
    print(f"parity: {env.describe()}", flush=True)
    t0 = time.perf_counter()
    r = evaluate(model, env, args.n, k=args.k, temperature=args.temperature, max_tokens=args.max_tokens,
                 seed=args.seed)
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [["pass@1 (greedy)", f"{r['eval/pass@1']:.1%} ± {r['eval/pass@1_ci95']:.1%}"]]
    if args.k:
        rows.append([f"mean@{args.k} (T={args.temperature})",
                     f"{r[f'eval/mean@{args.k}']:.1%} ± {r[f'eval/mean@{args.k}_ci95']:.1%}"])
    rows += [["problems", f"{r['eval/problems']:.0f}"], ["answered", f"{r['eval/answered']:.1%}"],
             ["tool calls / episode", f"{r['eval/tool_calls']:.2f}"],
             ["tool errors / episode", f"{r['eval/tool_errors']:.2f}"]]
    print(_table([f"{env.name} (held-out, 95% CI)", "value"], rows))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_demo(args) -> int:
    from .demo import DemoOptions, run_demo

    opts = DemoOptions(steps=args.steps, max_policy_lag=args.lag, kernels=args.kernels, run_dir=args.run_dir,
                       eval_prompts=args.eval_prompts, seed=args.seed, base=args.model)
    bars: list[_Progress] = []

    def factory(kind: str, total: int = 0):
        if kind == "sft":
            from .sft import SFTConfig

            return _sft_progress(SFTConfig().steps)
        bars.append(_Progress("train", total, every=5))
        return lambda step, m: bars[-1].update(step, _describe_train(m))

    try:
        result = run_demo(opts, args.set or [], progress_factory=factory)
    finally:
        for b in bars:
            b.close()
    print()
    print(_table(["parity demo: tool-use task, async REINFORCE Zero", "value"],
                 [list(r) for r in result["summary"]]))
    run_dir = result["run_dir"]
    print(f"done in {result['seconds']:.0f} s: {run_dir}/report.md, {run_dir}/report.png, "
          f"{run_dir}/metrics.jsonl")
    return 0


def cmd_study(args) -> int:
    from .study import load_study, run_study, table_markdown

    study = load_study(args.config, quick=args.quick, task=args.task, seeds=args.seeds, out_dir=args.out)
    bars: list[_Progress] = []

    def factory(name: str, total: int):
        bars.append(_Progress(name, total, every=max(1, total // 4)))
        return lambda step, m: bars[-1].update(step, _describe_train(m))

    print(f"parity: study of {len(study.runs)} runs x {len(study.seeds)} seeds on the {study.task} task "
          f"-> {study.out_dir}", flush=True)
    try:
        results = run_study(study, progress_factory=factory)
    finally:
        for b in bars:
            b.close()
    print(table_markdown(results))
    print(f"done in {results['seconds']:.0f} s: {study.out_dir}/report.md, study.png, results.json")
    return 0


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="base policy + async REINFORCE Zero on the tool task, before/after table")
    d.add_argument("--steps", type=int, default=40, help="learner steps (default 40)")
    d.add_argument("--lag", type=int, default=8, help="max policy lag (default 8)")
    d.add_argument("--kernels", default="aligned", choices=["aligned", "standard"])
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--model", help="start from this checkpoint instead of the cached base policy")
    d.add_argument("--eval-prompts", type=int, default=200, help="held-out problems per evaluation")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a training config key")
    d.set_defaults(func=cmd_demo)

    st = sub.add_parser("study", help="the published comparisons as a grid of runs, one report")
    st.add_argument("config", nargs="?", help="study TOML (default grid when omitted)")
    st.add_argument("--quick", action="store_true", help="smoke-sized runs, one seed (CI)")
    st.add_argument("--task", choices=["tool", "math"], help="task (default: the config's, else tool)")
    st.add_argument("--seeds", type=_csv(int), help="comma-separated seeds")
    st.add_argument("--out", help="output directory (default runs/study)")
    st.set_defaults(func=cmd_study)

    s = sub.add_parser("sft", help="train (or show) the cached base policy")
    s.add_argument("--out", help="output directory (default: the cache)")
    s.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eval-problems", type=int, default=100, help="held-out problems per task (0 = skip)")
    s.add_argument("--force", action="store_true", help="rebuild even when cached")
    s.set_defaults(func=cmd_sft)

    e = sub.add_parser("eval", help="held-out pass@1 (greedy) and mean@k of a checkpoint on a task")
    e.add_argument("--model", default="base", help='checkpoint directory ("base" = the cached base policy)')
    e.add_argument("--task", default="tool", help="tool or math")
    e.add_argument("--level", type=int, default=0, help="difficulty (default: the task's)")
    e.add_argument("--math-task", help="math: add, sub, mul, expr or countdown")
    e.add_argument("--n", type=int, default=200, help="held-out problems")
    e.add_argument("-k", "--k", type=int, default=4, help="samples per problem for mean@k (0 = skip)")
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--max-tokens", type=int, default=64, help="per turn")
    e.add_argument("--kernels", default="aligned", choices=["aligned", "standard"])
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a task config key")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    p = sub.add_parser("check", help="prove the aligned kernels give bitwise-identical log-probs here")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (config.json + model.safetensors)")
    src.add_argument("--preset", default="tiny", help="random model preset when no --model (tiny|small)")
    p.add_argument("--dtype", type=_csv(str), default=["float32", "bfloat16"],
                   help="comma-separated dtypes (default float32,bfloat16)")
    p.add_argument("--rounds", type=int, default=4, help="random rounds per case (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=96, help="longest random sequence")
    p.add_argument("--cases", type=_csv(str), default=None, help="subset of cases to run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    k = bsub.add_parser("kernels", help="prefill/decode tokens/s, aligned vs standard")
    k.add_argument("--presets", type=_csv(str), default=["tiny", "small"])
    k.add_argument("--dtypes", type=_csv(str), default=["float32", "bfloat16"])
    k.add_argument("--batches", type=_csv(int), default=[1, 8, 64, 256])
    k.add_argument("--prefill-len", type=int, default=64)
    k.add_argument("--decode-steps", type=int, default=16)
    k.add_argument("--reps", type=int, default=5)
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_bench_kernels)
    r = bsub.add_parser("rollout", help="engine output tokens/s on a long-tail workload")
    r.add_argument("--preset", default="small")
    r.add_argument("--dtypes", type=_csv(str), default=["float32", "bfloat16"])
    r.add_argument("--num-seqs", type=int, default=256, help="requests in the workload")
    r.add_argument("--max-num-seqs", type=int, default=64, help="engine batch limit (and HF batch size)")
    r.add_argument("--mean-len", type=float, default=48, help="mean response length (geometric)")
    r.add_argument("--max-len", type=int, default=256)
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--vs-transformers", action="store_true", help="also time HF generate()")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_bench_rollout)

    t = sub.add_parser("train", help="RL training run (synchronous or asynchronous)")
    t.add_argument("config", nargs="?", help="TOML config (defaults when omitted)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    t.set_defaults(func=cmd_train)

    a = bsub.add_parser("async", help="learner steps/hour: synchronous vs asynchronous training")
    a.add_argument("--preset", default="small")
    a.add_argument("--dtype", default="float32")
    a.add_argument("--steps", type=int, default=12)
    a.add_argument("--lags", type=_csv(int), default=[8, 64])
    a.add_argument("--prompts", type=int, default=8)
    a.add_argument("--group", type=int, default=4)
    a.add_argument("--max-tokens", type=int, default=128)
    a.add_argument("--reps", type=int, default=1)
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_bench_async)

    g = sub.add_parser("generate", help="sample completions with the rollout engine")
    gsrc = g.add_mutually_exclusive_group()
    gsrc.add_argument("--model", help="checkpoint directory")
    gsrc.add_argument("--preset", default="tiny", help="random model preset when no --model")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids (repeatable)")
    g.add_argument("--prompts-file", help="one prompt per line, or JSONL with prompt / prompt_ids")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--kernels", default="aligned", choices=["aligned", "standard"])
    g.add_argument("--dtype", default="float32")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--json", action="store_true", help="token ids, log-probs and versions as JSON")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("rounds", "reps", "max_len", "prefill_len", "decode_steps", "num_seqs", "max_num_seqs",
                 "steps", "prompts", "group", "max_tokens", "eval_prompts", "n"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.command == "check" and args.max_len < 2:
        parser.error("--max-len must be at least 2")
    try:
        return args.func(args)
    except (ParityError, ValueError, OverflowError, MemoryError, OSError, RuntimeError) as exc:
        if os.environ.get("PARITY_DEBUG"):
            raise
        print(f"parity: error: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
              f"{'' if isinstance(exc, ParityError) else ' (PARITY_DEBUG=1 shows the traceback)'}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
