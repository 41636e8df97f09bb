"""Whole-run limits for the sandbox: one cgroup per run, so that memory (SysV shared memory and
every process included), the number of processes and CPU are bounded for all the run's processes
together — an rlimit bounds each process alone.

cgroup v2 where the unified hierarchy has the memory and pids controllers, else cgroup v1's
memory, pids and cpu hierarchies; none when neither is writable (the sandbox then says so at
start-up). The launcher joins the run's directories before it forks anything; afterwards the
host reads whether the kernel's OOM killer acted in the cgroup (the only memory-limit verdict
that code cannot forge), kills whatever is left in it and removes the directories.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from ...procs import gone as process_gone

ROOT = Path("/sys/fs/cgroup")
PARENT = "parity-sandbox"
V1_CONTROLLERS = ("memory", "pids", "cpu")


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _can_make_child(parent: Path) -> bool:
    """Whether a run's group can be made under `parent` (a parent left by another user's run
    exists but need not be writable)."""
    probe = parent / f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def _v2_ready() -> bool:
    try:
        controllers = (ROOT / "cgroup.controllers").read_text().split()
    except OSError:
        return False
    if not {"memory", "pids"} <= set(controllers):
        return False
    parent = ROOT / PARENT
    try:
        parent.mkdir(exist_ok=True)
        enable = " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in controllers)
        for path in (ROOT / "cgroup.subtree_control", parent / "cgroup.subtree_control"):
            _write(path, enable)
    except OSError:
        return False
    return _can_make_child(parent)


def _v1_ready() -> bool:
    try:
        for c in V1_CONTROLLERS:
            (ROOT / c / PARENT).mkdir(exist_ok=True)
    except OSError:
        return False
    return all(_can_make_child(ROOT / c / PARENT) for c in V1_CONTROLLERS)


def probe() -> tuple[str | None, str]:
    """('v2' | 'v1' | None, why not) for this machine; checked by creating the parent groups."""
    if _v2_ready():
        return "v2", ""
    if all((ROOT / c / "cgroup.procs").exists() for c in V1_CONTROLLERS) and _v1_ready():
        return "v1", ""
    return None, "no writable cgroup v2 or v1 memory/pids/cpu hierarchy"


STALE_AFTER_S = 60.0
"""A run's group or directory is taken for left behind only when its host is gone and it is this old."""


def left_behind(path: Path, pid_field: int) -> bool:
    """Whether `path` (named ...-<pid>-..., the pid its `pid_field`-th '-' field) belongs to a run
    whose host process is gone (SIGKILLed mid-call: nothing closed it) and is older than
    `STALE_AFTER_S`. A live pid, another user's, or one that cannot be read keeps it."""
    pid = path.name.split("-")[pid_field] if path.name.count("-") >= pid_field else ""
    if not pid.isdigit():
        return False
    if not process_gone(pid):
        return False
    try:
        return time.time() - path.stat().st_mtime > STALE_AFTER_S
    except OSError:
        return False


def remove_left_behind(version: str) -> list[str]:
    """Remove the run groups whose host is gone (`left_behind`) and that hold no process (a group
    with one left is another namespace's live run, or the code's leftovers: not ours to judge)."""
    parents = [ROOT / PARENT] if version == "v2" else [ROOT / c / PARENT for c in V1_CONTROLLERS]
    removed = []
    for parent in parents:
        try:
            groups = [d for d in parent.iterdir() if d.name.startswith("run-") and d.is_dir()]
        except OSError:
            continue
        for d in groups:
            try:
                if left_behind(d, 1) and not (d / "cgroup.procs").read_text().split():
                    d.rmdir()
                    removed.append(str(d))
            except OSError:
                pass
    return removed


class RunCgroup:
    """The cgroup(s) of one sandboxed run."""

    def __init__(self, version: str, memory_bytes: int, pids: int, cpus: float = 1.0):
        self.version = version
        name = f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        period = 100_000
        quota = str(int(cpus * period))
        if version == "v2":
            d = ROOT / PARENT / name
            d.mkdir()
            self.dirs = [d]
            for file, value in (("memory.max", str(memory_bytes)), ("memory.swap.max", "0"),
                                ("pids.max", str(pids)), ("cpu.max", f"{quota} {period}")):
                if (d / file).exists():
                    _write(d / file, value)
        else:
            self.dirs = [ROOT / c / PARENT / name for c in V1_CONTROLLERS]
            for d in self.dirs:
                d.mkdir()
            mem, pid_dir, cpu = self.dirs
            _write(mem / "memory.limit_in_bytes", str(memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit
                _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
            _write(pid_dir / "pids.max", str(pids))
            _write(cpu / "cpu.cfs_period_us", str(period))
            _write(cpu / "cpu.cfs_quota_us", quota)

    @property
    def paths(self) -> list[str]:
        return [str(d) for d in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for exceeding the memory limit."""
        mem = self.dirs[0]
        try:
            text = (mem / ("memory.events" if self.version == "v2" else "memory.oom_control")).read_text()
        except OSError:
            return False
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", "0")) > 0

    def kill(self) -> None:
        """SIGKILL every process still in the run's group: without a pid namespace (the plain
        modes) a double-forked, setsid'd process outlived the run (cgroup.kill where the kernel
        has it, else the listed processes, until none is left or a second has passed)."""
        first = self.dirs[0]
        if self.version == "v2" and (first / "cgroup.kill").exists():
            try:
                _write(first / "cgroup.kill", "1")
                return
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                pids = [int(p) for d in self.dirs for p in (d / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                return
            if not pids:
                return
            for pid in set(pids):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def close(self) -> None:
        """Kill what is left of the run and remove the directories (give the kernel a moment)."""
        self.kill()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
