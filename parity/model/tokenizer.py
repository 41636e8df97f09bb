"""Tokenizers: a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), else UTF-8 bytes.

The byte fallback maps text to its UTF-8 bytes, so it needs `vocab_size >= 256` for arbitrary
text (the `tiny` preset's 128 ids cover ASCII only); ids it cannot decode print as `<id>`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        bad = [b for b in ids if b >= self.vocab_size]
        if bad:
            raise InputError(f"prompt: byte {bad[0]} is outside the vocabulary "
                             f"(vocab_size={self.vocab_size}; use ASCII or a tokenizer.json)")
        return ids

    def decode(self, ids: list[int]) -> str:
        data = bytearray()
        out = []
        for t in ids:
            if t < 256:
                data.append(t)
            else:
                out.append(data.decode("utf-8", errors="replace"))
                data = bytearray()
                out.append(f"<{t}>")
        out.append(data.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception types
            raise InputError(f"{path}: cannot load tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int):
    """The checkpoint's `tokenizer.json` if it has one, else the UTF-8 byte tokenizer."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").exists():
        return HFTokenizer(Path(checkpoint) / "tokenizer.json")
    return ByteTokenizer(vocab_size)
