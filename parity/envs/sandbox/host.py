"""The host side of the sandbox: resource limits in, a `ToolResult` out, and the launcher run between.

`execute(mode, code, limits)` writes the code into a fresh temporary directory, runs
`launcher.py` on it (by path, with an isolated interpreter and an empty environment, in its own
process group), waits at most the wall limit plus a margin, kills whatever is left, and maps the
launcher's status and the capped output to a result with a one-line error. The host opens the
output files and the log itself and reads them through its own descriptors, never by name again
(in the plain modes the code can reach the run directory: a name replaced by a FIFO hung the
host, one replaced by a symlink had the host read a file for the code); the status comes over a
socket pair (a pipe can be reopened through /proc/PID/fd by a process of the same uid, a socket
cannot). The mount plan says what the private root holds.
"""

from __future__ import annotations

import codecs
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError
from ...fields import known_keywords
from . import cgroup, seccomp
from .mounts import expected_root_listing, mount_plan, others_can_run_python, python_paths

__all__ = ["SandboxLimits", "ToolResult", "cgroup_support", "execute", "expected_root_listing",
           "fmt_bytes", "mount_plan", "others_can_run_python", "python_paths"]

LAUNCHER = Path(__file__).with_name("launcher.py")
"""The script that builds the sandbox and runs the code (never imported by the host)."""
LANDLOCK = True
"""The plain modes restrict the code with Landlock where the kernel has it (False: not; the tests
use it to check the defences behind it, as on a kernel without Landlock)."""

_HOST_MARGIN_S = 2.0  # the launcher enforces wall_s itself; the host kills it only if it is this late
_ERROR_MAX_CHARS = 500  # one-line errors are cut to this length
_ERR_TAIL_BYTES = 8192  # how much of the end of stderr is read to find the last line


@known_keywords()
@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one `Sandbox.run`; every run gets a fresh process and filesystem."""

    wall_s: float = 5.0
    """Wall-clock limit per run, in seconds; the whole process tree is killed when it is reached."""
    cpu_s: int = 4
    """CPU-time limit per process, in seconds (RLIMIT_CPU; the process is killed when it is reached)."""
    memory_mb: int = 512
    """Address-space limit per process, in MiB (RLIMIT_AS); allocations beyond it raise MemoryError."""
    output_bytes: int = 65536
    """Cap on the size of the stdout file and of the stderr file (and any file written; RLIMIT_FSIZE)."""
    nproc: int = 16
    """Most processes the sandboxed code may have at once (RLIMIT_NPROC)."""
    code_bytes: int = 16384
    """Longest code accepted, in UTF-8 bytes; longer code is rejected without running."""
    fs_mb: int = 16
    """Size of the writable tmpfs that holds /work and /tmp, in MiB."""

    def __post_init__(self) -> None:
        wall = self.wall_s
        if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not (0 < wall < math.inf):
            raise ConfigError(f"SandboxLimits.wall_s must be a positive number of seconds, got {wall!r}")
        minimum = {"cpu_s": 1, "memory_mb": 64, "output_bytes": 1, "nproc": 1, "code_bytes": 1, "fs_mb": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"SandboxLimits.{name} must be an integer >= {low}, got {value!r}")


@dataclass
class ToolResult:
    """The outcome of one sandboxed run."""

    ok: bool
    """True when the code exited with status 0 and hit no limit."""
    stdout: str
    """Captured stdout, decoded as UTF-8 with errors replaced and control characters removed, at
    most `output_bytes` bytes of it."""
    error: str | None
    """One line when not ok: a limit that was hit ("sandbox: ..."), or the last line the code wrote
    to stderr (control characters removed, never starting with "sandbox:"); None when ok."""
    elapsed_s: float
    """Wall-clock seconds the run took on the host, start-up included."""
    limit: str | None = None
    """The limit the run hit — 'time', 'cpu', 'memory', 'processes' or 'output' — decided from the launcher's
    status and the kernel alone, never from anything the code printed; None otherwise."""
    protections: tuple[str, ...] = ()
    """What the launcher reports in force for this run (cgroup, ipc-limits, session-keyring, seccomp)."""
    infra: bool = False
    """True when the sandbox could not be set up (before any of the code ran): nothing is known
    about the code, so it must not be judged as the code's failure. (A launcher that leaves no
    verdict is not counted here: in the plain modes the code itself can kill it.)"""


def fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _read_head(fd: int, limit: int) -> tuple[bytes, int]:
    try:
        return os.pread(fd, limit, 0), os.fstat(fd).st_size
    except OSError:
        return b"", 0


def _read_tail(fd: int, limit: int) -> tuple[bytes, int]:
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, limit, max(0, size - limit)), size
    except OSError:
        return b"", 0


def _new_file(tmp: str, name: str) -> int:
    """A fresh file of the run directory, opened for the host to read back by descriptor."""
    return os.open(os.path.join(tmp, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


_STATUS_KEYS = {"status", "cpu", "timeout", "out_bytes", "err_bytes", "output_exceeded", "memory_exceeded",
                "nproc_exceeded", "protections", "setup"}


def _read_status(fd: int) -> dict[str, str]:
    """The launcher's "key value" lines from the host's end of its status socket (non-blocking: a
    launcher killed before writing leaves it empty). Unknown keys and malformed numbers are
    dropped, so the verdict falls to 'launcher failed' rather than an exception."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < 1 << 16 and (chunk := os.read(fd, 4096)):
            data += chunk
    except BlockingIOError:
        pass
    info: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key in _STATUS_KEYS:
            info[key] = value
    for key in ("status", "cpu", "out_bytes", "err_bytes"):
        try:
            float(info[key]) if key == "cpu" else int(info[key])
        except (KeyError, ValueError):
            info.pop(key, None)
    return info


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u034f\u061c\u115f\u1160\u17b4\u17b5"
                      "\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f"
                      "\ufeff\uffa0\ufff9-\ufffb\U000e0000-\U000e007f\U000e0100-\U000e01ef]")
# (and the fillers, joiners and variation selectors that show as nothing)


_LOOK_ALIKES = ("\\u00c0-\\u058f\\u10a0-\\u10ff\\u13a0-\\u13ff\\u1c80-\\u1c8f\\u1d00-\\u1eff\\u2c60-\\u2cff"
                "\\ua4d0-\\ua4ff\\ua640-\\ua69f\\ua720-\\ua7ff\\uab30-\\uabbf")
"""Letters of the scripts with Latin look-alikes that NFKC folding leaves as they are: accented and
extended Latin (A to E), IPA, Greek, Coptic, Cyrillic (and its extensions), Armenian, Georgian,
Cherokee, Lisu, phonetic extensions."""
_COLONS = ":\u02d0\u02f8\u0589\u05c3\u1361\u16ec\u1804\u205a\u2236\ua4fd\ua789\ufe13\ufe55\uff1a"
"""A colon and the marks that look like one (modifier letters, Armenian, Hebrew, Ethiopic, runic,
Mongolian, ratio, Lisu, Latin Ext-D and the presentation forms NFKC would fold anyway)."""


def _loose(words: str) -> str:
    """A pattern for `words` in which any letter may also be a look-alike (`_LOOK_ALIKES`)."""
    return "".join(f"[{c}{_LOOK_ALIKES}]" if c.isalpha() else re.escape(c) for c in words)


_VERDICT_LIKE = re.compile(r"[\W_]*\w?" + _loose("andbox") + "|.*(" + "|".join(
    _loose(w) for w in ("limit exceeded", "killed by signal", "setup failed", "launcher failed")) + ")")
"""A line that reads as one of the sandbox's verdicts: "sandbox..." whatever its letters look like,
or a verdict's wording, in any look-alike letters, anywhere in it."""


def clean(text: str) -> str:
    """`text` without control characters (newlines and tabs kept) or the format characters that
    hide or reorder text (zero-width, bidirectional overrides, byte-order marks, tags): nothing
    the code writes can move a terminal's cursor or hide text in a log."""
    return _CONTROL.sub("", text)


def _verdict_like(line: str) -> bool:
    """Whether a line the code wrote could be read as one of the sandbox's own verdicts (also with
    a look-alike first letter or full-width letters: NFKC-folded before the test)."""
    return _VERDICT_LIKE.match(unicodedata.normalize("NFKC", line).casefold()) is not None


def looks_like_error(line: str) -> bool:
    """Whether a line of the code's stdout could be read as a tool observation's `error:` line:
    `error:` or `sandbox:` first, in any case or look-alike letters."""
    return _ERROR_LIKE.match(unicodedata.normalize("NFKC", line).casefold()) is not None


_ERROR_LIKE = re.compile(r"[\W_]*(" + _loose("error") + r"|\w?" + _loose("andbox") + r")\s*[" + _COLONS + "]")


def _one_line(text: str) -> str:
    text = " ".join(clean(text).split())
    return text if len(text) <= _ERROR_MAX_CHARS else text[: _ERROR_MAX_CHARS - 3] + "..."


def _last_line(data: bytes) -> str:
    lines = [ln for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return _one_line(lines[-1]) if lines else ""


def _wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[bool, bool]:
    """Wait until `proc` exits or `timeout` passes, without reaping it when possible.

    Returns (exited, reaped). An unreaped zombie keeps its process-group id reserved, so the caller can
    still kill the group safely afterwards.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True, True
        except subprocess.TimeoutExpired:
            return False, False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000.0)), False
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


_CGROUP: tuple[str | None, str] | None = None


def _pid_namespace() -> int:
    """This process's pid namespace (its inode; 0 where /proc does not say): a run directory's name
    carries it, so a /tmp shared with another namespace's runs is never swept by pid."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def cgroup_support() -> tuple[str | None, str]:
    """('v1' | 'v2' | None, why not): probed once per process, which then also removes what runs
    of hosts SIGKILLed mid-call left (their groups and temporary directories)."""
    global _CGROUP
    if _CGROUP is None:
        _CGROUP = cgroup.probe()
        if _CGROUP[0] is not None:
            cgroup.remove_left_behind(_CGROUP[0])
        for path in Path(tempfile.gettempdir()).glob(f"parity-sandbox-*-{_pid_namespace()}-*"):
            if cgroup.left_behind(path, 2):  # (only this pid namespace's: another's pids mean nothing here)
                shutil.rmtree(path, ignore_errors=True)
    return _CGROUP


def per_run_uid(mode: str) -> bool:
    """Whether a plain `mode` runs the code under a per-run uid (as root: the launcher's rule), a uid
    that owns none of the host's files."""
    return mode == "plain" and os.geteuid() == 0


def execute(mode: str, code: bytes, limits: SandboxLimits) -> ToolResult:
    """Run `code` once in `mode`; the host side of the launcher protocol."""
    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix=f"parity-sandbox-{os.getpid()}-{_pid_namespace()}-")  # (whose it is)
    version, _ = cgroup_support()
    group = None
    fds: list[int] = []  # out, err, launcher.log (read back by descriptor) and the status socket
    try:
        os.mkdir(os.path.join(tmp, "work"), 0o700)
        with open(os.path.join(tmp, "work", "main.py"), "wb") as f:
            f.write(code)
        program = seccomp.build_filter(plain=mode.startswith("plain"), per_run_uid=per_run_uid(mode))
        if program is not None:
            with open(os.path.join(tmp, "seccomp.bpf"), "wb") as f:
                f.write(program)
        if version is not None:  # the launcher and the code's processes (+1: the launcher)
            try:
                group = cgroup.RunCgroup(version, limits.memory_mb << 20, limits.nproc + 2)
            except OSError as exc:  # (set up before any code runs: not the code's failure)
                return ToolResult(False, "", _one_line(f"sandbox setup failed: the run's cgroup: {exc}"),
                                  time.monotonic() - start, infra=True)
        for name in ("out", "err", "launcher.log"):
            fds.append(_new_file(tmp, name))
        status_r, status_w = (s.detach() for s in socket.socketpair())  # the verdict's channel
        fds += [status_r, status_w]  # (status_w is closed, and dropped, once the launcher has it)
        exe, _ = python_paths()
        argv = [exe, "-I", "-S", "-B", str(LAUNCHER), tmp, mode, exe, repr(float(limits.wall_s))]
        numbers = (limits.cpu_s, limits.memory_mb, limits.output_bytes, limits.nproc, limits.fs_mb)
        plan = [x for triple in mount_plan() for x in triple]  # (the plain modes: Landlock's rules)
        argv += [str(v) for v in numbers] + [",".join(group.paths) if group else "-",
                                             *(str(fd) for fd in (status_w, *fds[:2])), str(int(LANDLOCK)),
                                             *plan]
        proc = subprocess.Popen(argv, env={}, cwd=tmp, stdin=subprocess.DEVNULL, stdout=fds[2],
                                stderr=fds[2], close_fds=True, pass_fds=(status_w, *fds[:2]),
                                start_new_session=True)
        os.close(fds.pop())  # status_w: the launcher's now
        exited = reaped = False
        try:
            exited, reaped = _wait_exit(proc, float(limits.wall_s) + _HOST_MARGIN_S)
        finally:
            if not reaped:
                _kill_group(proc.pid)  # leftovers of the group; the launcher itself when it is late
            proc.wait()
        info = _read_status(status_r)  # (memory_exceeded: the launcher's watch, without a cgroup)
        oom = (group is not None and group.oom_killed()) or info.get("memory_exceeded") == "1"
        return _collect(fds, limits, info, host_timeout=not exited, start=start, oom=oom)
    finally:
        for fd in fds:
            os.close(fd)
        if group is not None:
            group.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(fds: list[int], limits: SandboxLimits, info: dict[str, str], host_timeout: bool, start: float,
             oom: bool) -> ToolResult:
    """The result, its verdict decided by the launcher's status `info` and the kernel (cgroup OOM
    kills, signals, byte counts, timers) only; stderr supplies the error text of a failing program."""
    out, out_size = _read_head(fds[0], limits.output_bytes)
    err, _ = _read_tail(fds[1], _ERR_TAIL_BYTES)
    if int(info.get("out_bytes", out_size) or 0) > len(out):  # cut at the cap: drop a split character
        stdout = codecs.getincrementaldecoder("utf-8")("replace").decode(out, final=False)
    else:
        stdout = out.decode("utf-8", "replace")
    stdout = clean(stdout)
    last = _last_line(err)
    if _verdict_like(last):  # the code's words never read as a verdict
        last = "stderr: " + last

    def done(error: str | None, limit: str | None = None, infra: bool = False) -> ToolResult:
        return ToolResult(ok=error is None, stdout=stdout, error=error, elapsed_s=time.monotonic() - start,
                          limit=limit, protections=tuple(info.get("protections", "").split()), infra=infra)

    if "setup" in info:
        return done(_one_line(f"sandbox setup failed: {info['setup']}"), infra=True)
    code = os.waitstatus_to_exitcode(int(info["status"])) if "status" in info else None
    if info.get("output_exceeded") == "1" or code == -signal.SIGXFSZ:
        return done(f"sandbox: output limit exceeded ({limits.output_bytes} bytes)", "output")
    if host_timeout or info.get("timeout") == "1":
        return done(f"sandbox: time limit exceeded ({float(limits.wall_s)} s wall)", "time")
    if oom:
        return done(f"sandbox: memory limit exceeded ({limits.memory_mb} MiB for the whole run)", "memory")
    if info.get("nproc_exceeded") == "1":
        return done(f"sandbox: process limit exceeded ({limits.nproc} processes for the whole run)",
                    "processes")
    if code is None:
        log, _ = _read_tail(fds[2], _ERR_TAIL_BYTES)
        # not `infra`: in the plain modes the code runs as the launcher's uid and can kill it
        return done(_one_line(f"sandbox launcher failed: {_last_line(log) or 'no status'}"))
    if code < 0:
        sig = -code
        cpu = float(info.get("cpu", "0") or 0)
        # RLIMIT_CPU (soft = hard) kills with SIGKILL; the cpu time wait4 reports for such a kill
        # was 0.91-0.99 s of a 1 s limit on a loaded 2-core machine, 0.75-0.83 s at a load of 3.5
        # (bars of 0.95, then 0.85 read "killed by signal SIGKILL"); a SIGKILL the code sends
        # itself comes with the cpu it used. (soft < hard would end it with SIGXCPU, whose default
        # action dumps core: through a piped core_pattern, RLIMIT_CORE = 0 or not.)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= 0.5 * limits.cpu_s):
            return done(f"sandbox: cpu time limit exceeded ({limits.cpu_s} s)", "cpu")
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return done(f"sandbox: killed by signal {name}")
    if code != 0:
        return done(last or f"exit status {code}")
    return done(None)
