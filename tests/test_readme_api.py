"""The README's Public API blocks run as written (a new user's walk found placeholders that did not,
and a learner block that failed after the engine block's version-1 update)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def public_api_blocks() -> list[str]:
    section = README.read_text().split("## Public API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_public_api_blocks_run_in_order(tmp_path, monkeypatch):
    blocks = public_api_blocks()
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)  # (the first saves a checkpoint to ./ckpt)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), scope)  # noqa: S102 - the project's own README
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    assert scope["metrics"]["mismatch/kernel_max_abs"] == 0.0
    assert all(o.error is None and o.token_ids for o in scope["outs"])
