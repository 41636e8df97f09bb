"""Math tasks: seeded generation, exact verification, bad answers score 0 without raising."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parity.envs.math import TASKS, MathTask, Problem, _safe_eval, extract_answer, score
from parity.errors import ConfigError


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("level", [1, 3, 5])
def test_problems_are_seeded_and_verifiable(task, level):
    t = MathTask(task, level, seed=3)
    batch = t.problems(0, 20)
    assert batch == MathTask(task, level, seed=3).problems(0, 20)
    assert batch != t.problems(1, 20)
    heldout = {p.prompt for p in t.heldout()}
    assert heldout.isdisjoint(p.prompt for b in range(5) for p in t.problems(b, 50))
    for p in batch:
        if p.answer is not None:
            assert score(p, f"answer: {p.answer}") == 1.0
            assert score(p, f"answer: {p.answer + 1}") == 0.0


def test_heldout_set_is_identical_in_another_process():
    code = ("from parity.envs.math import MathTask; "
            "print([p.prompt for p in MathTask('expr', 3, 1).heldout(5)])")
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
           for _ in range(2)]
    assert out[0] == out[1] and out[0].strip()


def test_expressions_and_countdown():
    assert _safe_eval("2+3*4") == 14 and _safe_eval("(2+3)*4") == 20 and _safe_eval("7-10") == -3
    for bad in ("2+", "import os", "2**100000", "(((1)", "1/0"):
        assert _safe_eval(bad) is None
    p = Problem("countdown", "make 10 from 2 3 4:", None, (2, 3, 4), 10)
    assert score(p, "answer: 2*3+4") == 1.0
    assert score(p, "answer: 2*3*4") == 0.0
    assert score(p, "answer: 5+5") == 0.0  # numbers not in the pool
    assert score(p, "answer: 2+2+3+3") == 0.0  # a number used twice


def test_unparseable_answers_score_zero():
    p = Problem("add", "1+1=", 2)
    for response in ("", "no idea", "answer:", "answer: two", "answer: 2.5.5", "\x00\xff"):
        assert score(p, response) in (0.0, 1.0)
    assert score(p, "the answer: 2") == 1.0 and extract_answer("x\nanswer: 7 ") == "7"


def test_bad_task_or_level():
    with pytest.raises(ConfigError, match="unknown math task"):
        MathTask("div")
    with pytest.raises(ConfigError, match="level"):
        MathTask("add", 9)
