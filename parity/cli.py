"""The `parity` command: demo, study, sft, eval, train, check, sandbox, compile, generate,
bench kernels|rollout|learner|learner-memory|gemm|linear|attention|sampler|memory|async.

This module is the parser and the dispatch; each command's body is `main(args)` in its module
under `parity/apps/` (imported only when that command runs). Every user-facing failure (bad
config, checkpoint, option) is printed as one line `parity: error: ...` with exit status 2; no
traceback (PARITY_DEBUG=1 shows it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path

from .apps.args import OneLineParser, check_args, out_of_memory
from .apps.args import csv as _csv
from .apps.args import memory as _memory
from .config import BASE_CHECKPOINTS, TASK_NAMES
from .dtypes import DTYPE_NAMES
from .errors import Interrupted, ParityError, Terminated
from .invariance import CASES
from .model.config import PRESET_NAMES
from .ops import BACKENDS


def _command(sub, name: str, module: str, help: str, **kwargs) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help, **kwargs)
    p.set_defaults(module=module)
    return p


def _gemm_tiles_option(parser: argparse.ArgumentParser) -> None:
    """--gemm-tiles: the aligned GEMM's tiles from a `bench gemm --json` file, in this process."""
    parser.add_argument("--gemm-tiles", metavar="FILE",
                        help="GEMM tiles per weight shape from `parity bench gemm --json` (a GPU)")


def _bench_options(parser: argparse.ArgumentParser, reps: int) -> None:
    """--reps, --json and --device, as the device benches take them."""
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")


def _version() -> str:
    """`parity --version`: what a bug report needs (the bits follow torch's build and the CPU)."""
    import platform

    import torch

    from . import __version__
    return (f"parity {__version__} (torch {torch.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()})")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="parity", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    all_dtypes = list(DTYPE_NAMES)

    d = _command(sub, "demo", "demo", "base policy + async REINFORCE Zero on the tool task, before/after")
    d.add_argument("--steps", type=int, default=40, help="learner steps (default 40)")
    d.add_argument("--lag", type=int, default=8, help="max policy lag (default 8)")
    d.add_argument("--kernels", default="aligned", choices=BACKENDS)
    d.add_argument("--run-dir", default="runs/demo",
                   help="its directory (runs/demo is the demo's; elsewhere another run needs --overwrite)")
    d.add_argument("--overwrite", action="store_true", help="replace another command's run in --run-dir")
    d.add_argument("--model", help="start from this checkpoint instead of the cached base policy")
    d.add_argument("--eval-prompts", type=int, default=200, help="held-out problems per eval (%(default)s)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a training config key")

    st = _command(sub, "study", "study", "the published comparisons as a grid of runs, one report")
    st.add_argument("config", nargs="?", help="study TOML (default grid when omitted)")
    st.add_argument("--quick", action="store_true", help="smoke-sized runs, one seed (CI)")
    st.add_argument("--task", choices=list(TASK_NAMES),
                    help="task (default: the config's, else tool; yours: its task.* keys in [train])")
    st.add_argument("--seeds", type=_csv(int), help="comma-separated seeds")
    st.add_argument("--out", type=os.path.expanduser,
                    help="output directory (default: the config's out_dir, built in runs/study)")
    st.add_argument("--report-only", action="store_true",
                    help="train nothing: write the report from the runs already finished")
    st.add_argument("--overwrite", action="store_true",
                    help="train again the runs in --out that another config wrote (refused without it)")

    s = _command(sub, "sft", "sft", "train (or show) the cached base policy")
    s.add_argument("--out", type=os.path.expanduser, help="output directory (default: the cache)")
    s.add_argument("--recipe", default="base", choices=BASE_CHECKPOINTS,
                   help="which base policy: 'base' (tool use) or 'base-math' (column-sum addition)")
    s.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eval-problems", type=int, default=100,
                   help="held-out per task, at most 200, 0: skip (%(default)s)")
    s.add_argument("--force", action="store_true", help="rebuild even when cached")

    e = _command(sub, "eval", "evaluate", "held-out pass@1 (greedy) and mean@k of a checkpoint on a task")
    e.add_argument("--model", help=f"checkpoint directory (or {', '.join(BASE_CHECKPOINTS)}: the cached base "
                   "policies; default: --config's run's newest checkpoint, else base)")
    e.add_argument("--task", choices=list(TASK_NAMES), help="the task (default: --config's, else tool)")
    e.add_argument("--config", help="a training config (a run's config.toml) whose [task] table to use")
    e.add_argument("--level", type=int, help="difficulty (default: the task's)")
    e.add_argument("--math-task", help="math: add, sub, mul, expr or countdown")
    e.add_argument("--n", type=int, help="held-out problems (default: the task's whole held-out set)")
    e.add_argument("-k", "--k", type=int, default=4, help="samples per problem for mean@k (0 = skip)")
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--max-tokens", type=int, default=64, help="per turn (%(default)s)")
    e.add_argument("--kernels", default="aligned", choices=BACKENDS)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a task or model config key (task.level=2, task.heldout_size=100)")
    e.add_argument("--json", action="store_true")

    t = _command(sub, "train", "train", "RL training run (synchronous or asynchronous)")
    t.add_argument("config", nargs="?", help="TOML config (defaults when omitted)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="start over in a run_dir that holds an earlier run (its checkpoints are deleted)")

    p = _command(sub, "check", "check", "prove the aligned kernels give bitwise-identical log-probs here")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (config.json + model.safetensors), or base / "
                     "base-math (parity sft's cached base policies)")
    src.add_argument("--preset", default="tiny",
                     help=f"random model preset when no --model ({'|'.join(PRESET_NAMES)}; default tiny)")
    p.add_argument("--dtype", type=_csv(str), default=all_dtypes,
                   help="comma-separated dtypes (default float32,bfloat16)")
    p.add_argument("--rounds", type=int, default=4, help="random rounds per case (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=96, help="longest random sequence (%(default)s)")
    p.add_argument("--cases", type=_csv(str), default=None,
                   help=f"subset of cases to run, comma-separated (of {', '.join(CASES)})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    _gemm_tiles_option(p)

    sb = _command(sub, "sandbox", "sandbox_check",
                  "what model-written code could reach here: the sandbox's protections, and escapes tried")
    sb.add_argument("--json", action="store_true", help="machine-readable output")

    c = _command(sub, "compile", "compile",
                 "compile the aligned Triton kernels for a GPU here, without one: resources per binary")
    c.add_argument("--arch", default="sm_90", help="GPU architecture (default sm_90: H100/H200)")
    c.add_argument("--presets", type=_csv(str), default=["qwen3-0.6b"], help="comma-separated (qwen3-0.6b)")
    c.add_argument("--dtype", type=_csv(str), default=["bfloat16"], help="comma-separated (bfloat16)")
    c.add_argument("--batch", type=int, default=8, help="decode batch size besides 1 (default 8)")
    c.add_argument("--length", type=int, default=64, help="learner sequence length (default 64)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.add_argument("--gemm-candidates", nargs="?", const="default", metavar="TILES",
                   help="instead of the model's passes, compile `bench gemm`'s candidate tiles (default "
                        "its list for the dtype, or comma-separated tiles) at the presets' weight shapes")
    _gemm_tiles_option(c)

    g = _command(sub, "generate", "generate", "sample completions with the rollout engine")
    gsrc = g.add_mutually_exclusive_group()
    gsrc.add_argument("--model",
                      help="checkpoint directory, or base / base-math (parity sft's cached base policies)")
    gsrc.add_argument("--preset", default="tiny", help="random model preset when no --model")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids (repeatable)")
    g.add_argument("--prompts-file", help="one prompt per line, or JSONL with prompt / prompt_ids (a line "
                   "starting with { is JSON: such text goes in as {\"prompt\": ...})")
    g.add_argument("--chat", action="store_true", help="text prompts as a user turn of the chat template")
    g.add_argument("--chat-kwarg", action="append", metavar="NAME=VALUE",
                   help="a chat template variable, e.g. enable_thinking=false (repeatable)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--kernels", default="aligned", choices=BACKENDS)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--context", type=int, help="the longest sequence served, as vLLM's --max-model-len "
                   "(default: the model's; a longrope model takes its short factors within its original one)")
    g.add_argument("--kv-cache-memory", type=_memory, default=0.25,
                   help="KV cache budget: a fraction of available memory (0.25) or a size (512MiB, 4GiB)")
    g.add_argument("--json", action="store_true", help="token ids, log-probs and versions as JSON")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")

    b = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    k = _command(bsub, "kernels", "bench_kernels", "prefill/decode tokens/s, aligned vs standard")
    k.add_argument("--presets", type=_csv(str), default=["tiny", "small"])
    k.add_argument("--dtypes", type=_csv(str), default=all_dtypes)
    k.add_argument("--batches", type=_csv(int), default=[1, 8, 64, 256])
    k.add_argument("--prefill-len", type=int, default=64)
    k.add_argument("--decode-steps", type=int, default=16)
    k.add_argument("--reps", type=int, default=5)
    k.add_argument("--eager-decode", action="store_true",
                   help="on a GPU, also time decode without CUDA graphs (rows 'decode-eager')")
    k.add_argument("--json", action="store_true")
    k.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    _gemm_tiles_option(k)
    r = _command(bsub, "rollout", "bench_rollout", "engine output tokens/s on a long-tail workload")
    r.add_argument("--preset", default="small")
    r.add_argument("--dtypes", type=_csv(str), default=all_dtypes)
    r.add_argument("--num-seqs", type=int, default=256, help="requests in the workload (%(default)s)")
    r.add_argument("--max-num-seqs", type=int, default=64, help="engine batch limit (and HF batch size)")
    r.add_argument("--mean-len", type=float, default=48, help="mean response length (geometric)")
    r.add_argument("--max-len", type=int, default=256)
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--group-size", type=int, default=1,
                   help="each prompt asked this many times, as a GRPO group (> 1: also times the aligned "
                        "engine without prefix caching)")
    r.add_argument("--prompt-len", type=int, default=0, help="every prompt this long (default 0: 16-64)")
    r.add_argument("--vs-transformers", action="store_true", help="also time HF generate()")
    r.add_argument("--json", action="store_true")
    r.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    n = _command(bsub, "learner", "bench_learner", "learner forward+backward tokens/s, aligned vs standard")
    n.add_argument("--presets", type=_csv(str), default=["small", "small-moe"])
    n.add_argument("--dtypes", type=_csv(str), default=all_dtypes)
    n.add_argument("--batch", type=int, default=8, help="sequences per step")
    n.add_argument("--length", type=int, default=128, help="tokens per sequence")
    _bench_options(n, reps=5)
    _gemm_tiles_option(n)
    lm = _command(bsub, "learner-memory", "bench_learner_memory",
                  "a learner step's memory and speed: LM head in chunks, activation checkpointing, both")
    lm.add_argument("--preset", default="qwen3-0.6b")
    lm.add_argument("--dtype", default="bfloat16", choices=all_dtypes)
    lm.add_argument("--kernels", default="aligned", choices=BACKENDS)
    lm.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    lm.add_argument("--length", type=int, default=2048, help="tokens per sequence (default 2048)")
    lm.add_argument("--head-chunk", type=int, default=0,
                    help="positions per LM-head chunk (default 0: the learner's auto, 2^26 / vocab)")
    _bench_options(lm, reps=1)
    gm = _command(bsub, "gemm", "bench_gemm",
                  "aligned Triton GEMM tiles per weight shape vs cuBLAS (a GPU; the interpreter on CPU)")
    gm.add_argument("--preset", default="qwen3-0.6b")
    gm.add_argument("--dtype", default="bfloat16")
    gm.add_argument("--rows", type=_csv(int), default=[64, 256, 8192], help="row counts M to time")
    gm.add_argument("--candidates", type=_csv(str), default=None,
                    help="tiles BMxBNxBKxWARPSxSTAGES, comma-separated (default: a list per dtype)")
    _bench_options(gm, reps=5)
    li = _command(bsub, "linear", "bench_linear", "CPU products per weight shape, aligned vs standard")
    li.add_argument("--preset", default="qwen3-0.6b")
    li.add_argument("--dtype", default="bfloat16")
    li.add_argument("--rows", type=_csv(int), default=[1, 8, 64, 256, 1024], help="row counts (M)")
    li.add_argument("--reps", type=int, default=15)
    li.add_argument("--json", action="store_true")
    at = _command(bsub, "attention", "bench_attention",
                  "decode attention per schedule (walk, split, auto) vs the standard path")
    at.add_argument("--preset", default="qwen3-0.6b", help="heads and head size from this preset")
    at.add_argument("--dtype", default="bfloat16")
    at.add_argument("--batches", type=_csv(int), default=[1, 8, 64])
    at.add_argument("--contexts", type=_csv(int), default=[1024, 4096], help="keys per sequence")
    _bench_options(at, reps=5)
    sp = _command(bsub, "sampler", "bench_sampler",
                  "one sampling step per noise path (fused Triton on a GPU)")
    sp.add_argument("--preset", default="qwen3-0.6b", help="the vocabulary size comes from this preset")
    sp.add_argument("--vocab", type=int, default=None, help="a vocabulary size instead of the preset's")
    sp.add_argument("--dtype", default="bfloat16", help="the logits' dtype")
    sp.add_argument("--batches", type=_csv(int), default=[1, 64, 256])
    _bench_options(sp, reps=5)
    mem = _command(bsub, "memory", "bench_memory", "peak memory and weight copies kept against the lag")
    mem.add_argument("--preset", default="small")
    mem.add_argument("--dtype", default="float32")
    mem.add_argument("--lags", type=_csv(int), default=[1, 8, 64])
    mem.add_argument("--after", type=int, default=16, help="steps after the first `lag` (%(default)s)")
    mem.add_argument("--max-held-versions", type=int, default=2,
                     help="rollout.max_held_versions (0: batches strictly in order)")
    mem.add_argument("--max-tokens", type=int, default=8, help="response length (1 prompt x 2 per step)")
    mem.add_argument("--json", action="store_true")
    a = _command(bsub, "async", "bench_async", "learner steps/hour: synchronous vs asynchronous training")
    a.add_argument("--preset", default="small")
    a.add_argument("--dtype", default="float32")
    a.add_argument("--steps", type=int, default=12)
    a.add_argument("--lags", type=_csv(int), default=[8, 64])
    a.add_argument("--prompts", type=int, default=8)
    a.add_argument("--group", type=int, default=4)
    a.add_argument("--max-tokens", type=int, default=128)
    a.add_argument("--reps", type=int, default=3, help="repetitions, modes taking turns (default 3)")
    a.add_argument("--backends", "--backend", type=_csv(str), default=["local"],
                   help="local and/or ray (default local)")
    a.add_argument("--workers", type=_csv(int), default=[1], help="rollout worker counts (default 1)")
    a.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N (default cpu): the learner and its workers share it")
    a.add_argument("--json", action="store_true")
    _name_defaults(parser)
    return parser


def _name_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option without help text of its own says its default in `--help` (the benches'
    presets were found only by running them, and some are heavy on a small machine)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _name_defaults(child)
        elif action.help is None and action.option_strings and action.default is not None \
                and action.default is not False:
            value = action.default
            shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            action.help = f"default {shown}".replace("%", "%%")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    from .apps.ui import setup_logging

    setup_logging()
    previous = _raise_on_sigterm()
    try:
        return importlib.import_module(f".apps.{args.module}", __package__).main(args)
    except Interrupted as stop:  # a training run inside demo, study, bench async...: its checkpoint
        kept = f"checkpoint saved to {stop.path}" if Path(stop.path).exists() else \
            "nothing kept (the run was a benchmark's, in a temporary directory)"
        if args.module == "demo" and Path(stop.path).exists():  # (a new demo starts its run over)
            kept += f" (finish it with: parity train --resume {Path(stop.path).parent})"
        print(f"parity: interrupted ({stop.signal_name}); {kept}", file=sys.stderr)
        return 143 if stop.signal_name == "SIGTERM" else 130
    except BrokenPipeError:  # stdout piped into `head`, say: the work is done, its reader gone
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush failed too)
        except OSError:
            pass
        return 141  # as a process that SIGPIPE ended
    except (ParityError, ValueError, OverflowError, MemoryError, OSError, RuntimeError) as exc:
        if os.environ.get("PARITY_DEBUG", "0") not in ("", "0"):
            raise
        text = out_of_memory(exc) or str(exc).strip()
        print(f"parity: error: {text.splitlines()[0] if text else type(exc).__name__}"
              f"{'' if isinstance(exc, ParityError) else ' (PARITY_DEBUG=1 shows the traceback)'}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # (a command without a checkpoint of its own: sft, eval, ...)
        term = isinstance(stop, Terminated)
        print(f"parity: interrupted{' (SIGTERM)' if term else ''}", file=sys.stderr)
        return 143 if term else 130
    finally:
        if previous is not False:  # (None: a handler not set from Python; the default stands in)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _raise_on_sigterm():
    """Install the SIGTERM handler (main thread only); returns the one it replaced."""
    def handler(signum, frame):
        raise Terminated()

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: nothing installed
        return False


if __name__ == "__main__":
    sys.exit(main())
