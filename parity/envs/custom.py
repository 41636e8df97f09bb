"""Bring your own task: an environment or a reward function named in the config by import path.

`task.env = "mypkg.tasks:make_env"` (an installed or `PYTHONPATH` module) or
`task.env = "tasks/countdown.py:CountdownEnv"` (a file) names an `Env` subclass or a function
returning one; the run calls it as `name(ctx, **task.options)` with a `TaskContext` in every
process that needs the task (the learner's evaluation, each rollout worker, each Ray actor).
`task.reward` of the dataset task is named the same way (`parity.envs.dataset`).

The environment is user code, so what it returns is checked where it enters the run
(`CheckedEnv`): a problem count other than asked, a prompt id outside the vocabulary, a reward
that is not a finite number, problems that change from one call to the next (a resumed or
restarted run must sample the same batches), a method that raises. Each is a one-line
`ParityError` naming the task and the method, and the run stops at its last whole step with a
checkpoint, as on any failed step. An `OSError` passes as it is: a transient fault (a tool's
network, the sandbox) restarts a local rollout worker instead. `PARITY_DEBUG=1` shows the
traceback of the user code's exception.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import operator
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ParityError, SandboxFailure
from ..fields import is_file_spec
from .base import Env, Episode, Turn

log = logging.getLogger(__name__)


def _flag(value) -> bool:
    """Whether `value` is a truth value: a bool, NumPy's or an integer 0 or 1."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # (numpy.bool_ is no Integral)
        return True
    return isinstance(value, numbers.Integral) and value in (0, 1)


_LOADED: dict[str, Any] = {}
_LOCK = threading.Lock()


def load_object(spec: str, key: str):
    """The object `spec` names (a module imported once per process; a file loaded once, under a
    module name of its own so that its classes pickle); a one-line ConfigError when it cannot be."""
    where, _, name = spec.rpartition(":")
    with _LOCK:
        module = _LOADED.get(where)
        if module is None:
            module = _LOADED[where] = _import(where, key)
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} {spec!r}: {where} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def _import(where: str, key: str):
    if is_file_spec(where):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{key}: {where}: no such file (a relative path is read from the working "
                              "directory)")
        name = f"parity_task_{path.stem.replace('-', '_')}_{hashlib.sha256(where.encode()).hexdigest()[:10]}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{key}: {where}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if str(path.parent) not in sys.path:  # its neighbours import as a script's do
            sys.path.append(str(path.parent))
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:  # (a sys.exit() in it too: it would end the run without a word)
            sys.modules.pop(name, None)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ConfigError(f"{key}: importing {where} raised {one_line(exc)}") from exc
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and where.startswith(exc.name):
            raise ConfigError(f"{key}: no module named {exc.name!r} (install it, put its directory on "
                              "PYTHONPATH, or name a file: path/to/file.py:name)") from None
        raise ConfigError(f"{key}: importing {where} raised {one_line(exc)}") from exc
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise ConfigError(f"{key}: importing {where} raised {one_line(exc)}") from exc


def call_user(fn, args: tuple, where: str, context: str = ""):
    """`fn(*args)`, user code: what it raises is one line naming `where` (a ParityError; an OSError
    stays an OSError, a transient fault that restarts a local rollout worker; the sandbox's own
    failures and interrupts pass as they are; `PARITY_DEBUG=1` shows the traceback)."""
    try:
        return fn(*args)
    except (ParityError, SandboxFailure, KeyboardInterrupt):
        raise
    except OSError as exc:
        raise OSError(f"{where} raised {one_line(exc)}{context}") from exc
    except BaseException as exc:  # (a sys.exit() in a reward ended a worker without a word; an
        # asyncio.CancelledError from a judge was a traceback per worker restart)
        raise ParityError(f"{where} raised {one_line(exc)}{context}") from exc


FLOAT32_MAX = 3.4028234663852886e38  # (torch.finfo(torch.float32).max)


def finite_number(value, limit: float = FLOAT32_MAX) -> float | None:
    """A reward as a float (bools, NumPy scalars and one-element tensors too), or None when it is
    not a finite number of at most `limit` in size (float32's: the learner holds rewards in float32,
    1e39 was inf; metrics, averaged in Python floats, pass math.inf)."""
    if isinstance(value, str) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None
    return value if math.isfinite(value) and abs(value) <= limit else None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    text = text[0] if text else ""
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class TaskContext:
    """What a custom environment's factory is given besides `task.options`."""

    tokenizer: Any
    """The run's tokenizer (`parity.model.tokenizer.HFTokenizer`: encode, decode,
    apply_chat_template, eos_token_ids), or None for a random-init preset without one."""
    vocab_size: int
    """The model's vocabulary: every prompt and observation id must be below it."""
    seed: int
    """The run's seed (seed the training stream with it; keep the held-out set fixed)."""
    heldout_size: int
    """task.heldout_size: how many held-out problems evaluation may ask for."""
    require_isolation: bool = True
    """task.require_isolation (the sandbox refuses to run degraded)."""
    _sandbox: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def sandbox(self):
        """The run's sandbox for model-written code (`parity.envs.sandbox.Sandbox`: `run(code)` ->
        stdout, error, ok), made on first use. Never run model-written code in the host process."""
        with self._lock:
            if self._sandbox is None:
                from .sandbox import Sandbox

                self._sandbox = Sandbox(require_isolation=self.require_isolation)
                # what protects the host, said once per process as the tool task's start-up line does
                log.log(logging.INFO if self._sandbox.isolated else logging.WARNING, "%s",
                        self._sandbox.describe())
            return self._sandbox


def build_custom_env(spec: str, options: dict, ctx: TaskContext) -> CheckedEnv:
    """The environment `task.env` names, built with `task.options` and checked (`CheckedEnv`)."""
    factory = load_object(spec, "task.env")
    if not callable(factory):
        raise ConfigError(f"task.env {spec!r} is a {type(factory).__name__}, not a class or function")
    try:
        inspect.signature(factory).bind(ctx, **options)
    except TypeError as exc:
        raise ConfigError(f"task.env {spec!r}: {one_line(exc)} (it is called as name(ctx, **task.options))") \
            from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        env = factory(ctx, **options)
    except (ParityError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # (a sys.exit(0) in it ended train or eval silently, status 0)
        raise ConfigError(f"task.env {spec!r} raised {one_line(exc)}") from exc
    missing = [m for m in ("problems", "heldout", "prompt_ids", "step")
               if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"task.env {spec!r} returned a {type(env).__name__} without {', '.join(missing)} "
                          "(an environment subclasses parity.envs.base.Env)")
    return CheckedEnv(env, spec, ctx.vocab_size, ctx.tokenizer)


class CheckedEnv(Env):
    """A user environment behind checks: what it returns is checked, what it raises is one line."""

    def __init__(self, env, spec: str, vocab_size: int, tokenizer=None):
        self.env, self.spec, self.vocab_size = env, spec, vocab_size
        self.multi_turn = bool(getattr(env, "multi_turn", False))
        self.threaded = bool(getattr(env, "threaded", False))
        self.tokenizer = getattr(env, "tokenizer", None) or tokenizer  # (the engine's, for stop strings)
        name = getattr(env, "name", None)
        self.name = str(name) if name and name != Env.name else spec.rpartition(":")[2]
        if not self.heldout(1):
            raise ConfigError(f"task.env {spec!r}: heldout(1) returned no problem: nothing to evaluate on")
        first = [self.prompt_ids(p) for p in self.problems(0, 2)]
        again = [self.prompt_ids(p) for p in self.problems(0, 2)]
        if first != again:
            raise ConfigError(f"task.env {spec!r}: problems(0, 2) gave other prompts when called again; a "
                              "batch's problems must follow from (seed, batch index) alone, or a resumed or "
                              "restarted run trains on other problems than it sampled")

    def _call(self, method: str, *args):
        shown = ", ".join(repr(a) if isinstance(a, int) else type(a).__name__ for a in args)
        where = f"task {self.name} ({self.spec}): {method}({shown})"
        return call_user(getattr(self.env, method), args, where)

    def _fail(self, what: str) -> ParityError:
        return ParityError(f"task {self.name} ({self.spec}): {what}")

    def _ids(self, ids, what: str) -> list[int]:
        if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
            raise self._fail(f"{what} must be a list of token ids (integers), got {type(ids).__name__}")
        out = []
        for t in ids:
            try:
                out.append(operator.index(t))
            except TypeError:
                raise self._fail(f"{what} holds {t!r} ({type(t).__name__}); token ids are integers") from None
        bad = next((t for t in out if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise self._fail(f"{what} holds token id {bad}, outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        return out

    @property
    def stop_token_ids(self) -> list[int]:
        return self._ids(getattr(self.env, "stop_token_ids", []), "stop_token_ids")

    @property
    def stop_strings(self) -> list[str]:
        stops = getattr(self.env, "stop_strings", [])
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise self._fail(f"stop_strings must be a list of non-empty strings, got {stops!r:.60}")
        return list(stops)

    def problems(self, batch_index: int, n: int) -> list:
        out = self._call("problems", batch_index, n)
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{len(out)} problems" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
            raise self._fail(f"problems({batch_index}, {n}) returned {got}, expected a list of {n}")
        return list(out)

    def heldout(self, n: int | None = None) -> list:
        out = self._call("heldout", n)
        if not isinstance(out, (list, tuple)) or (n is not None and len(out) > n):
            raise self._fail(f"heldout({n}) must return a list of at most {n} problems")
        return list(out)

    def prompt_ids(self, problem) -> list[int]:
        ids = self._ids(self._call("prompt_ids", problem), "prompt_ids")
        if not ids:
            raise self._fail("prompt_ids returned an empty prompt")
        return ids

    def start(self, problem) -> Episode:
        episode = self._call("start", problem) if hasattr(self.env, "start") else Episode(problem)
        if not isinstance(episode, Episode):
            raise self._fail(f"start must return a parity.envs.base.Episode, got {type(episode).__name__}")
        return episode

    def step(self, episode: Episode, turn_ids: list[int]) -> Turn:
        turn = self._call("step", episode, turn_ids)
        if not isinstance(turn, Turn):
            raise self._fail(f"step must return a parity.envs.base.Turn, got {type(turn).__name__}")
        reward = finite_number(turn.reward)
        if reward is None:
            raise self._fail(f"step returned reward {turn.reward!r:.60}; a reward is a finite number "
                             "(float32)")
        self._check_metrics(episode)
        self._check_episode(episode)
        if not _flag(turn.done):
            raise self._fail(f"step returned done = {turn.done!r:.40}; done is True or False")
        if not turn.done:
            if not self.multi_turn:
                raise self._fail("step returned done = False, but the environment's multi_turn is False")
            observation = turn.observation if turn.observation is not None else []
            return Turn(self._ids(observation, "step's observation"), False, reward)
        if not getattr(episode, "_passed_set", True):  # the env never set it: solved = a reward of 1+
            episode.passed = reward >= 1.0
        return Turn(None, True, reward)

    def _check_episode(self, episode: Episode) -> None:
        """The figures every episode carries, as evaluation and the rollout metrics add them up:
        passed and answered True/False (or 0/1), the counts integers >= 0. A None or a string
        there was a traceback in `parity eval` and, in training, a worker crash restarted 3 times."""
        for name in ("passed", "answered"):
            value = getattr(episode, name)
            if not _flag(value):
                raise self._fail(f"episode.{name} = {value!r:.40}; it must be True or False")
            object.__setattr__(episode, name, bool(value))  # (not "set by the env" where it was not)
        for name in ("turns", "tool_calls", "tool_errors"):
            value = getattr(episode, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise self._fail(f"episode.{name} = {value!r:.40}; it must be an integer >= 0")

    def _check_metrics(self, episode: Episode) -> None:
        """The env's own per-episode figures (averaged as rollout/<name>, eval/<name>): names to
        finite numbers; a name ending in _final is the evaluation at a run's end's (a resume drops it)."""
        metrics = episode.info.get("metrics")
        if metrics is None:
            return
        values = {k: finite_number(v, math.inf) for k, v in metrics.items()} \
            if isinstance(metrics, dict) else {}
        if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in values) \
                or None in values.values():
            raise self._fail(f"episode.info['metrics'] must map names to finite numbers, got {metrics!r:.80}")
        final = next((k for k in values if k.endswith("_final")), None)
        if final:
            raise self._fail(f"episode.info['metrics'] name {final!r}: names ending in _final are the "
                             "run's last evaluation's")
        episode.info["metrics"] = values

    def describe(self) -> str:
        own = getattr(type(self.env), "describe", Env.describe) is not Env.describe
        line = self._call("describe") if own and callable(getattr(self.env, "describe", None)) \
            else f"task: {self.name}"
        return f"{line} [{self.spec}]"
