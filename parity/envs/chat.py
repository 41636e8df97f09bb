"""The chat format every text task shares: one user turn, then the assistant's turns.

    <|user|>What is 48213*9127?<|assistant|><python>print(48213*9127)</python><result>440040051
    </result>answer: 440040051<|eos|>

Markers are single special tokens of the tokenizer (`parity.model.tokenizer.SPECIAL_TOKENS`).
"""

from __future__ import annotations

USER, ASSISTANT, EOS = "<|user|>", "<|assistant|>", "<|eos|>"
PY_OPEN, PY_CLOSE, RESULT_OPEN, RESULT_CLOSE = "<python>", "</python>", "<result>", "</result>"


def prompt_text(question: str) -> str:
    """The prompt the model continues: the question as a user turn, then the assistant marker."""
    return f"{USER}{question}{ASSISTANT}"


def answer_text(answer) -> str:
    """A final answer as the tasks' verifiers parse it."""
    return f"answer: {answer}{EOS}"


def strip_special(text: str) -> str:
    """The text without a trailing EOS marker."""
    return text[: -len(EOS)] if text.endswith(EOS) else text
