"""A reward function of your own for `task.name = "dataset"`: `task.reward = "examples/rewards.py:digits"`.

It is called as `digits(response, problem)`: the model's response as text (without the token that
ended it) and the problem, the JSON object of its line in `task.data`. It returns a number; 1 or
more counts as solved for pass@1. It runs in the rollout processes, on every response, several at
once on threads (keep it thread-safe), with no time limit of its own; never run the response in
this process: it is model-written text (a custom env's `ctx.sandbox()` is where code runs).
"""

from __future__ import annotations

import re

from parity.envs.answers import NUMBER, extract_answer, matches

_INTEGER = re.compile(r"-?\d+")


def digits(response: str, problem: dict) -> float:
    """1 for the exact answer (as `reward = "exact"` judges it: the first number on the first line
    after the last `answer:`, `3.5`, `1,234` and `1e3` included), else, for an integer answer, the
    share of its digits right in place, both numbers aligned on their last digit (partial credit:
    a denser signal than right/wrong while the policy is weak)."""
    if matches(response, problem["answer"]):
        return 1.0
    found = NUMBER.search(extract_answer(response))
    said, want = (found.group().replace(",", "") if found else ""), str(problem["answer"])
    if not (_INTEGER.fullmatch(said) and _INTEGER.fullmatch(want)):
        return 0.0
    width = max(len(said), len(want))
    right = sum(a == b for a, b in zip(said.rjust(width), want.rjust(width)))
    return 0.9 * right / width
