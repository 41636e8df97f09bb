"""A reward that runs the model's code on a problem's test cases in parity's sandbox.

    [task]
    name = "dataset"
    data = "problems.jsonl"    # {"prompt": "Write add(a, b) in a ```python block.", "entry": "add",
                               #  "cases": [[[1, 2], 3], [[-4, 4], 0]]}    (arguments, expected result)
    reward = "examples/code_rewards.py:passes_tests"

A reward function with a `sandbox` parameter is given the run's sandbox (`parity.envs.sandbox`):
the model's code runs there, in a fresh isolated process per call, never in this one.

Judge on the host, never in the sandbox. Only the cases' arguments go in; the results come back
as JSON and are compared here with the expected values, which the code never sees. An assert-style
test run inside the sandbox can be passed without solving anything: by an object whose `__eq__` is
always true, by reading and printing a success mark from the script itself, by `sys.settrace`
jumping past the asserts, by `os._exit(0)` from an exception hook. Here none of that helps: JSON
carries no objects, and no output can match values that never entered the sandbox except the right
ones. Code whose output exceeds the sandbox's limit (64 KiB) or that runs past its time scores 0.
"""

from __future__ import annotations

import json
import re

from parity.errors import SandboxFailure

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def passes_tests(response: str, problem: dict, sandbox) -> float:
    """The share of the problem's cases that the response's last fenced code block gets right
    (1.0: all of them, which counts as solved for pass@1)."""
    blocks = FENCE.findall(response)
    if not blocks:
        return 0.0
    cases, entry = problem["cases"], problem["entry"]
    if not entry.isidentifier():  # the dataset's, not the model's: a mistake there is said, not scored
        raise ValueError(f"'entry' must name a function, got {entry!r}")
    arguments = json.dumps(json.dumps([args for args, _ in cases]))  # a Python literal of the JSON
    harness = (f"\n\nimport json as _json\n_out = []\nfor _args in _json.loads({arguments}):\n"
               f"    try:\n        _out.append({entry}(*_args))\n"
               f"    except Exception:\n        _out.append(None)\nprint(_json.dumps(_out))\n")
    result = sandbox.run(blocks[-1] + harness)
    if result.infra:  # the sandbox failed, not the code: not the model's fault, so no reward at all
        raise SandboxFailure(f"cases not run: {result.error}")
    try:
        got = json.loads((result.stdout.strip().splitlines() or [""])[-1])
    except (ValueError, RecursionError):  # no JSON line at the end (it failed, printed after, was cut
        return 0.0                        # off) or one nested too deep to parse: the model's output
    if not isinstance(got, list) or len(got) != len(cases):
        return 0.0
    return sum(value == expected for value, (_, expected) in zip(got, cases)) / len(cases)
