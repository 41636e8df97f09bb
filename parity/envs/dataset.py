"""Your own prompts and reward: a JSONL file of problems, scored by a function you name.

    [task]
    name = "dataset"
    data = "data/train.jsonl"        # {"prompt": "...", "answer": "42", ...} per line
    reward = "exact"                 # or "rewards.py:score" -> score(response, problem) -> float

Each line is a JSON object with a `prompt` string (one user turn, rendered by the checkpoint's
chat template, or parity's own format when it has none) or `messages` (a list of
`{"role": ..., "content": ...}`, for a system prompt or few-shot turns; it needs a chat
template), and any other fields the reward reads. `reward = "exact"` compares the text after
the response's last `answer:` (else its last line) with the problem's `answer` field: as numbers
when the answer is a number, else as text, ignoring case and surrounding spaces. A reward of 1
or more counts as solved for pass@1.

The held-out set is `task.heldout_data` when given (training problems with one of its prompts are
left out), else `task.heldout_size` problems drawn from `task.data` by a fixed seed, the same for
every run. Training batches walk the rest in a fresh seeded order each epoch, so batch b's
problems follow from (seed, b) alone and a resumed run samples the batches it would have.
"""

from __future__ import annotations

import json
import math
import numbers
import random
import re
from pathlib import Path

from ..errors import ConfigError, ParityError
from .base import Env, Episode, Turn
from .chat import prompt_ids, turn_text
from .custom import load_object, one_line
from .math import HELDOUT_SEED, _stable_seed, extract_answer

MAX_DATA_BYTES = 512 << 20
"""The largest JSONL file read (the problems are held in memory by every rollout process)."""


def read_problems(path: str, key: str, needs_answer: bool) -> list[dict]:
    """The problems of a JSONL file; a one-line ConfigError naming the line otherwise."""
    rows: list[dict] = []
    size = 0
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                size += len(line)
                if size > MAX_DATA_BYTES:
                    raise ConfigError(f"{key} {path}: larger than {MAX_DATA_BYTES >> 20} MiB")
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                if not line.strip():
                    continue
                rows.append(_check_row(_parse(line, path, number), path, number, needs_answer))
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path}: no such file") from None
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


def _check_row(row, path: str, number: int, needs_answer: bool) -> dict:
    where = f"{path}:{number}"
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if ("prompt" in row) == ("messages" in row):
        raise ConfigError(f"{where}: needs exactly one of 'prompt' (a string) and 'messages' (a list)")
    if "prompt" in row and not (isinstance(row["prompt"], str) and row["prompt"].strip()):
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string")
    messages = row.get("messages")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of objects with 'role' and "
                          "'content' strings")
    answer = row.get("answer")
    if needs_answer and (not isinstance(answer, (str, int, float)) or isinstance(answer, bool)):
        raise ConfigError(f"{where}: needs an 'answer' (a string or a number): task.reward = 'exact' "
                          "compares with it")
    return row


def _key(row: dict) -> str:
    return json.dumps(row.get("prompt", row.get("messages")), sort_keys=True, ensure_ascii=False)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def exact(response: str, problem: dict) -> float:
    """1.0 when the response's answer is the problem's `answer`, else 0.0 (see the module)."""
    text = extract_answer(response)
    answer = problem["answer"]
    if isinstance(answer, numbers.Real) or _NUMBER.fullmatch(str(answer).strip().replace(",", "")):
        found = _NUMBER.findall(text.replace(",", ""))
        return float(bool(found) and math.isclose(float(found[-1]), float(str(answer).replace(",", "")),
                                                  rel_tol=1e-9, abs_tol=1e-12))
    norm = " ".join(text.strip().rstrip(".").split()).casefold()
    return float(norm == " ".join(str(answer).strip().rstrip(".").split()).casefold())


class DatasetEnv(Env):
    """Single-turn problems from a JSONL file, scored by `exact` or a function of yours."""

    def __init__(self, tokenizer, data: str, reward: str = "exact", seed: int = 0,
                 heldout_size: int = 200, heldout_data: str | None = None):
        if tokenizer is None:
            raise ConfigError("task 'dataset' needs a tokenizer (model.checkpoint with a tokenizer.json)")
        self.tokenizer, self.seed, self.reward_spec = tokenizer, seed, reward
        needs_answer = reward == "exact"
        if needs_answer:
            self.reward_fn = exact
        else:
            self.reward_fn = load_object(reward, "task.reward")
            if not callable(self.reward_fn):
                raise ConfigError(f"task.reward {reward!r} is a {type(self.reward_fn).__name__}, "
                                  "not a function")
        rows = read_problems(data, "task.data", needs_answer)
        if heldout_data:
            self._heldout = read_problems(heldout_data, "task.heldout_data", needs_answer)
            held = {_key(r) for r in self._heldout}
            self._train = [r for r in rows if _key(r) not in held]
            self.left_out = len(rows) - len(self._train)
        else:
            order = random.Random(_stable_seed("dataset", HELDOUT_SEED, len(rows))).sample(range(len(rows)),
                                                                                          len(rows))
            if heldout_size >= len(rows):
                raise ConfigError(f"task.heldout_size ({heldout_size}) leaves none of task.data's "
                                  f"{len(rows)} problems to train on (lower it, or give task.heldout_data)")
            self._heldout = [rows[i] for i in order[:heldout_size]]
            held = {_key(r) for r in self._heldout}
            self._train = [rows[i] for i in order[heldout_size:] if _key(rows[i]) not in held]
            self.left_out = len(rows) - heldout_size - len(self._train)
        if not self._train:
            raise ConfigError(f"task.data {data}: every problem's prompt is in the held-out set; none "
                              "is left to train on")
        self.name = f"dataset-{Path(data).stem}"
        self._orders: dict[int, list[int]] = {}
        if any("messages" in r for r in self._train + self._heldout) and not tokenizer.chat_template:
            raise ConfigError("task.data: a problem gives 'messages', which needs a checkpoint with a chat "
                              "template; this tokenizer has none (give a 'prompt' string instead)")

    def _epoch(self, epoch: int) -> list[int]:
        """The training problems' order in `epoch` (the last few kept: a batch spans at most two)."""
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
            out.append(dict(self._train[self._epoch(epoch)[position]]))
        return out

    def heldout(self, n: int | None = None) -> list[dict]:
        return [dict(r) for r in self._heldout[:n]]

    def prompt_ids(self, problem: dict) -> list[int]:
        if "prompt" in problem:
            return prompt_ids(self.tokenizer, problem["prompt"])
        return self.tokenizer.apply_chat_template(problem["messages"], add_generation_prompt=True)

    def step(self, episode: Episode, turn_ids: list[int]) -> Turn:
        episode.turns += 1
        text = turn_text(self.tokenizer, turn_ids)
        episode.answered = "answer:" in text.lower()
        try:
            reward = self.reward_fn(text, episode.problem)
        except (ParityError, OSError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            raise ParityError(f"task.reward {self.reward_spec} raised {one_line(exc)} on a response to "
                              f"{_key(episode.problem)[:60]}") from exc
        if isinstance(reward, bool):
            reward = float(reward)
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise ParityError(f"task.reward {self.reward_spec}: returned {reward!r} for a response to "
                              f"{_key(episode.problem)[:60]}; a reward is a finite number (or true/false)")
        episode.reward = float(reward)
        episode.passed = episode.reward >= 1.0
        return Turn(None, True, episode.reward)

    def describe(self) -> str:
        extra = f", {self.left_out} left out as held-out prompts" if self.left_out else ""
        return (f"task: {self.name} ({len(self._train)} training problems{extra}, {len(self._heldout)} "
                f"held out; reward {self.reward_spec})")
