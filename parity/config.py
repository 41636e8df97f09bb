"""Run configuration: dataclasses with a docstring per field, loaded from TOML with dotted
overrides (`--set learner.lr=3e-4`), validated on construction. Unknown keys are errors."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .errors import ConfigError
from .rl.learner import LearnerConfig
from .rl.losses import LossConfig


@dataclass
class ModelSection:
    """Which model the run trains."""

    preset: str = "small"
    """Random-init preset ('tiny' or 'small') when no checkpoint is given."""
    checkpoint: str | None = None
    """A checkpoint directory to start from (overrides `preset`); "base" is the cached base
    policy of `parity sft` (built on first use)."""
    kernels: str = "aligned"
    """'aligned' (bitwise rollout = learner) or 'standard' (the baseline)."""
    dtype: str = "float32"
    """Engine and learner compute dtype: 'float32' or 'bfloat16'."""
    seed: int = 0
    """Seed of the random init."""

    def __post_init__(self) -> None:
        if self.kernels not in ("aligned", "standard"):
            raise ConfigError(f"model.kernels must be 'aligned' or 'standard', got {self.kernels!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")


@dataclass
class RolloutSection:
    """How the engine samples."""

    prompts_per_step: int = 8
    """Prompts per learner step; each is answered `group_size` times."""
    group_size: int = 4
    """Responses per prompt (the group whose mean reward is the baseline)."""
    max_tokens: int = 32
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (the learner scores at the same temperature)."""
    max_num_seqs: int = 64
    """Sequences in flight in the engine."""
    weight_update: str = "drain"
    """'drain' (finish on old weights, then load) or 'inflight' (switch between tokens)."""
    lengths: str = "fixed"
    """'fixed': every response runs to max_tokens; 'geometric': each request's limit is drawn
    from a geometric distribution with mean max_tokens / 4 (a long tail of response lengths)."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1")
        if not self.temperature > 0:
            raise ConfigError("rollout.temperature must be > 0")
        if self.lengths not in ("fixed", "geometric"):
            raise ConfigError(f"rollout.lengths must be 'fixed' or 'geometric', got {self.lengths!r}")
        if self.weight_update not in ("drain", "inflight"):
            raise ConfigError(f"rollout.weight_update must be 'drain' or 'inflight', "
                              f"got {self.weight_update!r}")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass
class TaskSection:
    """The environment rewards come from."""

    name: str = "target_tokens"
    """'tool' (multi-turn arithmetic with a sandboxed Python tool), 'math' (single-turn exact
    answers) or 'target_tokens' (a toy for the plumbing; works from a random init). The text
    tasks need a checkpoint with a tokenizer.json (model.checkpoint = "base" is the cached base
    policy of `parity sft`)."""
    targets: list[int] = field(default_factory=lambda: [7])
    """target_tokens: reward = fraction of response tokens that are one of these ids."""
    prompt_len: int = 8
    """target_tokens: prompt length in tokens."""
    kinds: list[str] = field(default_factory=lambda: ["mul", "sum"])
    """tool: problem kinds ('mul': large products, 'sum': sums of many numbers)."""
    level: int = 2
    """tool (1..3) or math (1..5): difficulty."""
    max_tool_calls: int = 3
    """tool: tool calls allowed per episode."""
    math_task: str = "add"
    """math: add, sub, mul, expr or countdown."""
    heldout_size: int = 200
    """Size of the fixed held-out set problems are kept out of (evaluation uses its first
    `eval_prompts`)."""

    def __post_init__(self) -> None:
        if self.name not in TASK_NAMES:
            raise ConfigError(f"unknown task {self.name!r}: expected one of {', '.join(TASK_NAMES)}")
        if self.prompt_len < 1 or not self.targets:
            raise ConfigError("task.prompt_len must be >= 1 and task.targets non-empty")
        if self.heldout_size < 1 or self.max_tool_calls < 1:
            raise ConfigError("task.heldout_size and task.max_tool_calls must be >= 1")


TASK_NAMES = ("tool", "math", "target_tokens")


@dataclass
class TrainConfig:
    """A whole training run."""

    steps: int = 20
    """Learner steps (optimizer updates)."""
    max_policy_lag: int = 0
    """0 = synchronous on-policy; N = no sample is trained on more than N updates after the
    version that produced it (admission control: the rollout side waits, nothing is dropped)."""
    deterministic: bool = False
    """Fix the schedule logically: batch b is always sampled by version max(0, b - lag)."""
    seed: int = 0
    """Seed of prompts and sampling."""
    run_dir: str = "runs/default"
    """Where config.toml, metrics.jsonl and checkpoints go."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    eval_every: int = 10
    """Greedy evaluation on the held-out prompts before steps 0, N, 2N, ... and at the end
    (0 = never)."""
    eval_prompts: int = 32
    """Held-out problems per evaluation (greedy pass@1)."""
    eval_samples: int = 0
    """k > 0 adds mean@k (k samples per held-out problem at the rollout temperature)."""
    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    task: TaskSection = field(default_factory=TaskSection)
    learner: LearnerConfig = field(default_factory=LearnerConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("steps must be >= 1")
        if self.max_policy_lag < 0:
            raise ConfigError(f"max_policy_lag must be >= 0, got {self.max_policy_lag}")
        if self.checkpoint_every < 0 or self.eval_every < 0 or self.eval_prompts < 1 or self.eval_samples < 0:
            raise ConfigError("checkpoint_every, eval_every and eval_samples must be >= 0, eval_prompts >= 1")
        if self.task.name != "target_tokens" and not self.model.checkpoint:
            raise ConfigError(f"task {self.task.name!r} needs model.checkpoint with a tokenizer.json "
                              "(\"base\" = the base policy of parity sft)")
        if self.deterministic and self.rollout.weight_update == "inflight":
            raise ConfigError("deterministic = true needs rollout.weight_update = 'drain' "
                              "(in-flight updates land at wall-clock-dependent tokens)")
        # the learner scores at the rollout's temperature and computes in the model's dtype, and
        # keeps the weights of every version a lagged sample may come from
        if self.learner.temperature not in (1.0, self.rollout.temperature):
            raise ConfigError(f"learner.temperature={self.learner.temperature} differs from "
                              f"rollout.temperature={self.rollout.temperature} (set only the latter)")
        self.learner.temperature = self.rollout.temperature
        if self.learner.compute_dtype not in ("float32", self.model.dtype):
            raise ConfigError(f"learner.compute_dtype={self.learner.compute_dtype!r} differs from "
                              f"model.dtype={self.model.dtype!r} (set only the latter)")
        self.learner.compute_dtype = self.model.dtype
        self.learner.max_policy_lag = self.max_policy_lag


def _build(cls, data: dict[str, Any], where: str):
    """Dataclass `cls` from a dict, recursively; unknown keys and bad types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {where + '.' if where else ''}{unknown[0]}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        key = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
            continue
        kwargs[name] = _coerce(value, hint, key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _coerce(value, hint, key):
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is typing.Union or (origin is not None and type(None) in args):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key) if len(inner) == 1 else value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return origin(_coerce(v, args[0], key) for v in value) if args else origin(value)
    if hint in (int, float, str, bool):
        if isinstance(value, bool) != (hint is bool) or not isinstance(value, hint):
            raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {p} is not a table")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=VALUE' -> ('a.b', value), VALUE read as a TOML literal (bare words are strings)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    data = dict(data)
    learner = data.get("learner")
    if isinstance(learner, dict) and "loss_config" not in learner:
        loss_keys = {f.name for f in dataclasses.fields(LossConfig)}
        extra = {k: learner[k] for k in list(learner) if k in loss_keys}
        if extra:
            learner = {k: v for k, v in learner.items() if k not in extra}
            learner["loss_config"] = extra
            data["learner"] = learner
    return _build(TrainConfig, data, "")


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a one-line ConfigError."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a TOML file (or start from defaults when None) and apply `key=value` overrides."""
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    for item in overrides:
        _set_dotted(data, *parse_override(item))
    return config_from_dict(data)


def to_toml(cfg) -> str:
    """The resolved config as TOML (written into every run directory)."""
    lines: list[str] = []

    def emit(obj, prefix: str) -> None:
        scalars, tables = [], []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            (tables if dataclasses.is_dataclass(v) else scalars).append((f.name, v))
        if prefix:
            lines.append(f"\n[{prefix}]")
        for name, v in scalars:
            if v is None:
                continue
            lines.append(f"{name} = {_toml_value(v)}")
        for name, v in tables:
            emit(v, f"{prefix}.{name}" if prefix else name)

    emit(cfg, "")
    return "\n".join(lines).lstrip() + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
