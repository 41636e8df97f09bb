"""The `parity` command's arguments: value types (comma-separated lists, memory sizes), the
limits every command's options share, and argparse's errors as one line.

`cli.py` builds the parser with `OneLineParser` and calls `check_args` on what it parsed; a bad
option is `parity: error: ...` on one line with exit status 2, as every other user-facing failure.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

from ..errors import ParityError

POSITIVE = ("rounds", "reps", "max_len", "prefill_len", "decode_steps", "num_seqs", "max_num_seqs", "steps",
            "prompts", "group", "max_tokens", "eval_prompts", "n", "batch", "length")
"""Integer options that must be at least 1."""


def memory(text: str) -> str:
    """'0.25' (a fraction of available memory), '4GiB', '512MiB', '1e9': checked, and passed on as
    written (`kv_cache_memory` reads it; as a float, '512KiB' became 524288.0, a decimal)."""
    from ..engine.memory import memory_size

    try:
        memory_size(text, "--kv-cache-memory")
    except ParityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def csv(kind):
    """A comma-separated list of `kind` (an empty item is refused: `1,,2` was read as 1,2)."""
    def parse(text: str):
        parts = [x.strip() for x in text.split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got nothing ({text!r})")
        if not all(parts):
            raise argparse.ArgumentTypeError(f"an empty item in the comma-separated list {text!r}")
        try:
            return [kind(x) for x in parts]
        except ValueError:
            what = {int: "integers", float: "numbers"}.get(kind, getattr(kind, "__name__", "values"))
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, "
                                             f"got {text!r}") from None
    return parse


def usage_error(message: str) -> NoReturn:
    """A bad option's value: one line, exit status 2 (argparse's own errors printed a usage block
    before it, the top-level one for a subcommand's option)."""
    print(f"parity: error: {message}", file=sys.stderr)
    raise SystemExit(2)


MAX_BATCH = 1_000_000
"""The most sequences a command's batch options take."""
MAX_COUNT = 2**31 - 1
"""The most any other whole-number option takes (but seeds)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (a bad choice, an unreadable number, a missing argument) as one line
    naming the command, without the usage block (`--help` shows it)."""

    def parse_args(self, args=None, namespace=None):  # (argparse's own, but for the command's name)
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # a subcommand's unknown option: its own --help names the options (`parity train`)
            where = " ".join(str(x) for x in (self.prog, getattr(parsed, "command", None),
                                              getattr(parsed, "bench", None)) if x)
            usage_error(f"unrecognized arguments: {' '.join(extra)} (`{where} --help` lists the options)")
        return parsed

    def error(self, message: str) -> NoReturn:
        usage_error(f"{message} (`{self.prog} --help` lists the options)")


def check_args(args: argparse.Namespace) -> None:
    """The limits argparse cannot say: each a one-line usage error."""
    for name in POSITIVE:
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            usage_error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("k", "eval_problems"):
        if getattr(args, name, 0) < 0:
            usage_error(f"--{name.replace('_', '-')} must be >= 0 (0 = skip)")
    if getattr(args, "eval_problems", 0) > 200:  # (sft evaluated the 200 there are, silently)
        usage_error("--eval-problems must be at most 200 (the size of each task's held-out set)")
    if getattr(args, "k", 0) > 64:  # (as the trainer's eval_samples)
        usage_error("--k must be at most 64 samples per problem")
    if getattr(args, "vocab", None) is not None and args.vocab < 2:
        usage_error("--vocab must be at least 2")
    if getattr(args, "seed", None) is not None and not 0 <= args.seed < 2**63:
        usage_error("--seed must be in 0..2**63-1")
    for name, value in vars(args).items():  # a size of 1e11 hung for minutes, or died out of memory
        if isinstance(value, str) and not value.strip():  # (--out "" fell back to the default directory)
            usage_error(f"{'the config path' if name == 'config' else '--' + name.replace('_', '-')} "
                        f"is empty")
        values = value if isinstance(value, list) else [value]
        limit = MAX_BATCH if name in ("batch", "batches", "num_seqs", "max_num_seqs") else MAX_COUNT
        if name not in ("seed", "seeds") and any(type(v) is int and v > limit for v in values):
            usage_error(f"--{name.replace('_', '-')} must be at most {limit:,}")
    if args.command == "check" and args.max_len < 2:
        usage_error("--max-len must be at least 2")


def out_of_memory(exc: BaseException) -> str | None:
    """An allocator's failure said as what it is (PyTorch's CPU message opens with "[enforce fail
    at alloc_cpu.cpp:127] err == 0"), with the size asked for; None for any other error."""
    text = str(exc)
    if not (isinstance(exc, MemoryError) or "can't allocate memory" in text
            or "out of memory" in text.lower()):
        return None
    cpu = re.search(r"allocate (\d+) bytes", text)
    cuda = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", text)
    asked = f"{int(cpu.group(1)) / 2**30:,.1f} GiB" if cpu else cuda.group(1) if cuda else None
    return (f"out of memory{f' ({asked} asked for at once)' if asked else ''}: the sizes given need more "
            "memory than is free here; lower them (batch sizes, rows, lengths, vocabulary)")


