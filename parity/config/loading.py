"""Configs in and out of TOML: files, dotted overrides (`--set learner.lr=3e-4`), dicts.

Every path into a `TrainConfig` goes through `config_from_dict`, which builds the dataclasses
recursively, checks values against the field types (`parity.fields`) and turns unknown keys and
bad values into one-line `ConfigError`s. `with_overrides` is the programmatic form of `--set`;
`revalidated` checks a config again as it stands (the controller does, when a run starts).
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..fields import check_value
from .learner import LossConfig
from .train import DERIVED_LEARNER_FIELDS, TrainConfig


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
        kwargs[name] = check_value(value, hint, key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


_LOSS_KEYS = frozenset(f.name for f in dataclasses.fields(LossConfig))
"""Loss parameters, which may also sit directly in the learner table."""


def set_dotted(data: dict, dotted: str, value: Any) -> dict:
    """Set `data["a"]["b"] = value` for `dotted = "a.b"` (creating tables); returns `data`. A loss
    parameter spelled flat (`learner.ppo_eps`) is set where it lives (`learner.loss_config.ppo_eps`:
    beside a written config's loss table it was "unknown config key")."""
    parts = dotted.split(".")
    learner = data.get("learner")
    if len(parts) == 2 and parts[0] == "learner" and parts[1] in _LOSS_KEYS:
        parts.insert(1, "loss_config")
        if isinstance(learner, dict):  # (a file's own flat spelling would disagree with the override)
            learner.pop(parts[2], None)
    if parts == ["learner", "loss_config"] and isinstance(value, dict) and isinstance(learner, dict) \
            and isinstance(learner.get("loss_config"), dict):  # a table: merged, keys set before kept
        value = {**learner["loss_config"], **value}
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {p} is not a table")
    node[parts[-1]] = value
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=VALUE' -> ('a.b', value), VALUE read as a TOML literal (bare words are strings)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {text!r}: expected key=value (no key before '=')")
    if not all(part.strip() for part in key.split(".")):  # (was "unknown config key " naming nothing)
        raise ConfigError(f"--set {text!r}: a key is dotted names, as learner.lr")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from nested dicts (TOML tables). Loss parameters may sit directly
    in the learner table; the learner fields a run derives may be given only with their derived
    value (so a written config.toml reads back)."""
    data = dict(data)
    learner = data.get("learner")
    derived: dict[str, Any] = {}
    if isinstance(learner, dict):
        learner = dict(learner)
        derived = {k: learner.pop(k) for k in list(learner) if k in DERIVED_LEARNER_FIELDS}
        extra = {k: learner.pop(k) for k in list(learner) if k in _LOSS_KEYS}
        if extra:  # (beside a [learner.loss_config] table they were "unknown config key")
            nested = learner.get("loss_config", {})
            if not isinstance(nested, dict):
                raise ConfigError(f"learner.loss_config must be a table, got {nested!r}")
            clash = next((k for k in extra if k in nested and nested[k] != extra[k]), None)
            if clash:
                raise ConfigError(f"learner.{clash} = {extra[clash]!r} and learner.loss_config.{clash} = "
                                  f"{nested[clash]!r} disagree (set one)")
            learner["loss_config"] = {**nested, **extra}
        data["learner"] = learner
    cfg = _build(TrainConfig, data, "")
    for name, value in derived.items():
        if value != getattr(cfg.learner, name):
            raise ConfigError(f"learner.{name} = {value!r} disagrees with "
                              f"{DERIVED_LEARNER_FIELDS[name]} (set only the latter)")
    return cfg


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Nested dicts that `config_from_dict` turns back into an equal config (derived learner
    fields left out: they follow from the rest)."""
    data = dataclasses.asdict(cfg)
    for name in DERIVED_LEARNER_FIELDS:
        data["learner"].pop(name)
    return data


def revalidated(cfg: TrainConfig) -> TrainConfig:
    """`cfg` checked again as it stands now, as a new config: a field changed after construction
    (`cfg.rollout.temperature = 0.5`) is checked like any other, and the learner fields derived
    from it follow it (the learner scored at the old temperature: no log-prob matched)."""
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"expected a TrainConfig, got {type(cfg).__name__} (config_from_dict builds one "
                          "from nested dicts)")
    return config_from_dict(config_to_dict(cfg))


def with_overrides(cfg: TrainConfig, overrides: dict[str, Any] | list[str] = ()) -> TrainConfig:
    """A new, validated config: `cfg` with dotted keys set ({"learner.lr": 3e-4} or
    ["learner.lr=3e-4"] as on the command line)."""
    items = [parse_override(o) for o in overrides] if isinstance(overrides, list) else overrides.items()
    data = config_to_dict(cfg)
    for key, value in items:
        set_dotted(data, key, value)
    return config_from_dict(data)


MAX_CONFIG_BYTES = 1 << 20
"""The largest TOML file read (configs are a few KiB)."""


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a one-line ConfigError."""
    try:
        with open(path, "rb") as f:  # (at most MAX_CONFIG_BYTES: /dev/zero was read for good)
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB (not a {what})")
        return tomllib.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text (a TOML {what} is)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from None


def load_config(path: str | Path | None, overrides: list[str] | dict[str, Any] = ()) -> TrainConfig:
    """Read a TOML file (or start from defaults when None) and apply overrides: `key=value`
    strings as on the command line, or a {dotted key: value} dict."""
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides]
    for key, value in items:
        set_dotted(data, key, value)
    return config_from_dict(data)


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML (written into every run directory)."""
    lines: list[str] = []

    def emit(table: dict, prefix: str) -> None:
        if prefix:
            lines.append(f"\n[{prefix}]")
        for name, v in table.items():
            if v is not None and not isinstance(v, dict):
                lines.append(f"{_toml_key(name)} = {_toml_value(v)}")
        for name, v in table.items():
            if isinstance(v, dict):
                emit(v, f"{prefix}.{_toml_key(name)}" if prefix else _toml_key(name))

    emit(config_to_dict(cfg), "")
    return "\n".join(lines).lstrip() + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return _toml_string(str(v))


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes, and DEL escaped too (TOML forbids it raw; JSON does not)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _toml_string(name)
