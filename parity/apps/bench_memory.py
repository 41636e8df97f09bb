"""`parity bench memory`: a run's peak memory and weight copies against the policy lag.

Each lag trains one short fixed-lag run (deterministic, so the lag binds: batch b is sampled by
version b - lag; `steps` = lag + `--after` so the bound holds for `--after` steps) in a fresh
process, which reports its own peak resident memory (the learner), its rollout worker's (read at
each step boundary) and the most weight versions the learner kept (`sync/versions_kept`). Side by
side: a run whose memory grows with the lag shows it here; parity's stays at a handful of copies.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .. import hardware
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..model import ModelConfig
from .ui import fresh_process, status, table


@dataclass
class MemoryRow:
    lag: int
    steps: int
    held_limit: int
    versions_kept_max: int
    version_mib: float
    learner_peak_gib: float
    worker_peak_gib: float
    wall_s: float

    @property
    def copies_if_kept_per_lag(self) -> int:
        """Weight copies a learner keeping every version back to the lag would hold."""
        return self.lag + 1


def _peak_kib(pid: int) -> int:
    """A live process's peak resident memory in KiB (VmHWM); 0 when it cannot be read. The workers
    are forked from a fork server, so they are not this process's children for getrusage."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _one(preset: str, dtype: str, lag: int, after: int, held: int, max_tokens: int) -> dict:
    """Train the run in this process; its figures as a dict."""
    from ..config import load_config
    from ..rl.controller import Controller

    run_dir = tempfile.mkdtemp(prefix="parity-bench-memory-")
    cfg = load_config(None, [
        f'model.preset="{preset}"', f'model.dtype="{dtype}"', f"max_policy_lag={lag}", f"steps={lag + after}",
        "deterministic=true", "eval_every=0", "checkpoint_every=0", f'run_dir="{run_dir}"',
        "rollout.prompts_per_step=1", "rollout.group_size=2", f"rollout.max_tokens={max_tokens}",
        "learner.micro_batch_size=2", f"rollout.max_held_versions={held}", "task.targets=[7, 8]",
        "rollout.max_num_seqs=2", f"rollout.kv_cache_memory={64 << 20}",  # two short sequences
    ])
    t0 = time.perf_counter()
    controller = Controller(cfg)
    worker_peak = [0]

    def watch(step: int, metrics: dict) -> None:  # (a worker lives until the run ends)
        worker_peak[0] = max([worker_peak[0], *(_peak_kib(p) for p in controller.rollout.pids if p)])

    metrics = controller.run(progress=watch)
    return {
        "lag": lag, "steps": lag + after, "held_limit": held,
        "versions_kept_max": int(max(m["sync/versions_kept"] for m in metrics)),
        "version_mib": metrics[-1]["sync/version_bytes"] / 2**20,
        "learner_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "worker_peak_gib": worker_peak[0] / 2**20,
        "wall_s": time.perf_counter() - t0,
    }


def bench_memory(preset: str = "small", dtype: str = "float32", lags: Sequence[int] = (1, 8, 64),
                 after: int = 16, held: int = 2, max_tokens: int = 8,
                 progress: Callable[[str], None] | None = None) -> list[MemoryRow]:
    rows = []
    for lag in lags:
        if progress:
            progress(f"memory {preset} {dtype} lag {lag} ({lag + after} steps)")
        argv = [preset, dtype, str(lag), str(after), str(held), str(max_tokens)]
        rows.append(MemoryRow(**fresh_process("parity.apps.bench_memory", argv,
                                               f"bench memory: the lag-{lag} run")))
    return rows


def main(args) -> int:
    """`parity bench memory`."""
    if any(lag < 1 for lag in args.lags):
        raise ParityError("--lags must all be >= 1")
    dtype_from_name(args.dtype, "--dtype")  # (was "the lag-1 run failed: ...ConfigError: model.dtype")
    ModelConfig.preset(args.preset)  # (the same, naming model.preset)
    if args.after < 1 or args.max_held_versions < 0:
        raise ParityError("--after must be >= 1 and --max-held-versions >= 0")
    if max(args.lags) + args.after > 10_000_000:  # (each run trains lag + after steps)
        raise ParityError(f"--lags plus --after must be at most 10,000,000 steps, got "
                          f"{max(args.lags) + args.after:,}")
    rows = bench_memory(args.preset, args.dtype, args.lags, args.after, args.max_held_versions,
                        args.max_tokens, progress=lambda m: status(f"bench {m}"))
    status("")
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "preset": args.preset, "dtype": args.dtype,
                          "rows": [{**asdict(r), "copies_if_kept_per_lag": r.copies_if_kept_per_lag}
                                   for r in rows]}, indent=2))
        return 0
    print(f"parity bench memory: {args.preset} in {args.dtype}, fixed-lag runs (deterministic) of lag + "
          f"{args.after} steps, rollout.max_held_versions={args.max_held_versions}")
    print(f"machine: {hardware.line()}")
    print(table(["lag", "steps", "weight copies kept (max)", "kept per lag (lag + 1)", "version MiB",
                 "learner peak GiB", "worker peak GiB", "wall s"],
                [[str(r.lag), str(r.steps), str(r.versions_kept_max), str(r.copies_if_kept_per_lag),
                  f"{r.version_mib:,.1f}",
                  f"{r.learner_peak_gib:.2f}", f"{r.worker_peak_gib:.2f}", f"{r.wall_s:.0f}"] for r in rows]))
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"lag {last.lag} vs lag {first.lag}: learner peak "
              f"x{last.learner_peak_gib / first.learner_peak_gib:.2f}, "
              f"worker peak x{last.worker_peak_gib / first.worker_peak_gib:.2f}, weight copies kept "
              f"{last.versions_kept_max} vs {first.versions_kept_max}")
    return 0


if __name__ == "__main__":  # one run, in its own process (its peak memory is its own)
    preset, dtype, lag, after, held, max_tokens = sys.argv[1:7]
    from .ui import setup_logging

    setup_logging()
    print(json.dumps(_one(preset, dtype, int(lag), int(after), int(held), int(max_tokens))))
