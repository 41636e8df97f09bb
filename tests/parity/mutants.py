"""Mutated builds of the native C kernels and of Triton kernels: the controls of bitwise claims that
sit below the kernel switch, where the standard kernels are not the alternative (how the C attention
groups its heads, how its threads treat the caller's float mode, how a Triton norm reduces a row).

A C mutant is the kernels' sources with a few lines changed, compiled like the real ones (into the
same cache, keyed by the mutated text, so a second run loads it) and put in place of the loaded
library for one test; a Triton mutant is one kernel's source so changed, jitted anew. A test's
check run on a mutant must fail: that shows it can.
"""

from __future__ import annotations

import importlib.util
import inspect
import tempfile
from pathlib import Path

import pytest

from parity.ops import native


def build(edits: dict[str, str]):
    """The kernels with each `old` text of `edits` (which must occur exactly once in the sources)
    replaced by its `new` text, loaded (a ctypes library in the loaded one's form)."""
    with tempfile.TemporaryDirectory() as tmp:
        texts = {path.name: path.read_text() for path in (*native._SOURCES, *native._HEADERS)}
        for old, new in edits.items():
            where = [name for name, text in texts.items() if text.count(old) == 1]
            assert len(where) == 1 and sum(t.count(old) for t in texts.values()) == 1, \
                f"the mutation's text is not in the sources exactly once: {old!r}"
            texts[where[0]] = texts[where[0]].replace(old, new)
        for name, text in texts.items():
            (Path(tmp) / name).write_text(text)
        return native._build(tuple(Path(tmp) / p.name for p in native._SOURCES),
                             tuple(Path(tmp) / p.name for p in native._HEADERS))


def use(monkeypatch: pytest.MonkeyPatch, lib) -> None:
    """Run the native kernels of this test on `lib` (given back when the test ends)."""
    assert native.library() is not None
    monkeypatch.setattr(native, "_lib", lib)


def triton_kernel(kernel, tmp_path: Path, old: str, new: str):
    """The jitted Triton `kernel` with its text `old` (there exactly once) replaced by `new`, jitted
    from a file under `tmp_path` (Triton reads a kernel's source from its file)."""
    source = inspect.getsource(kernel.fn)
    assert source.count(old) == 1, f"the mutation's text is not in the kernel exactly once: {old!r}"
    path = tmp_path / "triton_mutant.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + source.replace(old, new))
    spec = importlib.util.spec_from_file_location("triton_mutant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, kernel.fn.__name__)
