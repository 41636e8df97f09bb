"""Where a run's metrics go: `metrics.jsonl` (one JSON object per learner step) and, when the
`tensorboard` package is installed, TensorBoard scalars under `tensorboard/`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..errors import CheckpointError, ParityError

log = logging.getLogger(__name__)


def read_metrics(run_dir: str | Path, before_step: int | None = None) -> list[dict]:
    """A run directory's metrics.jsonl as a list of per-step dicts (with `before_step`, those up
    to the first record of that step or later: a resume keeps the steps its checkpoint holds by
    their numbers, not by line counts).

    A last line cut short (a process killed in the middle of writing it: no newline after it) is
    left out with a warning; any other line that is not a JSON object of numbers with an integer
    "step" is a `CheckpointError` naming the file and the line (a null is read as NaN, as tools
    that cannot write NaN write it)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {exc.start}); it holds the run's "
                              "per-step records: restore or remove it") from None
    lines = [(n, x) for n, x in enumerate(text.split("\n"), 1) if x.strip()]
    records: list[dict] = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(text.split("\n")) and not text.endswith("\n"):
                log.warning("%s: its last line (%d) was cut short and is left out", path, n)
                break
            raise CheckpointError(f"{path} line {n} is not a JSON record ({exc.msg}); fix or remove "
                                  "that line") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{path} line {n} is a JSON {type(record).__name__}, not a record "
                                  "(an object of metric names); fix or remove that line")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"{path} line {n}: its \"step\" is {json.dumps(step)}, not a step "
                                  "number (an integer >= 0); fix or remove that line")
        for key, value in record.items():
            if value is None:  # NaN as other tools write it (pandas' to_json, jq): read back as NaN
                record[key] = float("nan")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CheckpointError(f"{path} line {n}: {key!r} is {json.dumps(value)[:60]}, not a number "
                                      "(every metric is one; NaN may be written NaN or null); fix that line")
        if before_step is not None and step >= before_step:
            break
        records.append(record)
    return records


class MetricsSink:
    """Appends each step's record to metrics.jsonl (flushed per step) and to TensorBoard."""

    def __init__(self, run_dir: Path, records: list[dict]):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self.rewrite(records)
        self.tb = tensorboard_writer(Path(run_dir))

    def write(self, record: dict) -> None:
        """Append one line; on a write failure (a full disk) cut the file back to its last whole
        line and raise a one-line error (the next write opens the file again)."""
        if self._file is None:  # (a failed write or rewrite left none: AttributeError on 'tell')
            self._file = self.path.open("a")
        end = self._file.tell()
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exc:
            try:
                self._file.close()  # flushes what it can; the truncation below removes any part line
            except OSError:
                pass
            self._file = None
            with open(self.path, "r+b") as f:
                f.truncate(end)
            raise ParityError(f"{self.path}: could not write step {record.get('step')} ({exc.strerror}); "
                              "earlier steps are intact") from None
        if self.tb is not None:
            for key, value in record.items():
                if key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def rewrite(self, records: list[dict]) -> None:
        """Replace the file's contents (e.g. after the final evaluation amends the last record)."""
        self.close_file()
        tmp = self.path.with_name(self.path.name + ".tmp")  # a crash mid-write keeps the old file
        try:
            tmp.write_text("".join(json.dumps(m) + "\n" for m in records))
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ParityError(f"{self.path}: could not be rewritten ({exc.strerror or exc}); its "
                              "earlier contents are intact") from None
        self._file = self.path.open("a")

    def close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # a full disk can fail the last flush too; the lines are whole
                pass
            self._file = None

    def close(self) -> None:
        self.close_file()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def tensorboard_writer(run_dir: Path):
    """A TensorBoard SummaryWriter under run_dir/tensorboard when tensorboard is installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))
