"""Held-out problems no training saw: a check before `parity train` and `parity eval` run.

The tool and math tasks hold out the first `task.heldout_size` problems of a fixed stream and train
on the rest, so a held-out set larger than the one a checkpoint's training left out holds problems
it trained on (a review measured it: a run trained with 100 held out and evaluated on 200 scored 25
of its own training problems among the extra 100; `task.heldout_size = 500` on a base policy
evaluated 300 sums its fine-tuning had used, 212 of them verbatim). `parity sft` leaves out the
tasks' default 200; a run leaves out its own `task.heldout_size`, after what its start left out.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import TrainConfig
from ..config.loading import read_toml
from ..errors import ConfigError
from .sft import RECIPES, base_dir, names_recipe

SFT_HELDOUT = 200
"""Problems of each task `parity sft` leaves out of a base policy's fine-tuning (the tasks' default
held-out size, which its `MathTask` and `ToolEnv` use)."""


def _identity(task: dict) -> tuple | None:
    """What fixes a task's held-out stream: its name, level and kind(s); a dataset's file and
    whether its held-out set is a file of its own; None for other tasks (a custom environment's
    `heldout` is its author's)."""
    if task.get("name") == "math":
        return "math", task.get("math_task", "add"), task.get("level", 1)
    if task.get("name") == "tool":
        return "tool", tuple(sorted(task.get("kinds", ["mul", "sum"]))), task.get("level", 1)
    if task.get("name") == "dataset":
        return "dataset", task.get("data"), task.get("heldout_data")
    return None


def _trainings(path: Path, depth: int = 0):
    """(task identity, problems left out, what trained) for the trainings behind checkpoint `path`."""
    sft = path / "sft.json"
    if sft.is_file():
        try:
            c = json.loads(sft.read_text())["config"]
            if c.get("tool_fraction", 1.0) < 1.0:
                yield _identity({"name": "math", "math_task": c["math_task"], "level": c["math_level"]}), \
                    SFT_HELDOUT, f"the base policy's fine-tuning ({path})"
            if c.get("tool_fraction", 1.0) > 0.0:
                yield _identity({"name": "tool", "kinds": list(c["tool_use"]), "level": c["tool_level"]}), \
                    SFT_HELDOUT, f"the base policy's fine-tuning ({path})"
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # (not parity sft's record: nothing known about its training)
    run_config = path.parent / "config.toml"
    if path.name.startswith("checkpoint-") and run_config.is_file() and depth < 8:
        try:
            run = read_toml(run_config)
        except ConfigError:
            return
        task = run.get("task", {})
        yield _identity(task), task.get("heldout_size", 200), f"the run in {path.parent}"
        if task.get("name") == "dataset" and not task.get("heldout_data"):  # (its prompt filter, below)
            yield ("dataset-filter", task.get("data")), task.get("max_prompt_tokens", 0), \
                f"the run in {path.parent}"
        start = run.get("model", {}).get("checkpoint")
        if isinstance(start, str) and start:
            yield from _trainings(base_dir(RECIPES[start]) if names_recipe(start) else Path(start), depth + 1)


def check_unseen(cfg: TrainConfig) -> None:
    """Refuse a held-out set of the tool, math or dataset task that holds problems the training behind
    `cfg.model.checkpoint` (a base policy, a run's checkpoint and where that run started) trained
    on: a larger one than it left out of the same task, a dataset's hash-ranked one where it held
    out a file of its own or filtered prompts by length less strictly (shorter prompts then move
    up into the held-out set)."""
    t = cfg.task
    task = {"name": t.name, "math_task": t.math_task, "level": t.level, "kinds": list(t.kinds),
            "data": t.data, "heldout_data": t.heldout_data}
    mine = _identity(task)
    if mine is None or not cfg.model.checkpoint or (t.name == "dataset" and t.heldout_data):
        return  # (a held-out file: the run left out of task.data every prompt it holds)
    for identity, left_out, what in _trainings(Path(cfg.model.checkpoint)):
        if t.name == "dataset" and identity and identity[0] == "dataset" and identity[1] == t.data \
                and identity[2]:
            raise ConfigError(f"{what} held out task.heldout_data {identity[2]} and trained on every other "
                              f"prompt of task.data: evaluate on that file (task.heldout_data)")
        if identity == ("dataset-filter", t.data):  # (left_out: that run's task.max_prompt_tokens)
            if t.max_prompt_tokens and (not left_out or t.max_prompt_tokens < left_out):
                raise ConfigError(f"task.max_prompt_tokens {t.max_prompt_tokens} leaves out prompts {what} "
                                  f"kept (its task.max_prompt_tokens: {left_out}): its training prompts "
                                  f"move up into the held-out set (use {left_out or 0}"
                                  f"{' or more' if left_out else ''})")
            continue
        if identity == mine and t.heldout_size > left_out:
            raise ConfigError(f"task.heldout_size {cfg.task.heldout_size} exceeds the {left_out} held-out "
                              f"problems {what} left out of this task: its problems {left_out}.."
                              f"{cfg.task.heldout_size - 1} were training problems (use at most {left_out})")
