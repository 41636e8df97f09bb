"""Your own prompts and reward: a JSONL file of problems, scored by a function you name.

    [task]
    name = "dataset"
    data = "data/train.jsonl"        # {"prompt": "...", "answer": "42", ...} per line
    reward = "exact"                 # or "rewards.py:score" -> score(response, problem) -> float

Each line is a JSON object with a `prompt` string (one user turn, rendered by the checkpoint's
chat template, or parity's own format when it has none) or `messages` (a list of
`{"role": ..., "content": ...}`, for a system prompt or few-shot turns; it needs a chat
template), and any other fields the reward reads. `reward = "exact"` compares the first line
after the response's last `answer:` (else its last non-empty line) with the problem's `answer`
field (`exact` below). A reward of 1 or more counts as solved for pass@1.

The held-out set is `task.heldout_data` when given (training problems with one of its prompts are
left out), else the `task.heldout_size` distinct prompts of `task.data` that a fixed hash ranks
first, the same for every run (a row added to the file moves at most one prompt in or out).
Training batches walk the rest in a fresh seeded order each epoch, so batch b's problems follow
from (seed, b) alone and a resumed run samples the batches it would have.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import math
import os
import random
import stat
import threading
from pathlib import Path

from ..errors import ConfigError, ParityError
from .answers import matches
from .base import Env, Episode, Turn
from .chat import prompt_ids, turn_text
from .custom import call_user, finite_number, load_object, one_line
from .math import HELDOUT_SEED, _stable_seed

log = logging.getLogger(__name__)

MAX_DATA_BYTES = 512 << 20
"""The largest JSONL file read (the problems are held in memory by every rollout process)."""
MAX_LINE_BYTES = 16 << 20
"""The longest line read (a file without newlines is not read whole to find out)."""


def read_problems(path: str, key: str, needs_answer: bool, lines: list[int] | None = None) -> list[dict]:
    """The problems of a JSONL file; a one-line ConfigError naming the line otherwise (`lines`
    gets each problem's line number)."""
    rows: list[dict] = []
    size = number = 0
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # (a FIFO's open waited for a writer for good)
            raise ConfigError(f"{key} {path}: not a regular file (a FIFO, device or directory): name a "
                              "JSONL file")
        with open(path, "rb") as f:
            while line := f.readline(MAX_LINE_BYTES + 1):
                number += 1
                size += len(line)
                if size > MAX_DATA_BYTES:
                    raise ConfigError(f"{key} {path}: larger than {MAX_DATA_BYTES >> 20} MiB")
                if len(line) > MAX_LINE_BYTES:
                    raise ConfigError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES >> 20} MiB")
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                if line.strip():
                    rows.append(_check_row(_parse(line, path, number), f"{path}:{number}", needs_answer))
                    if lines is not None:
                        lines.append(number)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path}: no such file (a relative path is read from the working "
                          "directory)") from None
    except IsADirectoryError:
        raise ConfigError(f"{key}: {path} is a directory, not a JSONL file") from None
    except OSError as exc:
        raise ConfigError(f"{key}: {path}: {exc.strerror or exc}") from None
    if not rows:
        raise ConfigError(f"{key} {path}: no problems (one JSON object per line)")
    return rows


def _parse(line: bytes, path: str, number: int):
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}:{number}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep, an integer of 4,300+ digits
        raise ConfigError(f"{path}:{number}: not readable JSON ({one_line(exc)})") from None


def _text(value, where: str, what: str, empty: bool = False) -> str:
    """`value` as a (non-empty) string a tokenizer can take (JSON escapes can spell lone surrogates)."""
    if not isinstance(value, str) or not (empty or value.strip()):
        raise ConfigError(f"{where}: {what} must be a {'' if empty else 'non-empty '}string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where}: {what} holds a lone surrogate (\\ud800-\\udfff), not text") from None
    return value


def _check_row(row, where: str, needs_answer: bool) -> dict:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if ("prompt" in row) == ("messages" in row):
        raise ConfigError(f"{where}: needs exactly one of 'prompt' (a string) and 'messages' (a list)")
    if "prompt" in row:
        _text(row["prompt"], where, "'prompt'")
    else:
        messages = row["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of objects with 'role' and "
                              "'content' strings")
        for m in messages:
            _text(m.get("content"), where, "a message's 'content'", empty=True)
    answer = row.get("answer")
    if needs_answer:
        if isinstance(answer, str):
            _text(answer, where, "'answer'")
        elif isinstance(answer, bool) or not isinstance(answer, (int, float)) or \
                not math.isfinite(answer):
            raise ConfigError(f"{where}: needs an 'answer' (a string or a finite number): task.reward = "
                              "'exact' compares with it")
    return row


def _check_call(fn, spec: str, sandbox: bool) -> None:
    """A reward function must take (response, problem) and, when it asks for it, sandbox= too."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call says
        return
    try:
        signature.bind("response", {}, **({"sandbox": None} if sandbox else {}))
    except TypeError as exc:
        raise ConfigError(f"task.reward {spec!r}: {one_line(exc)} (it is called as name(response, problem"
                          f"{', sandbox=...' if sandbox else ''}))") from None


def _takes(fn, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False


def _key(row: dict) -> str:
    return json.dumps(row.get("prompt", row.get("messages")), sort_keys=True, ensure_ascii=False)


def exact(response: str, problem: dict) -> float:
    """1.0 when the response's answer is the problem's `answer`, else 0.0, by the rule every
    built-in task reads answers with (`answers.py`): the first line after the last `answer:` (else
    the last non-empty line); a numeric `answer` (a JSON number, or a string that is one: `42`,
    `-3.5`, `1,234`, `1e3`) compared exactly with the first number on that line, any other with the
    whole line, ignoring case, runs of spaces and surrounding quotes and punctuation."""
    return float(matches(response, problem["answer"]))


class DatasetEnv(Env):
    """Single-turn problems from a JSONL file, scored by `exact` or a function of yours."""

    def __init__(self, tokenizer, data: str, reward: str | list[str] = "exact", seed: int = 0,
                 heldout_size: int = 200, heldout_data: str | None = None, max_prompt_tokens: int = 0,
                 reward_weights: list[float] | None = None, sandbox=None, vocab_size: int | None = None,
                 context: int | None = None):
        if tokenizer is None:
            raise ConfigError("task 'dataset' needs a tokenizer (model.checkpoint with a tokenizer.json)")
        self.tokenizer, self.seed = tokenizer, seed
        specs = reward if isinstance(reward, list) else [reward]
        self.rewards: list[tuple[str, str, object, float]] = []  # (name, spec, function, weight)
        self.sandbox = sandbox  # a TaskContext's sandbox(): for reward functions that take `sandbox`
        self._wants_sandbox: set[str] = set()
        for spec, weight in zip(specs, reward_weights or [1.0] * len(specs), strict=True):
            fn = exact if spec == "exact" else load_object(spec, "task.reward")
            if not callable(fn):
                raise ConfigError(f"task.reward {spec!r} is a {type(fn).__name__}, not a function")
            name = spec.rpartition(":")[2].rpartition(".")[2].removesuffix("_final")  # (resume drops *_final)
            taken = {n for n, *_ in self.rewards}
            name = next(f"{name}_{i}" for i in range(2, len(specs) + 2) if f"{name}_{i}" not in taken) \
                if name in taken else name
            self.rewards.append((name, spec, fn, float(weight)))
            if fn is not exact and _takes(fn, "sandbox"):
                self._wants_sandbox.add(name)
            _check_call(fn, spec, name in self._wants_sandbox)
        if self._wants_sandbox:  # made now: task.require_isolation refuses before anything is computed
            if self.sandbox is None:
                from .custom import TaskContext

                self.sandbox = TaskContext(tokenizer, 0, seed, heldout_size).sandbox
            self.sandbox()
        self.reward_spec = " + ".join(spec if w == 1 else f"{w:g} x {spec}" for _, spec, _, w in self.rewards)
        needs_answer = any(fn is exact for _, _, fn, _ in self.rewards)
        self.threaded = any(fn is not exact for _, _, fn, _ in self.rewards)  # yours may wait (a judge)
        numbers: tuple[list[int], list[int]] = ([], [])
        rows = read_problems(data, "task.data", needs_answer, numbers[0])
        held_rows = read_problems(heldout_data, "task.heldout_data", needs_answer, numbers[1]) \
            if heldout_data else None
        if any("messages" in r for r in rows + (held_rows or [])) and not tokenizer.chat_template:
            raise ConfigError("task.data: a problem gives 'messages', which needs a checkpoint with a chat "
                              "template; this tokenizer has none (give a 'prompt' string instead)")
        unk, unknown = getattr(tokenizer, "unk_token_id", None), 0  # (a character tokenizer's unknowns)
        sizes: list[list[int]] = [[], []]  # (each prompt's tokens, for task.max_prompt_tokens below)
        for path, part, lines, size in ((data, rows, numbers[0], sizes[0]),
                                        (heldout_data, held_rows or [], numbers[1], sizes[1])):
            for row, number in zip(part, lines):  # each prompt once, now: a bad row stopped the run at
                try:  # the batch that drew it, and again at each --resume (the order is fixed)
                    ids = self.prompt_ids(row)
                except ParityError as exc:
                    raise ConfigError(f"{path}:{number}: {exc}") from None
                if vocab_size is not None and ids and max(ids) >= vocab_size:
                    raise ConfigError(f"{path}:{number}: the prompt's token {max(ids)} is outside the "
                                      f"model's vocabulary ({vocab_size} ids): another model's tokenizer?")
                kept = not max_prompt_tokens or len(ids) <= max_prompt_tokens  # (else left out below)
                if context is not None and kept and len(ids) >= context:
                    raise ConfigError(f"{path}:{number}: the prompt's {len(ids):,} tokens leave no room to "
                                      f"generate in the model's context of {context:,} "
                                      "(task.max_prompt_tokens leaves such prompts out)")
                unknown += unk is not None and unk in ids
                size.append(len(ids))
        if unknown:
            log.warning("task.data: %d prompt(s) hold characters this tokenizer cannot spell; the model "
                        "sees them as %s", unknown, tokenizer.decode([unk]))
        self.too_long = 0
        if max_prompt_tokens:  # left out, as verl's filter_overlong_prompts does
            fits = [r for r, n in zip(rows, sizes[0]) if n <= max_prompt_tokens]
            held_fits = [r for r, n in zip(held_rows, sizes[1]) if n <= max_prompt_tokens] \
                if held_rows is not None else None
            self.too_long = len(rows) - len(fits) + (len(held_rows) - len(held_fits) if held_rows else 0)
            rows, held_rows = fits, held_fits
            if not rows:
                raise ConfigError(f"task.data {data}: no prompt fits task.max_prompt_tokens = "
                                  f"{max_prompt_tokens}")
        if held_rows is None:  # the distinct prompts ranked by a hash: a row added to the file moves at
            # most one prompt in or out of the held-out set (a shuffle seeded by the row count moved most)
            first: dict[str, dict] = {}
            for r in rows:
                first.setdefault(_key(r), r)
            if heldout_size >= len(first):
                raise ConfigError(f"task.heldout_size ({heldout_size}) leaves none of task.data's "
                                  f"{len(first)} distinct prompts to train on (lower it, or give "
                                  "task.heldout_data)")
            if heldout_size > len(first) // 4:
                log.warning("task.heldout_size = %d holds out %.0f%% of task.data's %d distinct prompts",
                            heldout_size, 100 * heldout_size / len(first), len(first))
            ranked = sorted(first, key=lambda k: _stable_seed("dataset-heldout", HELDOUT_SEED, k))
            held_rows = [first[k] for k in ranked[:heldout_size]]
        held = {_key(r) for r in held_rows}
        self._heldout = held_rows
        self._train = [r for r in rows if _key(r) not in held]
        self.left_out = len(rows) - len(self._train) - (0 if heldout_data else len(held_rows))
        if not self._train:
            raise ConfigError(f"task.data {data}: every problem's prompt is in the held-out set; none "
                              "is left to train on")
        if not self._heldout:
            raise ConfigError(f"task.heldout_data {heldout_data}: no prompt fits task.max_prompt_tokens = "
                              f"{max_prompt_tokens}: nothing to evaluate on")
        self.name = f"dataset-{Path(data).stem}"
        self._orders: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def _epoch(self, epoch: int) -> list[int]:
        """The training problems' order in `epoch` (the last few kept: a batch spans at most two)."""
        with self._lock:  # (problems() from several threads)
            order = self._orders.get(epoch)
            if order is None:
                rnd = random.Random(_stable_seed("dataset", self.seed, epoch))
                order = self._orders[epoch] = rnd.sample(range(len(self._train)), len(self._train))
                while len(self._orders) > 4:
                    del self._orders[next(iter(self._orders))]
            return order

    def problems(self, batch_index: int, n: int) -> list[dict]:
        out = []
        for i in range(batch_index * n, batch_index * n + n):
            epoch, position = divmod(i, len(self._train))
            out.append(copy.deepcopy(self._train[self._epoch(epoch)[position]]))
        return out  # (copies: a reward that edits its problem leaves the next epoch's as it was)

    def heldout(self, n: int | None = None) -> list[dict]:
        return copy.deepcopy(self._heldout[:n])

    def prompt_ids(self, problem: dict) -> list[int]:
        if "prompt" in problem:
            return prompt_ids(self.tokenizer, problem["prompt"])
        return self.tokenizer.apply_chat_template(problem["messages"], add_generation_prompt=True)

    def step(self, episode: Episode, turn_ids: list[int]) -> Turn:
        episode.turns += 1
        text = turn_text(self.tokenizer, turn_ids)
        episode.answered = "answer:" in text.lower()
        parts = {}
        for name, spec, fn, _ in self.rewards:
            if name in self._wants_sandbox:  # fn(response, problem, sandbox=...): runs code it is given there
                fn = functools.partial(fn, sandbox=self.sandbox())
            value = call_user(fn, (text, episode.problem), f"task.reward {spec}",
                              f" on a response to {_key(episode.problem)[:60]}")
            parts[name] = finite_number(value)
            if parts[name] is None:
                raise ParityError(f"task.reward {spec}: returned {repr(value)[:60]} for a response to "
                                  f"{_key(episode.problem)[:60]}; a reward is a finite number (float32) "
                                  "or true/false")
        if len(parts) > 1:  # each part logged as rollout/reward/<name> and eval/reward/<name>
            episode.info["metrics"] = {f"reward/{name}": value for name, value in parts.items()}
        total = sum(w * parts[name] for name, _, _, w in self.rewards)
        if finite_number(total) is None:  # (each part was checked; weights of 1e39 made the sum inf)
            weights = [w for *_, w in self.rewards]
            raise ParityError(f"task.reward_weights {weights} make a reward of {total:.4g} from parts "
                              f"{parts}: the weighted sum must be a finite number (float32)")
        episode.reward = total
        episode.passed = parts[self.rewards[0][0]] >= 1.0  # the first part decides (not a format bonus)
        return Turn(None, True, episode.reward)

    def describe(self) -> str:
        extra = f", {self.left_out} left out as held-out prompts" if self.left_out else ""
        extra += f", {self.too_long} over task.max_prompt_tokens left out" if self.too_long else ""
        return (f"task: {self.name} ({len(self._train)} training problems{extra}, {len(self._heldout)} "
                f"held out; reward {self.reward_spec})")
