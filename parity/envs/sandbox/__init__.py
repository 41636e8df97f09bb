"""Run untrusted Python (a model's tool call) in a sandboxed child process, never in the host interpreter.

Each `Sandbox.run` starts a small launcher interpreter (`python -I -S launcher.py`, see that file) with an
empty environment in its own session and temporary directory. The launcher enters new Linux namespaces via
`unshare(2)` (mount, pid, net, ipc, uts; plus user when not root), forks the child that becomes pid 1 of
the new pid namespace, and enforces the wall-clock limit. The child builds a private root on a tmpfs
(read-only bind mounts of /usr and the Python prefix only, installed packages masked, a small writable
/work, /tmp and /dev/shm), pivots into it, drops privileges (a per-run unprivileged uid when root, no
capabilities, no_new_privs), sets rlimits (cpu, address space, file size, process count, open files,
core) and execs a fresh interpreter on the code. When pid 1 dies the kernel kills every process left
in the namespace, so fork bombs and background processes are cleaned up. stdout and stderr come back
through pipes the launcher caps into files the host opened; the host reads them back bounded, by
descriptor, and maps the outcome to a one-line error.

What works is probed once per process. Where namespaces are not permitted, `Sandbox()` refuses to start
(one line naming why); `Sandbox(require_isolation=False)`, or `PARITY_ALLOW_DEGRADED_SANDBOX=1` in the
environment (an operator's switch for every run on such a machine), accepts a degraded sandbox there: a
separate process with rlimits, an empty environment and its own temp directory, under a per-run uid where
the host is root and Python is open to other uids, else under the host's own uid (root without
capabilities, where the host is root), with no sockets but UNIX socket pairs, no setuid or setgid
files and no changes to a file's mode, owner, times or attributes (seccomp; under a per-run uid,
which owns none of the host's files, its own files' modes and times), its processes counted, and,
where the kernel has Landlock, reading only /usr and the Python runtime (not the installed packages
or /usr/local, as in the isolated root) and writing only its own directory (`landlock.py`); and
`describe()` says in capitals what is missing.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ...errors import ConfigError, InputError, ParityError
from . import seccomp
from .host import (
    SandboxLimits,
    ToolResult,
    cgroup_support,
    execute,
    expected_root_listing,
    fmt_bytes,
    others_can_run_python,
    per_run_uid,
)

__all__ = ["Sandbox", "SandboxLimits", "ToolResult"]

_PROBE_CODE = "import os\nprint(sorted(os.listdir('/')))\n"
_others_can_run_python = others_can_run_python  # (tests force the fallback modes with it)


@dataclass(frozen=True)
class _Probe:
    mode: str  # "root" or "user" (isolated), "plain" or "plain-keep-uid"
    reason: str | None  # why isolation is unavailable, for mode "plain"
    protections: tuple[str, ...] = ()  # what the launcher reported in force on the probe run


_WHO = {
    "plain": "as your own uid" if os.geteuid() != 0 else "under a per-run uid",
    "plain-keep-uid": "as root without capabilities",
}
"""Whom model-written code runs as in each degraded mode."""

_DEGRADED = {
    "plain": _WHO["plain"] + (": it can read, write and signal what you can" if os.geteuid() != 0 else
                              ": it can read what every user can"),
    "plain-keep-uid": _WHO["plain-keep-uid"] + ": it can read and write every file root owns, signal root's "
                                               "processes and leave its cgroup",
}
"""What model-written code can do in each degraded mode without Landlock (the refusal and the
start-up line say it). Network sockets are refused by the seccomp filter in these modes."""


def _degraded(mode: str, protections: tuple[str, ...]) -> str:
    """What model-written code can do in degraded `mode` with the launcher's `protections`."""
    if "landlock-fs" not in protections:
        return _DEGRADED[mode]
    text = (f"{_WHO[mode]}, held by Landlock to reading /usr and the Python runtime (not the installed "
            f"packages or /usr/local, whose names, sizes and times stay visible) and writing its own "
            f"directory")
    if "landlock-scope" not in protections:
        text += "; it can signal the processes of its uid"
    if "seccomp" not in protections:
        text += "; it can change the mode, owner and times of the files its uid owns"
        text += "" if "landlock-net" in protections else " and reach the network"
    return text


ALLOW_DEGRADED = "PARITY_ALLOW_DEGRADED_SANDBOX"
"""Set to 1 in the environment: the degraded sandbox is accepted where isolation is unavailable,
whatever `require_isolation` says (said in capitals at start-up all the same)."""

_PROBE: _Probe | None = None
_PROBE_LOCK = threading.Lock()


def _run_probe() -> _Probe:
    modes = ["root", "user"] if os.geteuid() == 0 else ["user"]
    reasons: list[str] = []
    expected = expected_root_listing()
    for mode in modes:
        try:
            result = execute(mode, _PROBE_CODE.encode(), SandboxLimits())
        except OSError as exc:
            reasons.append(f"{mode} mode: {exc}")
            continue
        if result.ok and result.stdout.strip() == expected:
            return _Probe(mode, None, result.protections)
        why = result.error or f"unexpected root listing {result.stdout.strip()[:200]!r}"
        why = why.removeprefix("sandbox setup failed: ")
        if why not in reasons:
            reasons.append(why)
    # The degraded modes: a per-run uid (as root) where the interpreter is open to others, else
    # the caller's uid. As root, the caller's uid (root without capabilities) is taken instead of
    # a per-run one only where the per-run uid cannot open its script (it once could not: every
    # tool call failed "Permission denied", judged the policy's error); any other failure of the
    # probe keeps the per-run uid and is named in the start-up line.
    plain = "plain" if os.geteuid() != 0 or others_can_run_python() else "plain-keep-uid"
    result, protections = _degraded_probe(plain, reasons)
    unreachable = result is not None and "can't open file" in (result.error or "")
    if plain == "plain" and os.geteuid() == 0 and unreachable:
        keep, protections_keep = _degraded_probe("plain-keep-uid", reasons)
        if keep is not None and keep.ok:
            plain, protections = "plain-keep-uid", protections_keep
    return _Probe(plain, "; ".join(reasons) or "no isolation mode worked", protections)


def _degraded_probe(mode: str, reasons: list[str]) -> tuple[ToolResult | None, tuple[str, ...]]:
    """Run the degraded `mode`'s probe; a failure is added to `reasons`."""
    try:
        result = execute(mode, b"print('ok')\n", SandboxLimits())
    except OSError as exc:
        reasons.append(f"{mode} mode: {exc}")
        return None, ()
    if not (result.ok and result.stdout == "ok\n"):
        reasons.append(f"{mode} mode: {result.error or 'the probe printed nothing'}")
    return result, result.protections


def _probe() -> _Probe:
    global _PROBE
    with _PROBE_LOCK:
        if _PROBE is None:
            _PROBE = _run_probe()
        return _PROBE


class Sandbox:
    """Runs model-written Python in a sandboxed child process; see the module docstring.

    `run` is thread-safe: every call has its own process, namespaces and temporary directory.
    """

    def __init__(self, limits: SandboxLimits | None = None, require_isolation: bool = True):
        self.limits = limits if limits is not None else SandboxLimits()
        if not isinstance(self.limits, SandboxLimits):
            raise ConfigError(f"Sandbox.limits must be a SandboxLimits, got {type(self.limits).__name__}")
        probe = _probe()
        self._mode = probe.mode
        self.unavailable_reason: str | None = probe.reason
        self.isolated: bool = probe.mode in ("root", "user")
        if require_isolation and not self.isolated and os.environ.get(ALLOW_DEGRADED) != "1":
            can = _degraded(probe.mode, probe.protections)
            raise ParityError(f"sandbox isolation is unavailable ({probe.reason}); model-written code "
                              f"would run in the degraded sandbox, {can} "
                              f"(task.require_isolation = false, or {ALLOW_DEGRADED}=1, allows it)")
        lim = self.limits
        rlimits = (
            f"rlimits cpu {lim.cpu_s} s / mem {lim.memory_mb} MiB / nproc {lim.nproc} / "
            f"output {fmt_bytes(lim.output_bytes)}"
        )
        protections = ["separate process"]
        if self.isolated:
            user = "user+" if probe.mode == "user" else ""
            protections += [
                f"{user}mount+pid+net+ipc+uts namespaces",
                "private read-only root",
                "no network",
                "empty env",
                "unprivileged per-run uid" if probe.mode == "root" else "no capabilities",
                "no_new_privs",
            ]
        else:
            protections += ["empty env", "own temp working dir"]
            if os.geteuid() == 0 and probe.mode == "plain":
                protections.append("unprivileged per-run uid")
            protections.append("no_new_privs")
        protections += [rlimits, f"wall {lim.wall_s:g} s", "output through pipes"]
        active, missing = set(probe.protections), []
        if "landlock-fs" in active:
            protections.append("Landlock: reads /usr and the Python runtime, writes its own directory only")
        if "landlock-net" in active:
            protections.append("Landlock: no TCP bind or connect")
        if "landlock-scope" in active:
            protections.append("Landlock: signals and abstract sockets within the run")
        if "seccomp" in active:
            plain, own = not self.isolated, per_run_uid(probe.mode)
            program = seccomp.build_filter(plain=plain, per_run_uid=own)
            protections.append(seccomp.describe(program, plain=plain, per_run_uid=own))
        else:
            missing.append(seccomp.describe(seccomp.build_filter()).replace("no ", "NO ", 1)
                           if seccomp.build_filter() is None else "NO seccomp filter (it did not load)")
        if "session-keyring" in active:
            protections.append("own session keyring")
        else:
            missing.append("NO keyring isolation")
        if "ipc-limits" in active:
            protections.append("no SysV IPC")
        elif self.isolated:
            missing.append("NO SysV IPC limits")
        if "cgroup" in active:
            protections.append(f"whole-run cgroup (memory {lim.memory_mb} MiB, {lim.nproc} processes, 1 CPU)")
        else:
            missing.append(f"NO whole-run cgroup ({cgroup_support()[1] or 'the cgroup was not joined'}): "
                           f"processes and CPU limited per process only")
            if "memory-watch" in active:
                protections.append(f"the run's memory summed every 50 ms and held to {lim.memory_mb} MiB")
        self.protections: list[str] = protections
        self._description = "sandbox: " + ", ".join(protections)
        if not self.isolated:
            what = ("namespaces" if "landlock-fs" in active else
                    "filesystem isolation" if "seccomp" in active else "filesystem/network isolation")
            missing.insert(0, f"NO {what} ({probe.reason}): {_degraded(probe.mode, probe.protections)}")
        if missing:
            self._description += "; " + "; ".join(missing)

    def describe(self) -> str:
        """One line for start-up logs saying which protections are active."""
        return self._description

    def run(self, code: str) -> ToolResult:
        """Run `code` as a fresh `python` script in the sandbox; never raises for what the code does."""
        if not isinstance(code, str):
            raise InputError(f"Sandbox.run: code must be a str, got {type(code).__name__}")
        data = code.encode("utf-8", "surrogatepass")
        if len(data) > self.limits.code_bytes:
            return ToolResult(False, "", f"code too long ({len(data)} bytes > {self.limits.code_bytes})", 0.0)
        return execute(self._mode, data, self.limits)
