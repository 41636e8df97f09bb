"""docs/reliability.md is checked against the tests: every test it names exists, and every test
of the reliability files (sandbox hardening, training faults, fuzzing, mistaken API calls) is
named in it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
RELIABILITY_FILES = ["tests/test_sandbox_hardening.py", "tests/rl/test_faults.py", "tests/test_fuzz.py",
                     "tests/test_api_input.py"]


def _test_names(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_named_test_exists_and_every_reliability_test_is_named():
    named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", DOC.read_text())
    assert named
    for path, name in named:
        assert name in _test_names(path), f"docs/reliability.md names {path}::{name}, which does not exist"
    listed = {(p, n) for p, n in named}
    for path in RELIABILITY_FILES:
        for name in _test_names(path):
            assert (path, name) in listed, f"{path}::{name} is not in docs/reliability.md"
