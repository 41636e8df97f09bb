"""Tokenizers: a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`) with its chat template
and special tokens, else UTF-8 bytes.

The byte fallback maps text to its UTF-8 bytes, so it needs `vocab_size >= 256` for arbitrary
text (the `tiny` preset's 128 ids cover ASCII only); ids it cannot decode print as `<id>`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import InputError
from . import files

MAX_TEXT_CHARS = 2_000_000
"""The longest text handed to a tokenizer (~half a million tokens of English; the library takes
~400 bytes a character while it works: 10 million characters took 3.9 GB)."""


def _bounded(text: str, what: str = "text") -> str:
    if isinstance(text, str) and len(text) > MAX_TEXT_CHARS:
        raise InputError(f"{what} of {len(text):,} characters: more than the {MAX_TEXT_CHARS:,} a tokenizer "
                         "is given (no model context holds it)")
    return text


def _library(call, *args):
    """A tokenizers call, its Rust panic (a regex past its backtracking limit) as an InputError."""
    try:
        return call(*args)
    except BaseException as exc:  # (pyo3's PanicException derives from BaseException)
        if type(exc).__name__ != "PanicException":
            raise
        raise InputError(f"the tokenizer failed: {str(exc).splitlines()[0][:200]}") from None


class ByteTokenizer:
    chat_template = None
    eos_token_ids: list[int] = []

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_plain(self, text: str) -> list[int]:
        return self.encode(text)  # bytes have no special tokens

    def encode(self, text: str) -> list[int]:
        ids = list(_bounded(text).encode("utf-8"))
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
    """A Hugging Face `tokenizer.json` (any model: byte-level BPE, SentencePiece-style, or parity's
    character tokenizer) with what its directory says about it: special tokens and the chat
    template from `tokenizer_config.json` (or `chat_template.jinja`), end-of-sequence ids from
    `generation_config.json` as well."""

    def __init__(self, path: Path, directory: Path | None = None):
        from tokenizers import Tokenizer

        files.regular_file(path, files.MAX_TOKENIZER_BYTES, InputError)  # (a FIFO hung here for good)
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception types
            raise InputError(f"{path}: cannot load tokenizer ({exc})") from None
        directory = Path(directory) if directory is not None else Path(path).parent
        config = _read_json(directory / "tokenizer_config.json")
        older = _read_json(directory / "special_tokens_map.json")  # where older layouts keep them
        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(name) if config.get(name) is not None else older.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                self.special_tokens[name] = value
        self.chat_template: str | None = _chat_template(config, directory)
        generation = _read_json(directory / "generation_config.json").get("eos_token_id")
        eos = [self.token_id(self.special_tokens["eos_token"])] if "eos_token" in self.special_tokens else []
        listed = generation if isinstance(generation, list) else [] if generation is None else [generation]
        bad = [e for e in listed if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < 2**31]
        if bad:  # (true was read as id 1, "1" and 1e3 dropped without a word)
            raise InputError(f"{directory / 'generation_config.json'}: eos_token_id {bad[0]!r} is not a "
                             "token id")
        eos += listed
        self.eos_token_ids: list[int] = sorted({e for e in eos if isinstance(e, int)})
        self.chat_template_kwargs: dict = {}  # the template's keywords for every render (a call's win)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the special tokens the tokenizer would add around it."""
        return _library(lambda: self._tok.encode(_bounded(text), add_special_tokens=False).ids)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` as plain characters: the text of an added (special) token inside it,
        an end-of-sequence or turn marker say, does not become that token; text without one
        encodes as `encode` does. For text that is not the model's own, such as a tool's output."""
        # the tokenizer's own normalizer, pre-tokenizer and model, without its added-token pass
        # (text cut around each added token and encoded piece by piece got a word-start marker
        # per piece from SentencePiece-style pre-tokenizers: '</s>' came back as '< /s>')
        tok, text = self._tok, _bounded(text)

        def run():
            normal = _bounded(tok.normalizer.normalize_str(text)) if tok.normalizer is not None else text
            pieces = tok.pre_tokenizer.pre_tokenize_str(normal) if tok.pre_tokenizer is not None \
                else [(normal, None)]
            return [t.id for piece, _ in pieces for t in tok.model.tokenize(piece)]
        return _library(run)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw prompt, with the tokenizer's own additions (a BOS token, say)."""
        return _library(lambda: self._tok.encode(_bounded(text)).ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        """The conversation rendered by the checkpoint's chat template, as token ids (as
        `transformers`' `apply_chat_template(..., tokenize=True)`)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        from .chat_template import render_chat

        if self.chat_template is None:
            raise InputError("this checkpoint has no chat template (tokenizer_config.json chat_template)")
        return render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens,
                           **{**self.chat_template_kwargs, **kwargs})

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_id(self, token: str) -> int | None:
        """The id of a (special) token, or None."""
        return self._tok.token_to_id(token)

    @property
    def unk_token_id(self) -> int | None:
        """The id text this vocabulary cannot spell becomes (None: a byte-level BPE spells any)."""
        unk = self.special_tokens.get("unk_token") or getattr(self._tok.model, "unk_token", None)
        return self.token_id(unk) if isinstance(unk, str) else None

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _read_json(path: Path) -> dict:
    if not path.exists() and not path.is_symlink():
        return {}
    data = files.read_json(path, InputError)  # (a regular file of bounded size: `files.py`)
    return data if isinstance(data, dict) else {}


def _chat_template(config: dict, directory: Path) -> str | None:
    """The default chat template: `chat_template.jinja`, else tokenizer_config.json's entry (a
    string, or a list of named templates of which "default" is taken), else the processor's
    `chat_template.json` (image-text checkpoints such as Gemma 3 4B-27B keep it there)."""
    jinja = directory / "chat_template.jinja"
    if jinja.exists() or jinja.is_symlink():
        return files.read_text(jinja, files.MAX_TEMPLATE_BYTES, InputError)
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
"""What `HFTokenizer` reads beside a tokenizer.json (special tokens, the chat template, EOS ids)."""


def copy_tokenizer(path: Path, directory: Path) -> None:
    """Copy a tokenizer.json and its companion files into `directory` (where none is yet), so a
    tokenizer read from there is the same: its chat template and EOS ids included. A template only
    a processor's `chat_template.json` held is written as `chat_template.jinja` too, which
    transformers' tokenizer reads (it ignores the processor's file)."""
    for name in ("tokenizer.json", *COMPANION_FILES):
        source = Path(path) if name == "tokenizer.json" else Path(path).parent / name
        if source.is_file() and not (Path(directory) / name).exists():
            shutil.copyfile(source, Path(directory) / name)
    directory = Path(directory)
    jinja, own = directory / "chat_template.jinja", _read_json(directory / "tokenizer_config.json")
    template = _chat_template(own, directory)
    if template is not None and not jinja.exists() and own.get("chat_template") is None:
        jinja.write_text(template)


_OTHER_FORMATS = ("tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
                  "special_tokens_map.json")
"""Files of a tokenizer in a format other than `tokenizer.json` (SentencePiece, slow BPE)."""


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int):
    """The checkpoint's `tokenizer.json` if it has one, else the UTF-8 byte tokenizer when it has
    no tokenizer at all; a tokenizer only in another format is a one-line error (bytes would
    silently give the model ids it was never trained on)."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").exists():
        return HFTokenizer(Path(checkpoint) / "tokenizer.json")
    other = [f for f in _OTHER_FORMATS if checkpoint is not None and (Path(checkpoint) / f).exists()]
    if other:
        raise InputError(f"{checkpoint}: has {other[0]} but no tokenizer.json (parity reads tokenizers "
                         "only in that format: save it with transformers' tokenizer.save_pretrained)")
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
