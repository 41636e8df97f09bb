"""The terminal side of the `parity` commands: plain-text tables, a progress display, a transient
status line, and where the library's log messages go.

On a terminal, progress is a live `rich` bar; otherwise (logs, CI) it is one line every few steps.
The library logs through `logging` ("parity.*" loggers); `setup_logging` prints those records on
stderr as `parity: <message>`, so machine-readable stdout (`--json`) stays clean.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys

from ..errors import ParityError


@contextlib.contextmanager
def term_as_interrupt():
    """While the block runs, SIGTERM (what `timeout` and schedulers send at a time limit) raises
    KeyboardInterrupt in the main thread, as Ctrl-C does: a bench catches it and reports the rows
    it measured instead of dying with none."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def collect(rows, stopped: list[str] | None, what: str = "rows", total: int | None = None) -> list:
    """The items of the iterator `rows` until it ends or is interrupted (Ctrl-C, or SIGTERM under
    `term_as_interrupt`): with a `stopped` list the interrupt is noted there ("interrupted: 3 of
    7 shapes done") and the items so far returned; without one it goes on up."""
    out: list = []
    try:
        for row in rows:
            out.append(row)
    except KeyboardInterrupt:
        if stopped is None:
            raise
        stopped.append(f"interrupted: {len(out)}{'' if total is None else f' of {total}'} {what} done")
    return out


def exit_status(stopped: list[str], ok: bool = True) -> int:
    """A benchmark's exit status: 1 if what it measured failed a check, else 130 if it was
    interrupted (Ctrl-C, or a time limit's SIGTERM: the rows printed are partial), else 0."""
    return 1 if not ok else 130 if stopped else 0


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A fixed-width table: the first column left-aligned, the others right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    return "\n".join(lines + [fmt.format(*r) for r in rows])


class RateRow:
    """Mixin for a benchmark row with `aligned_tok_s`, `standard_tok_s`, `flops_per_token` and
    `gemm_gflops` (this machine's GEMM rate for the row's dtype, measured in the same run)."""

    @property
    def ratio(self) -> float:
        return self.aligned_tok_s / self.standard_tok_s

    @property
    def aligned_gflops(self) -> float:
        return self.aligned_tok_s * self.flops_per_token / 1e9

    @property
    def gemm_fraction(self) -> float:
        return self.aligned_gflops / self.gemm_gflops if self.gemm_gflops else 0.0


def gemm_line(rows) -> str:
    """'GEMM rate (2048^3, same run): float32 N GFLOP/s, ...' for the dtypes of `rows`."""
    gemm = {r.dtype: r.gemm_gflops for r in rows}
    return "GEMM rate (2048^3, same run): " + ", ".join(f"{d} {g:,.0f} GFLOP/s" for d, g in gemm.items())


def fresh_process(module: str, argv: list[str], what: str) -> dict:
    """Run `python -m module argv...` (a bench's one measurement, in a process of its own: its
    peak memory is its own) and return the JSON object its last stdout line holds. A failure is
    a ParityError naming `what`, how it ended (a kill: out of memory?) and its last error line."""
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if "warn" not in ln.lower()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        last = (errors or lines or ["no output"])[-1].strip()
        if done.returncode < 0:
            name = signal.Signals(-done.returncode).name
            why = " (out of memory?)" if name == "SIGKILL" else ""
            raise ParityError(f"{what} was killed by {name}{why}; last line: {last}")
        raise ParityError(f"{what} failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def status(msg: str) -> None:
    """A one-line status that overwrites itself, on a terminal only (stderr)."""
    if sys.stderr.isatty():
        print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)


class Progress:
    """A rich bar on a terminal; elsewhere a line `NAME step/total  TEXT` for the first step,
    every `every`-th step and the last."""

    def __init__(self, name: str, total: int, every: int = 1, completed: int = 0, text: str = ""):
        self.name, self.total, self.every = name, total, max(1, every)
        self.bar = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn(name), BarColumn(), MofNCompleteColumn(),
                                    TimeRemainingColumn(), TextColumn("{task.description}"))
            self.task = self.bar.add_task(text, total=total, completed=completed)
            self.bar.start()

    def update(self, step: int, text: str) -> None:
        """Step `step` (0-based) is done; `text` describes it."""
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, description=text)
            if step + 1 >= self.total:
                self.close()
        elif (step + 1) % self.every == 0 or step + 1 == self.total or step == 0:
            print(f"{self.name} {step + 1:>4}/{self.total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time of each record (tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging() -> None:
    """Print the library's INFO and higher records on stderr as `parity: <message>` (once)."""
    root = logging.getLogger("parity")
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("parity: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
