"""The `[task]` table: which environment rewards come from, and its settings (built-in tasks,
your JSONL dataset, or your own environment), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..fields import check_fields, check_options, check_spec, known_keywords
from ..model.chat_template import CALLER_VARIABLES

TASK_NAMES: tuple[str, ...] = ("tool", "math", "target_tokens", "dataset", "custom")
"""Environments a run can train on ('dataset' and 'custom' are the user's: `parity.envs.dataset`,
`parity.envs.custom`)."""


def as_bool(value):
    """`value`, or the boolean a string spells in any case ('False' from `--set ...=False`)."""
    return {"true": True, "false": False}.get(value.lower(), value) if isinstance(value, str) else value


MAX_PROBLEMS = 100_000
"""The most problems a held-out set or one evaluation may hold (each is generated up front, all
at once; the text tasks' evaluations are also bounded by `task.heldout_size`)."""


@known_keywords()
@dataclass
class TaskSection:
    """The environment rewards come from."""

    name: str = "target_tokens"
    """'tool' (multi-turn arithmetic with a sandboxed Python tool), 'math' (single-turn exact
    answers), 'target_tokens' (a toy for the plumbing; works from a random init), 'dataset' (your
    prompts from a JSONL file, your reward) or 'custom' (your environment, `task.env`). The text
    tasks need a checkpoint with a tokenizer.json (model.checkpoint = "base" is the cached base
    policy of `parity sft`)."""
    targets: list[int] = field(default_factory=lambda: [7])
    """target_tokens: reward = fraction of response tokens that are one of these ids."""
    prompt_len: int = 8
    """target_tokens: prompt length in tokens."""
    kinds: list[str] = field(default_factory=lambda: ["mul", "sum"])
    """tool: problem kinds ('mul': large products, 'sum': sums of many numbers)."""
    level: int = 1
    """tool (1..3) or math (1..5): difficulty (1 is the level `parity sft`'s base policies
    learned, so `parity eval --model base` scores them where they were trained)."""
    max_tool_calls: int = 3
    """tool: tool calls allowed per episode."""
    math_task: str = "add"
    """math: add, sub, mul, expr or countdown."""
    heldout_size: int = 200
    """Size of the fixed held-out set problems are kept out of (evaluation uses its first
    `eval_prompts`)."""
    tokenizer: str | None = None
    """The text tasks' tokenizer.json (default: the one in model.checkpoint's directory; a
    resume whose starting checkpoint went sets it to the run checkpoint's copy)."""
    data: str | None = None
    """dataset: a JSONL file of problems, one JSON object per line with a 'prompt' string (or
    'messages', a chat) and the fields the reward reads ('answer' for 'exact')."""
    heldout_data: str | None = None
    """dataset: a JSONL file of held-out problems (default: the task.heldout_size distinct prompts
    of task.data a fixed hash ranks first, kept out of training)."""
    reward: str | list[str] = "exact"
    """dataset: 'exact' (the response's answer equals the problem's 'answer') or a function
    'module:name' / 'path/to/file.py:name', called as name(response_text, problem_dict) -> a
    number (a reward >= 1 counts as solved for pass@1), on several threads at once (with a
    `sandbox=` parameter it is given the run's sandbox, for the model's code); or a list of
    these, summed with task.reward_weights (each part is logged as rollout/reward/<name>; the
    first part alone decides pass@1, so a format bonus does not count a wrong answer solved)."""
    reward_weights: list[float] = field(default_factory=list)
    """dataset: one weight per task.reward entry (default: 1 each)."""
    max_prompt_tokens: int = 0
    """dataset: problems whose prompt is longer (in tokens) are left out at start-up (0: none are;
    a prompt too long for the model then stops the run)."""
    env: str | None = None
    """custom: your environment, 'module:name' or 'path/to/file.py:name': an Env subclass (or a
    function returning an Env) called as name(ctx, **task.options) with a
    `parity.envs.custom.TaskContext` in every process of the run."""
    options: dict = field(default_factory=dict)
    """custom: keyword arguments for task.env (a TOML table, [task.options])."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Keyword arguments for the checkpoint's chat template wherever a task renders a prompt with
    it (a TOML table, [task.chat_template_kwargs]; e.g. enable_thinking = false for Qwen3, as
    transformers' `apply_chat_template(..., enable_thinking=False)`; a string spelling true or
    false in any case is that boolean: the string is true to the template). Needs a chat template."""
    require_isolation: bool = True
    """tool, and your own tasks' sandbox: refuse, at start-up, to run model-written code where the
    sandbox cannot isolate it (namespaces, a private read-only root, no network). False: there it
    runs in the degraded sandbox, a separate process with rlimits and an empty environment but no
    filesystem or network isolation, under a per-run uid where the run is root and Python is open to
    other uids, else under the run's own uid (as root: root without capabilities, which can read and
    write every file root owns); the start-up line says which in capitals."""

    def __post_init__(self) -> None:
        check_fields(self, prefix="task")
        if self.name not in TASK_NAMES:
            raise ConfigError(f"unknown task {self.name!r}: expected one of {', '.join(TASK_NAMES)}")
        if self.prompt_len < 1 or not self.targets:
            raise ConfigError("task.prompt_len must be >= 1 and task.targets non-empty")
        if self.max_prompt_tokens < 0:
            raise ConfigError(f"task.max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")
        for key in ("heldout_size", "max_tool_calls"):
            if getattr(self, key) < 1:
                raise ConfigError(f"task.{key} must be >= 1, got {getattr(self, key)}")
        top = {"tool": 3, "math": 5}.get(self.name)  # (checked here: `parity eval` built the base first)
        if top and not 1 <= self.level <= top:
            raise ConfigError(f"{self.name} task level must be 1..{top}, got {self.level}")
        if self.heldout_size > MAX_PROBLEMS:
            raise ConfigError(f"task.heldout_size must be at most {MAX_PROBLEMS:,}, "
                              f"got {self.heldout_size:,}")
        self._check_user_task()

    def _check_user_task(self) -> None:
        mine = {"data": "dataset", "heldout_data": "dataset", "max_prompt_tokens": "dataset", "env": "custom",
                "options": "custom"}
        for key, task in mine.items():
            if getattr(self, key) and self.name != task:
                raise ConfigError(f"task.{key} is for task.name = {task!r} (this run's task is "
                                  f"{self.name!r})")
        owned = {"targets": ("target_tokens",), "prompt_len": ("target_tokens",), "kinds": ("tool",),
                 "max_tool_calls": ("tool",), "math_task": ("math",), "level": ("tool", "math")}
        defaults = TaskSection.__dataclass_fields__
        for key, tasks in owned.items():  # set for another task: it would be ignored without a word
            default = defaults[key].default_factory() if callable(defaults[key].default_factory) \
                else defaults[key].default
            if getattr(self, key) != default and self.name not in tasks:
                raise ConfigError(f"task.{key} is for task.name = {' or '.join(map(repr, tasks))} (this "
                                  f"run's task is {self.name!r})")
        if (self.reward != "exact" or self.reward_weights) and self.name != "dataset":
            raise ConfigError(f"task.reward is for task.name = 'dataset' (this run's task is {self.name!r})")
        rewards = self.reward if isinstance(self.reward, list) else [self.reward]
        if not rewards:
            raise ConfigError("task.reward must not be an empty list")
        if self.reward_weights and len(self.reward_weights) != len(rewards):
            raise ConfigError(f"task.reward_weights must give one weight per task.reward entry "
                              f"({len(rewards)}), got {len(self.reward_weights)}")
        if not all(math.isfinite(w) for w in self.reward_weights):
            raise ConfigError(f"task.reward_weights must be finite, got {self.reward_weights}")
        if self.name == "dataset" and not self.data:
            raise ConfigError("task 'dataset' needs task.data, a JSONL file of problems")
        if self.name == "custom" and not self.env:
            raise ConfigError("task 'custom' needs task.env = 'module:name' or 'path/to/file.py:name'")
        for key in ("data", "heldout_data"):  # absolute: every process reads the same file
            if getattr(self, key):
                setattr(self, key, str(Path(getattr(self, key)).expanduser().absolute()))
        if self.env:
            self.env = check_spec(self.env, "task.env")
        checked = [r if r == "exact" else check_spec(r, "task.reward") for r in rewards]
        self.reward = checked if len(checked) > 1 else checked[0]  # ["exact"] is "exact"
        check_options(self.options, "task.options")
        check_options(self.chat_template_kwargs, "task.chat_template_kwargs")
        self.chat_template_kwargs = {k: as_bool(v) for k, v in self.chat_template_kwargs.items()}
        fixed = sorted(set(CALLER_VARIABLES) & set(self.chat_template_kwargs))
        if fixed:
            raise ConfigError(f"task.chat_template_kwargs.{fixed[0]} is set by the task itself")
        if self.chat_template_kwargs and self.name == "target_tokens":
            raise ConfigError("task.chat_template_kwargs is for the text tasks (this run's task is "
                              "'target_tokens', which renders no chat)")
