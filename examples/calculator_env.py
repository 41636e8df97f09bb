"""An environment of your own, as `task.name = "custom"` runs it: sums with a Python tool.

The model is asked `What is a+b+c?`. It may write `<python>code</python>`; the code runs in
parity's sandbox and what it prints comes back as `<result>...</result>` before the model's next
turn; the final turn's `answer: N` scores 1 if right. Run it from the repository root:

    parity train examples/calculator.toml

It shows the whole `parity.envs.base.Env` API: a constructor called as
`CalculatorEnv(ctx, **task.options)`, problems that follow from (seed, batch index) alone, a
held-out set fixed for every run and kept out of training, prompts as token ids, a token that
ends a turn, and a multi-turn `step` that never raises for anything the model wrote. The model's
code runs only through `ctx.sandbox().run(code)`, never in this process.
"""

from __future__ import annotations

import random

from parity.envs.answers import NUMBER, extract_answer, matches
from parity.envs.base import Env, Episode, Turn
from parity.envs.chat import prompt_ids, turn_text

OPEN, CLOSE = "<python>", "</python>"


class CalculatorEnv(Env):
    multi_turn = True  # step may answer a turn with an observation

    def __init__(self, ctx, digits: int | list[int] = 2, terms: int = 3, max_calls: int = 2,
                 heldout_seed: int = 12345):
        if ctx.tokenizer is None:
            raise ValueError("CalculatorEnv needs a checkpoint with a tokenizer.json")
        span = [digits] if isinstance(digits, int) else list(digits)
        if not (1 <= len(span) <= 2 and all(isinstance(d, int) and 1 <= d <= 18 for d in span)
                and span == sorted(span)):
            raise ValueError(f"digits must be 1..18 or [fewest, most], got {digits!r}")
        if not (isinstance(terms, int) and 1 <= terms <= 50):  # (0 made every problem "What is ?": a hang)
            raise ValueError(f"terms must be 1..50, got {terms!r}")
        self.ctx, self.tokenizer, self.seed = ctx, ctx.tokenizer, ctx.seed
        self.digits = span[0] if len(span) == 1 else tuple(span)  # an int, or (fewest, most)
        self.terms, self.max_calls = terms, max_calls
        self.name = f"calculator-sums-{terms}x{'-'.join(map(str, span))}"
        self.close_id = ctx.tokenizer.token_id(CLOSE)  # a special token in parity's tokenizer, else None
        rnd = random.Random(heldout_seed)  # the same held-out set whatever the run's seed
        self._heldout = [self._problem(rnd) for _ in range(ctx.heldout_size)]
        self._held = {p["prompt"] for p in self._heldout}

    def _problem(self, rnd: random.Random) -> dict:
        numbers = []
        for _ in range(self.terms):  # digits: a number of them, or [fewest, most] drawn per term
            digits = self.digits if isinstance(self.digits, int) else rnd.randint(*self.digits)
            numbers.append(rnd.randint(10 ** (digits - 1), 10**digits - 1))
        return {"prompt": f"What is {'+'.join(map(str, numbers))}?", "answer": sum(numbers)}

    # what ends a model turn besides EOS: the end of a tool call
    @property
    def stop_token_ids(self) -> list[int]:
        return [self.close_id] if self.close_id is not None else []

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.close_id is not None else [CLOSE]

    def problems(self, batch_index: int, n: int) -> list[dict]:
        rnd = random.Random(f"{self.seed}/{batch_index}")  # str seeds hash the same in every process
        out, tries = [], 0
        while len(out) < n:
            problem, tries = self._problem(rnd), tries + 1
            if problem["prompt"] not in self._held:
                out.append(problem)
            elif tries > 1000 * n:  # (a problem space the held-out set covers: it spun for ever)
                raise ValueError("almost every problem is held out: raise digits or terms, or lower "
                                 "task.heldout_size")
        return out

    def heldout(self, n: int | None = None) -> list[dict]:
        return self._heldout[:n]

    def prompt_ids(self, problem: dict) -> list[int]:
        return prompt_ids(self.tokenizer, problem["prompt"])  # the chat template, or parity's format

    def step(self, episode: Episode, turn_ids: list[int]) -> Turn:
        episode.turns += 1
        text = turn_text(self.tokenizer, turn_ids)
        if self.close_id is None and CLOSE in text:  # (a stop string: the token that completed it may
            text = text[:text.rfind(CLOSE) + len(CLOSE)]  # carry a few more characters: dropped)
        if text.rstrip().endswith(CLOSE) and OPEN in text:  # a tool call
            episode.tool_calls += 1
            if episode.tool_calls > self.max_calls:
                return Turn(None, True, 0.0)
            code = text[text.rfind(OPEN) + len(OPEN):text.rstrip().rfind(CLOSE)]
            result = self.ctx.sandbox().run(code)  # never exec() here: the sandbox isolates it
            if not result.ok:
                episode.tool_errors += 1
            shown = (result.stdout[:200] + (f"error: {result.error}\n" if result.error else ""))
            # markers as tokens, what the code printed as plain characters (it cannot forge them)
            tok = self.tokenizer
            observation = tok.encode("<result>") + tok.encode_plain(shown) + tok.encode("</result>")
            return Turn(observation, done=False)
        # the answer as parity's own tasks read it: the first number after the last `answer:`
        # (exactly, as a decimal: no int() of a model-written 5,000-digit string, which raises)
        episode.answered = NUMBER.search(extract_answer(text)) is not None
        episode.passed = matches(text, episode.problem["answer"])
        episode.reward = float(episode.passed)
        return Turn(None, True, episode.reward)
