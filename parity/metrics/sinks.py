"""Where a run's metrics go: `metrics.jsonl` (one JSON object per learner step) and, when the
`tensorboard` package is installed, TensorBoard scalars under `tensorboard/`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ParityError


def read_metrics(run_dir: str | Path) -> list[dict]:
    """A run directory's metrics.jsonl as a list of per-step dicts."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsSink:
    """Appends each step's record to metrics.jsonl (flushed per step) and to TensorBoard."""

    def __init__(self, run_dir: Path, records: list[dict]):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self.rewrite(records)
        self.tb = tensorboard_writer(Path(run_dir))

    def write(self, record: dict) -> None:
        """Append one line; on a write failure (a full disk) cut the file back to its last whole
        line and raise a one-line error."""
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
        if self._file is not None:
            self._file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")  # a crash mid-write keeps the old file
        tmp.write_text("".join(json.dumps(m) + "\n" for m in records))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # a full disk can fail the last flush too; the lines are whole
                pass
            self._file = None
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
