"""The chat format every text task shares: one user turn, then the assistant's turns.

With parity's own character tokenizer (no chat template) a prompt reads

    <|user|>What is 48213*9127?<|assistant|><python>print(48213*9127)</python><result>440040051
    </result>answer: 440040051<|eos|>

and the markers are single special tokens (`parity.model.tokenizer.SPECIAL_TOKENS`). A checkpoint
that brings a chat template gets its prompt in its own format instead (`prompt_ids`), and the
tool markers are then plain text.
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


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The question as the model's prompt: its chat template's single user turn when the
    tokenizer has one, else parity's format above."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True)
    return tokenizer.encode(prompt_text(question))


def turn_text(tokenizer, turn_ids: list[int]) -> str:
    """A model turn as text, without the end-of-sequence token that closed it."""
    eos = set(getattr(tokenizer, "eos_token_ids", ()))
    while turn_ids and turn_ids[-1] in eos:
        turn_ids = turn_ids[:-1]
    return strip_special(tokenizer.decode(turn_ids))
