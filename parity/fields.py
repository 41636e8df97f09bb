"""Strict field types for the configuration dataclasses, read from their annotations.

Every config (`ModelConfig`, `LearnerConfig`, the `TrainConfig` sections, `SamplingParams`)
calls `check_fields(self)` first in `__post_init__`, and the TOML loader checks each value with
`check_value` under its dotted key, so a value of the wrong type is one line naming the field
whichever way the config was built: `"false"` is not a bool, `2.5` not an int, `"1e-3"` not a
number, a dict not a `LearnerConfig`. Integers are taken where numbers are (as floats), NumPy
scalars as the Python numbers they hold, paths as strings; nothing else is converted.

Two field kinds of the user's tasks are checked here too: an import spec ('module:name' or
'path/to/file.py:name', `check_spec`) and a table of TOML values (`check_options`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

from .errors import ConfigError

_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          dict: "a table (dict)"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def describe(hint) -> str:
    """What a value of type `hint` is, in words ('a list of integers')."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        words = [describe(a) for a in args if a is not type(None)]
        return " or ".join(words) + (" or None" if type(None) in args else "")
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        if origin is tuple and inner and Ellipsis not in args:
            return f"{len(inner)} values ({', '.join(describe(a) for a in inner)})"
        return "a list" + (f" of {describe(inner[0]).split(' ', 1)[-1]}s" if inner else "")
    if origin is dict:
        return _NAMES[dict]
    if dataclasses.is_dataclass(hint):
        return f"a {hint.__name__}"
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


class _Mismatch(Exception):
    pass


def _convert(value, hint):
    """`value` as type `hint` (ints as floats, NumPy scalars as Python numbers); _Mismatch if it
    is not one."""
    if hint is Any or hint is typing.Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for alternative in args:
            if alternative is type(None):
                continue
            try:
                return _convert(value, alternative)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if origin is tuple and args and Ellipsis not in args:
            if len(value) != len(args):
                raise _Mismatch
            return tuple(_convert(v, a) for v, a in zip(value, args))
        inner = args[0] if args else Any
        return origin(_convert(v, inner) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _Mismatch
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _Mismatch
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _Mismatch
        return float(value)
    if hint is str:
        if isinstance(value, os.PathLike):  # run_dir=Path(...)
            return os.fspath(value)
        if not isinstance(value, str):
            raise _Mismatch
        return value
    if isinstance(hint, type):
        if not isinstance(value, hint):
            raise _Mismatch
        return value
    return value  # an annotation this module does not read


def check_value(value, hint, key: str, error: type[Exception] = ConfigError):
    """`value` checked against `hint` (converted as the module docstring says); `error` naming
    `key` otherwise."""
    try:
        return _convert(value, hint)
    except _Mismatch:
        pass
    shown = type(value).__name__ if dataclasses.is_dataclass(hint) or isinstance(value, dict) else repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    hint_text = ""
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        hint_text = " (parity.config.config_from_dict builds a whole config from nested dicts)"
    raise error(f"{key} must be {describe(hint)}, got {shown}{hint_text}") from None


def known_keywords(error: type[Exception] = ConfigError):
    """Class decorator (above `@dataclass`): an unknown keyword, or too many positional values,
    is `error` naming the class and the field (with the nearest field's name) instead of Python's
    TypeError, whichever way the object is built (`cls(...)`, `dataclasses.replace`)."""
    def wrap(cls):
        init, names = cls.__init__, [f.name for f in dataclasses.fields(cls) if f.init]

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            unknown = [k for k in kwargs if k not in names]
            if unknown:
                near = difflib.get_close_matches(unknown[0], names, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise error(f"unknown {type(self).__name__} field(s): {', '.join(unknown)}{hint}")
            if len(args) > len(names):
                raise error(f"{type(self).__name__} takes at most {len(names)} values, got {len(args)}")
            init(self, *args, **kwargs)
        cls.__init__ = __init__
        return cls
    return wrap


def check_fields(obj, error: type[Exception] = ConfigError, prefix: str | None = None,
                 finite: bool = False) -> None:
    """Check (and convert in place) every field of dataclass `obj` against its annotation;
    `error` names the first that does not fit, as `prefix.field` (the class name by default).
    `finite`: a NaN or an infinity in a number field (or a tuple of them) is refused too (they
    pass every comparison a range check makes: ppo_eps = inf turned clipping off)."""
    prefix = type(obj).__name__ if prefix is None else prefix
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        converted = check_value(value, hints[f.name], f"{prefix}.{f.name}", error)
        if converted is not value:
            object.__setattr__(obj, f.name, converted)
        values = converted if isinstance(converted, (list, tuple)) else [converted]
        if finite and any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise error(f"{prefix}.{f.name} must be finite, got {converted!r}")


def check_spec(spec: str, key: str) -> str:
    """`spec` ('module:name' or 'file.py:name') with a file's path made absolute (every process
    of the run, whatever its working directory, reads the same file); a ConfigError otherwise."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where.strip() or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
        raise ConfigError(f"{key} must be 'module:name' or 'path/to/file.py:name', got {spec!r}")
    if is_file_spec(where):
        return f"{Path(where).expanduser().absolute()}:{name}"
    return spec


def check_options(options: dict, key: str) -> None:
    """`options` must be what a TOML table holds (strings, numbers, booleans, lists and tables;
    no None or dates): the run writes it into config.toml and its checkpoints."""
    if isinstance(options, dict):
        for name, value in options.items():
            if not isinstance(name, str):
                raise ConfigError(f"{key}: keys must be strings, got {name!r}")
            check_options(value, f"{key}.{name}")
    elif isinstance(options, (list, tuple)):
        for i, value in enumerate(options):
            check_options(value, f"{key}[{i}]")
    elif not isinstance(options, (str, int, float, bool)):
        raise ConfigError(f"{key} must be a string, number, boolean, list or table, got "
                          f"{type(options).__name__}")
    elif isinstance(options, float) and not math.isfinite(options):  # (NaN != NaN: read as changed)
        raise ConfigError(f"{key} must be finite, got {options!r}")
    elif isinstance(options, int) and not -2**63 <= options < 2**63:  # what TOML can read back
        raise ConfigError(f"{key} must fit in 64 bits, got {options}")


def is_file_spec(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where
