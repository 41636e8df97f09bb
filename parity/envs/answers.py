"""Reading a response's answer: one rule for every built-in task (math, tool use, your dataset).

The answer is the first line after the response's last `answer:` (in any case), else the
response's last non-empty line. A numeric answer is the first number on that line, read exactly
(`1,234`, `-3.5`, `1e3`, `12.0` is 12; `answer: 12 or 13` is 12); any other answer is the whole
line, compared ignoring case, runs of spaces and surrounding quotes and punctuation. Nothing here
raises on a response: what does not parse scores 0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_ANSWER = re.compile("answer:", re.IGNORECASE)
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|-?\.\d+(?:[eE][-+]?\d+)?")
"""A number as written in an answer: an optional minus, digits (with thousands commas), an
optional fraction and exponent."""
_PUNCTUATION = " \t.,;:!?\"'`*()[]{}"


def answer_at(response: str) -> int:
    """Where the text after the response's last `answer:` (in any case) starts, or -1. (Found in
    the response itself: an index into `response.lower()` is off after a character that lowers
    to two, such as İ.)"""
    ends = [m.end() for m in _ANSWER.finditer(response)]
    return ends[-1] if ends else -1


def extract_answer(response: str) -> str:
    """The answer line, stripped: the first line after the last `answer:`, else the last
    non-empty line."""
    at = answer_at(response)
    if at >= 0:
        return (response[at:].strip().splitlines() or [""])[0].strip()
    return next((x for x in reversed(response.splitlines()) if x.strip()), "").strip()


def to_decimal(text: str) -> Decimal | None:
    """`text` (a number as `NUMBER` matches it, or a JSON number's repr) exactly, or None."""
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def expected_number(answer) -> Decimal | None:
    """A reference answer as a number: a JSON number, or a string that is one (`42`, `-3.5`,
    `1,234`, `1e3`); None for a textual answer (`1,2` and `Paris` are text)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, float):
        return to_decimal(repr(answer))
    if isinstance(answer, int):
        return Decimal(answer)
    text = str(answer).strip()
    return to_decimal(text) if NUMBER.fullmatch(text) else None


def _norm(text: str) -> str:
    return " ".join(text.strip(_PUNCTUATION).split()).casefold()


def matches(response: str, answer) -> bool:
    """Whether the response's answer is `answer` (numbers exactly, text as text)."""
    line = extract_answer(response)
    want = expected_number(answer)
    if want is not None:
        found = NUMBER.search(line)
        return found is not None and to_decimal(found.group()) == want
    return bool(_norm(line)) and _norm(line) == _norm(str(answer))
