"""The tool-use environment: the model may run Python in a sandbox before it answers.

A problem is arithmetic a small model cannot do reliably in its head (large products, sums of
many numbers). An episode, in the chat format of `chat.py`:

    <|user|>What is 48213*9127?<|assistant|>            prompt
    <python>print("answer:", 48213*9127)</python>        model turn 1 (ends on </python>)
    <result>answer: 440040051\\n</result>                 environment tokens, loss_mask = 0
    answer: 440040051<|eos|>                             model turn 2, reward 1 if exact

Up to `max_tool_calls` calls per episode. Everything the model writes is handled without an
exception: a call without `<python>`, a call after the answer, or code that fails or times out
comes back as an `error:` line in the result block (a tool error); a call over the limit, an
unterminated call or an answer that does not parse ends the episode with reward 0. The code runs
only in `Sandbox` (a separate, isolated process), never in this interpreter.
"""

from __future__ import annotations

import logging
import random
import threading

from ..errors import ConfigError, SandboxFailure
from .base import Env, Episode, Turn
from .chat import PY_CLOSE, PY_OPEN, RESULT_CLOSE, RESULT_OPEN, prompt_ids, turn_text
from .math import HELDOUT_SEED, Problem, _stable_seed, off_heldout, score
from .sandbox.host import looks_like_error

log = logging.getLogger(__name__)

KINDS = ("mul", "sum")


def _number(rnd: random.Random, digits: int) -> int:
    return rnd.randint(10 ** (digits - 1), 10**digits - 1)


def make_tool_problem(kind: str, level: int, rnd: random.Random) -> Problem:
    """One problem of `kind` ('mul' or 'sum'); `level` (1..3) scales digits and terms."""
    if kind == "mul":
        a, b = _number(rnd, 3 + level), _number(rnd, 2 + level)
        expr, answer = f"{a}*{b}", a * b
    elif kind == "sum":
        terms = [_number(rnd, rnd.randint(2 + level // 2, 3 + level // 2)) for _ in range(3 + 2 * level)]
        expr, answer = "+".join(map(str, terms)), sum(terms)
    else:
        raise ConfigError(f"unknown tool task kind {kind!r}: expected one of {', '.join(KINDS)}")
    return Problem(f"tool-{kind}", f"What is {expr}?", answer)


def tool_call_text(problem: Problem) -> str:
    """The code a competent policy writes for `problem` (used by demonstrations): it prints a
    labelled result, `answer: N`, which the final answer then repeats."""
    return f'{PY_OPEN}print("answer:", {problem.prompt[len("What is "):-1]}){PY_CLOSE}'


def tool_output(problem: Problem) -> str:
    """What `tool_call_text(problem)` prints."""
    return f"answer: {problem.answer}\n"


def format_result(stdout: str, error: str | None, limit: int = 200) -> str:
    """The observation block for a tool run: stdout (truncated) and an `error:` line. A line the
    code printed that reads as that line (`error: ...`, or a sandbox verdict in look-alike letters)
    is marked `stdout: `: only the sandbox writes the error line."""
    out = stdout if len(stdout) <= limit else stdout[:limit] + "...\n"
    out = "".join("stdout: " + line if looks_like_error(line) else line for line in out.splitlines(True))
    if error:
        out += ("" if not out or out.endswith("\n") else "\n") + f"error: {error}\n"
    return f"{RESULT_OPEN}{out}{RESULT_CLOSE}"


class ToolEnv(Env):
    """Multi-turn arithmetic with a sandboxed Python tool."""

    multi_turn = True

    def __init__(self, tokenizer, kinds: tuple[str, ...] | list[str] = KINDS, level: int = 2,
                 seed: int = 0, heldout_size: int = 200, max_tool_calls: int = 3,
                 result_chars: int = 200, sandbox=None):
        if not kinds or any(k not in KINDS for k in kinds):
            raise ConfigError(f"tool task kinds must be a non-empty subset of {list(KINDS)}, got {kinds!r}")
        if not 1 <= level <= 3:
            raise ConfigError(f"tool task level must be 1..3, got {level}")
        if max_tool_calls < 1:
            raise ConfigError("tool task max_tool_calls must be >= 1")
        self.tokenizer = tokenizer
        # sorted: the held-out set (and its name) must not hang on the order kinds are listed in
        # (["sum", "mul"] shared none of the 200 problems the base policies' fine-tuning left out)
        self.kinds, self.level, self.seed = tuple(sorted(kinds)), level, seed
        self.max_tool_calls, self.result_chars = max_tool_calls, result_chars
        self.name = f"tool-{'+'.join(self.kinds)}-{level}"
        self._sandbox = sandbox
        self._lock = threading.Lock()
        self._said = False  # (the degraded sandbox's start-up line, once)
        close = tokenizer.encode(PY_CLOSE)  # one special token in parity's tokenizer, text elsewhere
        self._close_id = close[0] if len(close) == 1 else None
        rnd = random.Random(_stable_seed("tool", self.kinds, level, HELDOUT_SEED, "heldout"))
        self._heldout = [self._make(i, rnd) for i in range(heldout_size)]
        self._heldout_prompts = {p.prompt for p in self._heldout}
        self.problems(0, 1)  # a held-out set that leaves nothing to train on fails now

    def _make(self, i: int, rnd: random.Random) -> Problem:
        return make_tool_problem(self.kinds[i % len(self.kinds)], self.level, rnd)

    @property
    def sandbox(self):
        with self._lock:
            if self._sandbox is None:
                from .sandbox import Sandbox

                self._sandbox = Sandbox()  # (refuses where it cannot isolate: pass a Sandbox to allow it)
            if not getattr(self._sandbox, "isolated", True) and not self._said:  # said in every
                self._said = True                          # process that runs tool calls (a Ray node's)
                log.warning("%s", self._sandbox.describe())
            return self._sandbox

    @property
    def stop_token_ids(self) -> list[int]:
        return [self._close_id] if self._close_id is not None else []

    @property
    def stop_strings(self) -> list[str]:
        return [] if self._close_id is not None else [PY_CLOSE]

    def problems(self, batch_index: int, n: int) -> list[Problem]:
        rnd = random.Random(_stable_seed("tool", self.kinds, self.level, self.seed, batch_index))
        return off_heldout(lambda i: self._make(i, rnd), n, self._heldout_prompts,
                           f"tool task level {self.level} training problems")

    def heldout(self, n: int | None = None) -> list[Problem]:
        return list(self._heldout[:n])

    def prompt_ids(self, problem: Problem) -> list[int]:
        return prompt_ids(self.tokenizer, problem.prompt)

    def describe(self) -> str:
        return (f"task: {self.name} (multi-turn, up to {self.max_tool_calls} tool calls); "
                f"{self.sandbox.describe()}")

    def _observe(self, episode: Episode, text: str) -> Turn:
        """The observation block's tokens: its markers as themselves, what the code printed as plain
        characters (a printed `</result>` or end-of-sequence text does not forge those tokens)."""
        inner = text[len(RESULT_OPEN):len(text) - len(RESULT_CLOSE)]
        tok = self.tokenizer
        return Turn(tok.encode(RESULT_OPEN) + tok.encode_plain(inner) + tok.encode(RESULT_CLOSE), done=False)

    def step(self, episode: Episode, turn_ids: list[int]) -> Turn:
        episode.turns += 1
        text = turn_text(self.tokenizer, turn_ids)
        if self._close_id is not None:
            is_call = bool(turn_ids) and turn_ids[-1] == self._close_id
        else:  # the engine stops a turn at the first `</python>` in its text (a stop string); the
            # token that completed it may carry a few more characters, which are dropped
            is_call = PY_CLOSE in text
            text = text[:text.rfind(PY_CLOSE) + len(PY_CLOSE)] if is_call else text
        if is_call:  # a tool call
            episode.tool_calls += 1
            start = text.rfind(PY_OPEN)
            if episode.tool_calls > self.max_tool_calls:
                episode.tool_errors += 1
                episode.info["ended"] = "too many tool calls"
                return Turn(None, True, 0.0)
            if start < 0:
                episode.tool_errors += 1
                return self._observe(episode, format_result("", f"{PY_CLOSE} without {PY_OPEN}"))
            if "answer:" in text[:start].lower():
                episode.tool_errors += 1
                return self._observe(episode, format_result("", "tool call after the answer"))
            code = text[start + len(PY_OPEN): -len(PY_CLOSE)]
            result = self.sandbox.run(code)
            if getattr(result, "infra", False):  # the sandbox failed, not the code: never a reward
                raise SandboxFailure(f"tool call not run: {result.error}")
            if not result.ok:
                episode.tool_errors += 1
            error = result.error
            if getattr(result, "limit", None) in ("time", "cpu"):  # which of the two fires first
                error = "sandbox: time limit exceeded"  # depends on the machine's load: one text
            return self._observe(episode, format_result(result.stdout, error, self.result_chars))
        if PY_OPEN in text and PY_CLOSE not in text[text.rfind(PY_OPEN):]:
            episode.tool_errors += 1  # an unterminated tool call: no answer
            episode.info["ended"] = "unterminated tool call"
            return Turn(None, True, 0.0)
        episode.answered = "answer:" in text.lower()
        episode.reward = score(episode.problem, text)
        episode.passed = episode.reward == 1.0
        return Turn(None, True, episode.reward)
