"""A reward function of your own for `task.name = "dataset"`: `task.reward = "examples/rewards.py:digits"`.

It is called as `digits(response, problem)`: the model's response as text (without the token that
ended it) and the problem, the JSON object of its line in `task.data`. It returns a number; 1 or
more counts as solved for pass@1. It runs in the rollout processes, on every response, several at
once on threads (keep it thread-safe), with no time limit of its own; never run the response in
this process: it is model-written text (a custom env's `ctx.sandbox()` is where code runs).
"""

from __future__ import annotations

import re

from parity.envs.answers import extract_answer


def digits(response: str, problem: dict) -> float:
    """1 for the exact answer, else the share of the answer's digits right in place (partial
    credit: a denser signal than right/wrong while the policy is weak). The answer is read as
    `reward = "exact"` reads it: the first number on the first line after the last `answer:`."""
    found = re.findall(r"-?\d+", extract_answer(response))
    if not found:
        return 0.0
    said, want = found[0], str(problem["answer"])
    if said == want:
        return 1.0
    right = sum(a == b for a, b in zip(said.rjust(len(want)), want))
    return 0.9 * right / max(len(want), len(said))
