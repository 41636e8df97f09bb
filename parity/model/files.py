"""A checkpoint's files read as untrusted input: regular files only, of bounded size, and every
failure one line naming the file.

A checkpoint directory can come from anywhere. Before this, a FIFO named model.safetensors hung
the process for good (the safetensors library retries its open through SIGTERM), a config.json
linked to /dev/zero was read until memory ran out, and JSON nested 100,000 deep or a 5,000-digit
number failed naming no file. `regular_file` stats before anything opens the file (a stat never
blocks), `read_text` reads at most the limit, `read_json` names the file in every error.
`verify_manifest` checks a training checkpoint's files against the digests saved with them, before
anything loads it (`load_model`, resume): flipped bytes inside a tensor give finite weights that
pass every other check.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from ..errors import CheckpointError

MAX_JSON_BYTES = 256 << 20
"""The largest JSON file read (config.json, tokenizer_config.json, an index): a 200 MB one loads."""
MAX_TEMPLATE_BYTES = 4 << 20
"""The largest chat template file read (the Hub's longest are tens of KB)."""
MAX_TOKENIZER_BYTES = 1 << 30
"""The largest tokenizer.json handed to the tokenizers library (the Hub's largest are ~35 MB)."""


def regular_file(path: Path, limit: int, error: type[Exception] = CheckpointError) -> Path:
    """`path` if it is a regular file (through symlinks) of at most `limit` bytes, else `error`
    naming it: a FIFO, a device, a directory or a socket would hang or never end a read."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: not a regular file")
    if info.st_size > limit:
        raise error(f"{path}: {info.st_size:,} bytes, more than the {limit:,} read from such a file")
    return Path(path)


def read_text(path: Path, limit: int, error: type[Exception] = CheckpointError) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes, or `error` naming it."""
    regular_file(path, limit, error)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)  # (a file that grew since its stat)
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{path}: more than the {limit:,} bytes read from such a file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def read_json(path: Path, error: type[Exception] = CheckpointError, limit: int = MAX_JSON_BYTES):
    """A JSON file's value, or `error` naming the file (nesting too deep, a number too long)."""
    text = read_text(path, limit, error)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise error(f"{path}: not valid JSON ({str(exc).splitlines()[0][:200]})") from None


MANIFEST = "manifest.json"
"""The file a training checkpoint lists its files' SHA-256 digests in (`rl/checkpoint.py` writes it)."""


def sha256(path: Path) -> str:
    """The SHA-256 hex digest of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory `path`, every file it lists present, regular and of the
    digest it lists, else CheckpointError naming the first that is not."""
    path = Path(path)
    try:
        data = json.loads(read_text(path / MANIFEST, MAX_JSON_BYTES))
        listed = dict(data["files"])
    except (CheckpointError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: no readable {MANIFEST} (an incomplete checkpoint)") from None
    for name, digest in listed.items():
        f = path / str(name)
        if not f.exists():
            raise CheckpointError(f"{f}: missing (the checkpoint is incomplete)")
        regular_file(f, 1 << 62)
        try:
            same = sha256(f) == digest
        except OSError as exc:
            raise CheckpointError(f"{f}: cannot be read ({exc.strerror or exc})") from None
        if not same:
            raise CheckpointError(f"{f}: contents do not match {MANIFEST} (truncated or corrupt)")
    return data
