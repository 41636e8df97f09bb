"""Ctrl-C and SIGTERM held back around work a Python signal handler must not interrupt.

Importing Triton runs its C++ module initialisation, which calls back into Python. A Python
signal handler runs at the next bytecode, and the CLI's SIGTERM handler raises (`Terminated`):
raised inside that initialisation, the exception crossed C++ and the process aborted (SIGABRT,
some 85 lines of C++ traceback) instead of exiting 143 with one line. Inside `signals_held`,
SIGINT and SIGTERM are only noted; the handlers in place before are restored and the signals
raised again right after, so each is handled as it would have been a moment later.

Where parity meets that import: the Triton kernels' first import on a GPU (`ops.get_kernels`), the
first layer recomputed under activation checkpointing (torch's checkpoint imports torch._dynamo,
which imports Triton where it is installed), and PyTorch versions whose optimizer imports
torch._dynamo in a way `rl/optim.py` does not undo.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM noted, not handled, inside the block; re-raised after it (main thread
    only: elsewhere Python handlers do not run, and the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in HELD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(caught):  # (each once, in the order they came)
            signal.raise_signal(s)


def import_held(name: str) -> None:
    """Import module `name` under `signals_held`, unless it is imported already."""
    if name not in sys.modules:
        with signals_held():
            importlib.import_module(name)
