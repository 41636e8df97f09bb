"""`parity sft`: the base policy RL starts from, trained on generated demonstrations.

No model hub is reachable, so parity makes its own: a character-level Hugging Face tokenizer
with special tokens for turns and tool calls, and a `small` model fine-tuned on seeded demonstrations of
the tool-use task (including tool-call traces, some with a failing first call and a retry) and of the
math task. The demonstrations stop at partial competence on purpose, so RL has signal:

- the demonstrator uses the tool for most products but only for some sums; otherwise it gives
  an estimate (two significant digits), so the base policy under-uses the tool — a behaviour
  RL can fix, since only exact answers are rewarded;
- training is short, so copying long digit strings is imperfect.

Two named recipes (`RECIPES`): `base` (tool use, math answered directly: the `small` model
barely learns carrying that way) and `base-math` (two-digit addition only, half of the
demonstrations worked in columns: `7+5=12 4+8+1=13 answer: 132`; the base is right when it
chooses columns, so RL on the math task has a behaviour to reinforce).

The checkpoint (`config.json`, `model.safetensors`, `tokenizer.json`, `sft.json` with the
recipe and the measured held-out pass@1 per task) is cached under
`~/.cache/parity/base/<recipe hash>/` (`PARITY_CACHE` moves it) and reused by `parity demo`.
A training config may name it `model.checkpoint = "base"` (or "base-math"); `resolve_base`
turns that into the directory (building it first) before the library sees the config. Builds
run in a fresh process (`sft_child`: bits that do not hang on the asking process's thread state).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import TrainConfig, with_overrides
from ..envs.chat import EOS, prompt_text
from ..envs.math import MathEnv, MathTask, Problem, worked_answer
from ..envs.sandbox import Sandbox
from ..envs.tool import ToolEnv, format_result, make_tool_problem, tool_call_text, tool_output
from ..errors import ConfigError, ParityError
from ..metrics.summary import pass_at_1_text
from ..procs import gone as process_gone
from ..rl import evaluate as rl_evaluate  # (a module: tests stop its evaluate)
from ..rl.optim import adamw
from . import sft_child, sft_partial
from .ui import table

log = logging.getLogger(__name__)

RECIPE_VERSION = 4
"""Bump when the demonstrations or training change, so cached base policies are rebuilt (3: the
standard kernels the recipe trains with no longer pad GEMMs to 16 rows; 4: the tool on 45% of
sums, up from 30%, see `SFTConfig.tool_use`)."""


@dataclass
class SFTConfig:
    """How the base policy is made (every field enters the cache key)."""

    steps: int = 750
    """Optimizer steps."""
    batch_size: int = 32
    """Demonstrations per step."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 30
    """Warm-up steps."""
    seed: int = 0
    """Seed of the init and of the demonstrations."""
    preset: str = "small"
    """Model shape (the vocabulary is resized to the tokenizer's)."""
    tool_fraction: float = 0.8
    """Share of demonstrations from the tool task; the rest are math problems."""
    tool_use: dict[str, float] = field(default_factory=lambda: {"mul": 0.7, "sum": 0.45})
    """Per problem kind, how often the demonstrator calls the tool (else it answers directly).
    Sums at 0.45: the base still answers sums directly when greedy (RL's job is to change that)
    but has seen enough sum calls to copy them (at 0.3 an Intel Xeon's bases copied 43% / 1% of
    them exactly, seeds 0 / 1, and its demo gained 3.5 points; at 0.45 93% / 70%, 49.5% -> 98.5%)."""
    retry_fraction: float = 0.05
    """Share of tool demonstrations whose first call has a syntax error, then a fixed retry."""
    tool_level: int = 1
    """Difficulty of the tool problems (1..3)."""
    math_task: str = "add"
    """Math task of the single-turn demonstrations."""
    math_level: int = 1
    """Its difficulty level (1..5)."""
    math_columns: float = 0.0
    """Share of math demonstrations written as column sums (least significant digit first, then
    the answer); the rest answer directly (`answer: N`). Needs math_task 'add'."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ConfigError("sft: steps and batch_size must be >= 1 and lr > 0")
        for name in ("tool_fraction", "retry_fraction", *[f"tool_use.{k}" for k in self.tool_use]):
            value = self.tool_use[name[9:]] if name.startswith("tool_use.") else getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"sft: {name} must be in [0, 1], got {value}")
        if not 0.0 <= self.math_columns <= 1.0:
            raise ConfigError(f"sft: math_columns must be in [0, 1], got {self.math_columns}")
        if self.math_columns and self.math_task != "add":
            raise ConfigError("sft: math_columns needs math_task 'add'")

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        if not fields["math_columns"]:  # the field's default: keys of existing caches stay valid
            del fields["math_columns"]
        blob = json.dumps({"recipe": RECIPE_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- demonstrations
def estimate(value: int, digits: int = 2) -> int:
    """What the demonstrator answers without the tool: `value` rounded to two significant
    digits (right only by luck, so exact-answer reward needs the tool)."""
    scale = 10 ** max(0, len(str(abs(value))) - digits)
    return round(value / scale) * scale


def tool_demonstration(problem: Problem, rnd: random.Random, cfg: SFTConfig) -> list[tuple[str, int]]:
    """(text, loss mask) segments of one tool-task demonstration after the prompt."""
    kind = problem.task.removeprefix("tool-")
    answer = f"answer: {problem.answer}{EOS}"
    if rnd.random() >= cfg.tool_use.get(kind, 1.0):
        return [(f"answer: {estimate(problem.answer)}{EOS}", 1)]
    call = tool_call_text(problem)
    segments: list[tuple[str, int]] = []
    if rnd.random() < cfg.retry_fraction:  # a broken first call, its error, then the fix
        broken = call.replace(")</python>", "</python>")
        segments += [(broken, 1), (format_result("", "SyntaxError: '(' was never closed"), 0)]
    segments += [(call, 1), (format_result(tool_output(problem), None), 0), (answer, 1)]
    return segments


def demonstration(rnd: random.Random, cfg: SFTConfig, math_task: MathTask, tool_heldout: set[str],
                  index: int) -> tuple[str, list[tuple[str, int]]]:
    """A (prompt text, segments) pair: a tool-task or a math demonstration."""
    if rnd.random() < cfg.tool_fraction:
        kind = rnd.choice(sorted(cfg.tool_use))
        while True:
            problem = make_tool_problem(kind, cfg.tool_level, rnd)
            if problem.prompt not in tool_heldout:
                break
        return prompt_text(problem.prompt), tool_demonstration(problem, rnd, cfg)
    problem = math_task.problems(index, 1)[0]
    # the default recipe draws nothing here, so its demonstrations stay what they were
    fmt = "columns" if cfg.math_columns and rnd.random() < cfg.math_columns else "direct"
    return prompt_text(problem.prompt), [(worked_answer(problem, fmt) + EOS, 1)]


def encode_demo(tokenizer, prompt: str, segments: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(prompt)
    mask = [0] * len(ids)
    for text, m in segments:
        seg = tokenizer.encode(text)
        ids += seg
        mask += [m] * len(seg)
    return ids, mask


# --------------------------------------------------------------------------- training
def base_dir(cfg: SFTConfig | None = None) -> Path:
    """Where the base policy of this recipe is cached."""
    cfg = cfg or SFTConfig()
    root = Path(os.environ.get("PARITY_CACHE") or Path.home() / ".cache" / "parity")  # (empty: unset)
    return root / "base" / cfg.key()


def is_built(path: Path) -> bool:
    files = ("config.json", "model.safetensors", "tokenizer.json", "sft.json")
    return all((path / f).exists() for f in files)


def check_out(out_dir: Path) -> None:
    """Refuse an --out the finished policy would replace but must not: a file, or a directory
    holding anything but an earlier base policy (checked before training)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ParityError(f"{out_dir} exists and is not a directory: choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "sft.json").exists():
        raise ParityError(f"{out_dir} is a directory with other files in it (not a base policy "
                          f"parity sft wrote), which a new base policy would replace: choose another --out")
    try:  # the folder it is built in beside it (checked before training: it named that folder)
        out_dir.absolute().parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(out_dir.absolute().parent, os.W_OK)
    except OSError as exc:
        writable, why = False, exc.strerror or exc
    else:
        why = "not writable"
    if not writable:
        raise ParityError(f"{out_dir} cannot be written: {why}; choose another --out")


def train_sft(out_dir: str | Path, cfg: SFTConfig | None = None, progress=None,
              eval_problems: int = 100) -> dict:
    """Train the base policy into `out_dir` (written atomically); returns the sft.json record."""
    cfg = cfg or SFTConfig()
    out_dir = Path(out_dir)
    check_out(out_dir)
    _remove_stale_builds(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        (tmp / BUILDER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    except OSError as exc:  # (named the temporary folder, which the user never asked for)
        shutil.rmtree(tmp, ignore_errors=True)
        why = exc.strerror or exc
        raise ParityError(f"{out_dir} cannot be written: {why}; choose another --out") from None
    try:
        record = _train_into(tmp, out_dir, cfg, progress, eval_problems)
    except BaseException:  # (Ctrl-C, SIGTERM, an error: no half-built directory is left behind;
        if is_built(tmp):  # one trained and saved, stopped in its held-out evaluation, is kept)
            (tmp / BUILDER).unlink(missing_ok=True)
            shutil.rmtree(out_dir, ignore_errors=True)
            tmp.rename(out_dir)
            log.warning("the base policy was trained and saved to %s; its held-out evaluation was "
                        "stopped (sft.json has no held-out results)", out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / BUILDER).unlink()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return record


BUILDER = ".builder"  # in a base policy being built: the host name and pid of the process building it


def _remove_stale_builds(out_dir: Path) -> None:
    """Remove `out_dir.tmp*` directories of builds killed outright: only those whose BUILDER file
    names this host and a process that is gone (a cache shared between machines keeps the
    others', and a directory without the file is left alone)."""
    for old in out_dir.parent.glob(out_dir.name + ".tmp*"):
        try:
            host, pid = (old / BUILDER).read_text().split()
        except (OSError, ValueError):  # (no BUILDER file, or not one host and one pid)
            continue
        if host == socket.gethostname() and process_gone(pid):
            shutil.rmtree(old, ignore_errors=True)


def _train_into(tmp: Path, out_dir: Path, cfg: SFTConfig, progress, eval_problems: int) -> dict:
    """Build the base policy in `tmp` (`train_sft` moves it to `out_dir`)."""
    from ..model import Model, ModelConfig
    from ..model.tokenizer import HFTokenizer, build_char_tokenizer

    build_char_tokenizer().save(str(tmp / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp / "tokenizer.json")
    vocab = -(-tokenizer.vocab_size // 64) * 64
    config = ModelConfig.preset(cfg.preset, vocab_size=vocab, eos_token_id=tokenizer.token_id(EOS),
                                max_position_embeddings=512)
    torch.manual_seed(cfg.seed)
    model = Model(config, kernels="standard", seed=cfg.seed)
    opt = adamw(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    rnd = random.Random(cfg.seed)
    math_task = MathTask(cfg.math_task, cfg.math_level, seed=cfg.seed)
    tool_heldout = {p.prompt for p in ToolEnv(tokenizer, tuple(sorted(cfg.tool_use)), cfg.tool_level,
                                              seed=cfg.seed, sandbox=False).heldout()}
    recipe = {"version": RECIPE_VERSION, "config": dataclasses.asdict(cfg)}  # (what a kept build must match)
    step_fn = functools.partial(_sft_step, model, opt, tokenizer, rnd, cfg, math_task, tool_heldout)
    losses, train_s = sft_partial.train_steps(out_dir, recipe, model, opt, rnd, cfg.steps, progress, step_fn)
    model.save_pretrained(tmp)
    record = {"recipe": RECIPE_VERSION, "config": dataclasses.asdict(cfg), "train_s": train_s,
              "final_loss": sum(losses[-20:]) / len(losses[-20:])}
    (tmp / "sft.json").write_text(json.dumps(record, indent=2) + "\n")  # built, before the evaluation
    if eval_problems:
        model.set_kernels("aligned")
        envs = [MathEnv(tokenizer, cfg.math_task, cfg.math_level, seed=0)]
        try:  # the tool task runs the model's code: only where the sandbox isolates it
            envs.insert(0, ToolEnv(tokenizer, tuple(sorted(cfg.tool_use)), cfg.tool_level, sandbox=Sandbox()))
        except ParityError as exc:
            log.warning("the tool task's held-out evaluation is left out: %s", exc)
        record["heldout"] = {env.name: rl_evaluate.evaluate(model, env, eval_problems) for env in envs}
    (tmp / "sft.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _sft_step(model, opt, tokenizer, rnd, cfg: SFTConfig, math_task, tool_heldout, step: int,
              losses: list[float]) -> None:
    """One optimizer step on a batch of demonstrations; its loss appended to `losses`."""
    from ..model import sequence_logprobs

    demos = [encode_demo(tokenizer, *demonstration(rnd, cfg, math_task, tool_heldout,
                                                   step * cfg.batch_size + j)) for j in range(cfg.batch_size)]
    lr = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    if step >= cfg.warmup_steps:
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        lr = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    for group in opt.param_groups:
        group["lr"] = lr
    lps = sequence_logprobs(model, [ids for ids, _ in demos])
    mask = torch.cat([torch.tensor(m[1:], dtype=torch.float32) for _, m in demos])
    loss = -(torch.cat(lps) * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.invalidate_fused()
    losses.append(loss.item())


def read_record(out: Path) -> dict:
    """A built base policy's sft.json, or a one-line error naming it."""
    path = out / "sft.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ParityError(f"{path} cannot be read ({exc}): rebuild it with --force") from None
    if not (isinstance(record, dict) and isinstance(record.get("train_s"), (int, float))
            and isinstance(record.get("heldout", {}), dict)):
        raise ParityError(f"{path} is not a base policy's record (no train_s): rebuild it with --force")
    return record


MATH_STEPS = 300
"""Optimizer steps of the 'base-math' recipe."""
MATH_COLUMNS = 0.5
"""Share of its demonstrations that work the sum in columns (so the base policy's held-out pass@1
sits in 20-60%: column sums it gets right, direct answers it rarely does)."""

RECIPES: dict[str, SFTConfig] = {
    "base": SFTConfig(),
    "base-math": SFTConfig(tool_fraction=0.0, math_columns=MATH_COLUMNS, steps=MATH_STEPS),
}
"""The named base policies (`model.checkpoint = "<name>"`): 'base' for the tool task (and math
answered directly, which this model size barely learns), 'base-math' for two-digit addition
written as column sums, trained only part of the way so RL has signal."""
BASE_EVAL_PROBLEMS = 100  # held-out problems per task a cached base is scored on at its build


def get_base_policy(cfg: SFTConfig | None = None) -> Path:
    """The cached base policy's directory, built first (in a fresh process: `sft_child`) when it
    is not there yet."""
    cfg = cfg or SFTConfig()
    path = base_dir(cfg)
    if is_built(path):
        return path
    log.info("building the base policy (once; cached in %s)", path)
    sft_child.build(path, cfg, BASE_EVAL_PROBLEMS, progress_on_stderr=True)  # (stdout may be JSON)
    return path


def names_recipe(name: str | None) -> bool:
    """Whether a model name means a cached base policy ("base", "base-math"); the same name as
    a directory here is refused (it read as the recipe, the user's directory silently unused)."""
    if name not in RECIPES:
        return False
    if Path(name).exists() and Path(name).resolve() != base_dir().parent.resolve():  # (not the cache's)
        raise ParityError(f"{name!r} names both a cached base policy and ./{name}: write ./{name} for the "
                          "directory, or move it")
    return True


def resolve_base(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with model.checkpoint = "base" (or another recipe name, `RECIPES`) replaced by that
    base policy's directory."""
    name = cfg.model.checkpoint
    if not names_recipe(name):
        return cfg
    return with_overrides(cfg, {"model.checkpoint": str(get_base_policy(RECIPES[name]))})


# --------------------------------------------------------------------------- the command
def main(args) -> int:
    """`parity sft`: train (or show) the base policy."""
    cfg = dataclasses.replace(RECIPES[args.recipe], seed=args.seed,
                              **({"steps": args.steps} if args.steps else {}))
    out = Path(args.out) if args.out else base_dir(cfg)
    if is_built(out) and not args.force:
        sft_partial.check_kept_build(out, read_record(out), cfg, RECIPE_VERSION)
        print(f"parity: base policy already built: {out} (--force rebuilds)")
    else:
        check_out(out)  # (said it was training into a file, then refused)
        print(f"parity: training the base policy ({cfg.preset}, {cfg.steps} steps) into {out}", flush=True)
        sft_child.build(out, cfg, eval_problems=args.eval_problems)
    record = read_record(out)
    try:
        rows = [[name, pass_at_1_text(r), f"{r['eval/tool_calls']:.2f}"]
                for name, r in record.get("heldout", {}).items()]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ParityError(f"{out / 'sft.json'}: its held-out results are damaged: rebuild it with "
                          "--force") from None
    if rows:
        print(table(["task", "held-out pass@1 (greedy)", "tool calls"], rows))
    print(f"trained in {record['train_s']:.0f} s; checkpoint: {out}")
    return 0


if __name__ == "__main__":  # a build in a fresh process (`sft_child.build`): PARENT OUT CONFIG EVAL_PROBLEMS
    _cfg = SFTConfig(**json.loads(sys.argv[3]))
    sys.exit(sft_child.child(int(sys.argv[1]), lambda: train_sft(
        sys.argv[2], _cfg, sft_child.progress_bar(_cfg.steps), eval_problems=int(sys.argv[4]))))
