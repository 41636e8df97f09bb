"""A reward that runs the model's code against a problem's tests, in parity's sandbox.

    [task]
    name = "dataset"
    data = "problems.jsonl"    # {"prompt": "Write f(x) ... in a ```python block.",
                               #  "tests": "assert f(1) == 2"}
    reward = "examples/code_rewards.py:passes_tests"

A reward function with a `sandbox` parameter is given the run's sandbox (`parity.envs.sandbox`):
the model's code runs there, in a fresh isolated process per call, never in this one.
"""

from __future__ import annotations

import re
import secrets

from parity.errors import SandboxFailure

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def passes_tests(response: str, problem: dict, sandbox) -> float:
    """1 when the last fenced code block of the response passes the problem's `tests`, else 0."""
    blocks = FENCE.findall(response)
    if not blocks:
        return 0.0
    # a mark the code cannot know, printed only after every test passed: code that prints "ok" or
    # exits with status 0 before the tests run earns nothing
    mark = secrets.token_hex(16)
    result = sandbox.run(f"{blocks[-1]}\n\n{problem['tests']}\n\nprint({mark!r})\n")
    if result.infra:  # the sandbox failed, not the code: not the model's fault, so no reward at all
        raise SandboxFailure(f"tests not run: {result.error}")
    return float(result.ok and result.stdout.rstrip().endswith(mark))
