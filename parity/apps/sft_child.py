"""The base policy built in a fresh process, so that its bits follow the recipe and the machine only.

The base trains on the standard kernels, whose backward sums in an order that follows the
process's thread state, not only its thread count: PyTorch's CPU attention backward gave other
gradients after `torch.set_num_threads(2)` than in a process that never set it, on the same two
threads. A base built in a pytest-xdist worker (one thread), under OMP_NUM_THREADS=1, or after a
study's earlier runs had set their threads was another model: on an Intel Xeon its demo went
49.5% -> 61.0% held-out pass@1 where the documented base's went 49.5% -> 98.5%. So `parity sft`
and every build of a cached base run here: a child started as `parity sft` always was, with the
thread variables left out of its environment, that stops with its parent (SIGTERM: it keeps the
steps trained, `sft_partial`). A Ctrl-C reaches both (one process group); the child finishes its
step and keeps it, and the parent raises KeyboardInterrupt as an in-process build did.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import ParityError, Terminated
from .ui import Progress, setup_logging

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Left out of the child's environment: torch then starts as on the machine, untouched."""
ERROR = "parity: error: "


def build(out_dir: Path, cfg, eval_problems: int = 100, progress_on_stderr: bool = False) -> None:
    """Train the base policy `cfg` (an `SFTConfig`) into `out_dir` in a child process; its log lines
    are this process's, its one-line error is raised here as a `ParityError`. Its progress goes to
    stdout (`parity sft`'s output), or with `progress_on_stderr` to stderr (a build inside another
    command, whose stdout may be JSON)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    argv = [sys.executable, "-m", "parity.apps.sft", str(os.getpid()), str(out_dir),
            json.dumps(dataclasses.asdict(cfg)), str(eval_problems)]
    sys.stdout.flush()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=2 if progress_on_stderr else None,
                            stderr=subprocess.PIPE, text=True, errors="replace")
    errors: list[str] = []
    echo = threading.Thread(target=_echo, args=(proc.stderr, errors), daemon=True)
    echo.start()
    try:
        code = proc.wait()
    except BaseException:  # Ctrl-C (the child had it too) or SIGTERM: it keeps its steps, then ends
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        raise
    finally:
        echo.join(timeout=5)
    if code == 130:
        raise KeyboardInterrupt
    if code == 143:
        raise Terminated()
    if code:
        raise ParityError(errors[-1] if errors else f"building the base policy into {out_dir} failed "
                          f"(exit {code})")


def _echo(stream, errors: list[str]) -> None:
    """Pass the child's stderr on, line by line, keeping its error lines back for the raise."""
    for line in stream:
        if line.startswith(ERROR):
            errors.append(line[len(ERROR):].strip())
        else:
            sys.stderr.write(line)
            sys.stderr.flush()


def child(parent: int, work: Callable[[], None]) -> int:
    """In the child (`python -m parity.apps.sft`): run `work` as `parity sft` ran it; exit 0, 2 (its
    one-line error on stderr, for `build` to raise), 130 (Ctrl-C) or 143 (SIGTERM)."""
    try:  # stop with the parent (SIGTERM: the steps trained are kept), unless it is gone already
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return 143

    def terminate(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, terminate)
    setup_logging()
    try:
        work()
    except KeyboardInterrupt as stop:
        return 143 if isinstance(stop, Terminated) else 130
    except Exception as exc:  # noqa: BLE001 - any failure: one line for the parent to raise
        text = str(exc).strip()
        print(f"{ERROR}{text.splitlines()[0] if text else type(exc).__name__}", file=sys.stderr)
        return 2
    return 0


def progress_bar(total: int) -> Callable[[int, float, float], None]:
    """A progress callback for `train_sft`: a bar on a terminal, else a line every 50 steps."""
    bar = Progress("sft", total, every=50)
    return lambda step, loss, elapsed: bar.update(step, f"loss {loss:.3f}  {elapsed:.0f}s")
