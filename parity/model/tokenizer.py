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

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_id(self, token: str) -> int | None:
        """The id of a (special) token, or None."""
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int):
    """The checkpoint's `tokenizer.json` if it has one, else the UTF-8 byte tokenizer."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").exists():
        return HFTokenizer(Path(checkpoint) / "tokenizer.json")
    return ByteTokenizer(vocab_size)


SPECIAL_TOKENS = ("<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<python>", "</python>",
                  "<result>", "</result>")
"""Turn and tool-call markers, each one token (ids 0..7 in a built tokenizer; <|eos|> is 1)."""

DEFAULT_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n\t"
"""Printable ASCII plus newline and tab: what the math and tool tasks write."""


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, special_tokens=SPECIAL_TOKENS):
    """A character-level Hugging Face tokenizer: the special tokens, then one id per character
    of `alphabet`, then `<|unk|>`. Save it with `.save(dir / "tokenizer.json")`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate([*special_tokens, *chars, "<|unk|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special_tokens))
    return tok
