"""Run untrusted Python (a model's tool call) in a sandboxed child process, never in the host interpreter.

Each `Sandbox.run` starts a small launcher interpreter (`python -I -S -c _LAUNCHER_SOURCE`) with an empty
environment in its own session and temporary directory. The launcher enters new Linux namespaces via
`unshare(2)` (mount, pid, net, ipc, uts; plus user when not root), forks the child that becomes pid 1 of
the new pid namespace, and enforces the wall-clock limit. The child builds a private root on a tmpfs
(read-only bind mounts of /usr and the Python prefix only, installed packages masked, a small writable
/work and /tmp), pivots into it, drops privileges (a per-run unprivileged uid when root, no capabilities,
no_new_privs), sets rlimits (cpu, address space, file size, process count, open files, core) and execs a
fresh interpreter on the code. When pid 1 dies the kernel kills every process left in the namespace, so
fork bombs and background processes are cleaned up. stdout and stderr go to files capped by
RLIMIT_FSIZE; the host reads them back bounded and maps the outcome to a one-line error.

What works is probed once per process. Where namespaces are not permitted the sandbox degrades to a
separate process with rlimits, an empty environment and its own temp directory, and `describe()` says
loudly that there is NO filesystem/network isolation; `Sandbox(require_isolation=True)` refuses instead.
"""

from __future__ import annotations

import codecs
import math
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ..errors import ConfigError, InputError, ParityError

__all__ = ["Sandbox", "SandboxLimits", "ToolResult"]

_HOST_MARGIN_S = 2.0  # the launcher enforces wall_s itself; the host kills it only if it is this late
_ERROR_MAX_CHARS = 500  # one-line errors are cut to this length
_ERR_TAIL_BYTES = 8192  # how much of the end of stderr is read to find the last line
_PROBE_CODE = "import os\nprint(sorted(os.listdir('/')))\n"

# Runs as `python -I -S -B -c _LAUNCHER_SOURCE TMP MODE EXE WALL CPU MEM OUT NPROC FS_MB [KIND SRC ARG]...`
# in an empty environment. MODE is "root" (namespaces, per-run uid), "user" (user namespace too),
# "plain" (no namespaces; per-run uid when root) or "plain-keep-uid" (no namespaces, uid unchanged).
# It writes TMP/status as "key value" lines: status (wait status of the child), cpu (its cpu seconds),
# timeout (1 when the wall limit killed it), setup (why the sandbox could not be built, when it could
# not). Only modules that are built in or cheap to import are used, to keep start-up fast: no json, no re.
_LAUNCHER_SOURCE = r"""
import ctypes
import os
import resource
import signal
import sys

T, MODE, EXE = sys.argv[1:4]
PLAIN = MODE.startswith("plain")
DROP_UID = os.geteuid() == 0 and MODE in ("root", "plain")
WALL = float(sys.argv[4])
CPU, MEM, OUTB, NPROC, FS_MB = (int(a) for a in sys.argv[5:10])
_rest = sys.argv[10:]
PLAN = [tuple(_rest[i:i + 3]) for i in range(0, len(_rest), 3)]
UID = 1500000000 + os.getpid()

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}.get(os.uname().machine)

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


class Fail(Exception):
    pass


def check(ret, what):
    if ret != 0:
        raise Fail("%s failed: %s" % (what, os.strerror(ctypes.get_errno())))


def enc(s):
    return None if s is None else os.fsencode(s)


def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount %s" % dst)


def prctl(option, arg):
    check(libc.prctl(option, arg, 0, 0, 0), "prctl %d" % option)


def put(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def message(exc):
    if isinstance(exc, Fail):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return "%s%s" % (exc.strerror, ": %s" % exc.filename if exc.filename else "")
    return "%s: %s" % (type(exc).__name__, exc)


def mount_points_under(root):
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().split(b"\n")
    found = []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) < 5:
            continue
        mp = fields[4]
        for esc, ch in ((b"\\040", b" "), (b"\\011", b"\t"), (b"\\012", b"\n"), (b"\\134", b"\\")):
            mp = mp.replace(esc, ch)
        mp = os.fsdecode(mp)
        if mp.startswith(root + "/"):
            found.append(mp)
    return found


def remount_readonly(path, device):
    # Keep flags the original mount already had: in a user namespace they are locked and a remount
    # that drops them fails with EPERM. Atime flags are preserved by the kernel when none are given.
    have = os.statvfs(path).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
    if not device or have & os.ST_NODEV:
        flags |= MS_NODEV
    if device or have & os.ST_NOEXEC:
        flags |= MS_NOEXEC
    mount(None, path, None, flags)


def build_root(code):
    # A mount namespace of the child's own: pivot_root moves every process of the namespace whose root
    # is the old root, and the launcher must stay outside.
    check(libc.unshare(CLONE_NEWNS), "unshare mount namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Scratch space over T, in this namespace only (T itself may not be searchable by our uid).
    mount("tmpfs", T, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=700")
    root, rw = T + "/root", T + "/rw"
    os.mkdir(root, 0o755)
    os.mkdir(rw, 0o755)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    mount("tmpfs", rw, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=%dm,mode=755" % FS_MB)
    os.mkdir(rw + "/work", 0o755)
    os.mkdir(rw + "/tmp", 0o755)
    os.chmod(rw + "/tmp", 0o1777)
    fd = os.open(rw + "/work/main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, code)
    finally:
        os.close(fd)
    if DROP_UID:
        os.chown(rw + "/work", UID, UID)
    devices = set()
    for kind, src, arg in PLAN:
        dst = root + src
        if kind != "mask":
            os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
        if kind == "ln":
            os.symlink(arg, dst)
        elif kind == "ro":
            os.makedirs(dst, 0o755, exist_ok=True)
            mount(src, dst, None, MS_BIND | MS_REC)
        elif kind in ("file", "dev"):
            os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
            mount(src, dst, None, MS_BIND)
            if kind == "dev":
                devices.add(dst)
    # Every bind, submounts included, becomes read-only. A submount whose path no longer resolves
    # (hidden under another mount) is unreachable and left alone.
    for mp in mount_points_under(root):
        try:
            remount_readonly(mp, mp in devices)
        except FileNotFoundError:
            pass
    for kind, src, arg in PLAN:
        if kind == "mask":
            flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
            mount("tmpfs", root + src, "tmpfs", flags, "size=4k,mode=755")
    for name in ("work", "tmp"):
        os.mkdir(root + "/" + name, 0o755)
        mount(rw + "/" + name, root + "/" + name, None, MS_BIND)
    os.chdir(root)
    if SYS_PIVOT_ROOT is not None and libc.syscall(SYS_PIVOT_ROOT, b".", b".") == 0:
        check(libc.umount2(b".", MNT_DETACH), "umount old root")
    else:
        os.chroot(".")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    check(libc.sethostname(b"sandbox", 7), "sethostname")


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def drop_privileges():
    if not PLAIN or os.geteuid() == 0:
        for cap in range(64):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break
    if DROP_UID:
        become_uid()
    check(libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), (CapData * 2)()), "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def child(code, out, err, alive_r, errpipe_w):
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if PLAIN:
        work = T + "/work"
        if DROP_UID:
            os.chown(work, UID, UID)
        os.chdir(work)
        script, home, tmp = "main.py", work, work
    else:
        build_root(code)
        os.chdir("/work")
        script, home, tmp = "/work/main.py", "/work", "/tmp"
    null = os.open("/dev/null", os.O_RDWR)
    drop_privileges()
    # Changing uid clears the parent-death signal: set it again, then make sure the launcher (which
    # holds the write end of alive_r) did not die before it was set.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.set_blocking(alive_r, False)
    try:
        if os.read(alive_r, 1) == b"":
            os._exit(137)
    except BlockingIOError:
        pass
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, errpipe_w)
    os.closerange(errpipe_w + 1, 1 << 20)
    resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU))
    resource.setrlimit(resource.RLIMIT_AS, (MEM << 20, MEM << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTB + 1, OUTB + 1))
    # In "user" mode the launcher shares the child's (namespace, uid) process count.
    nproc = NPROC + 1 if MODE == "user" else NPROC
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": tmp, "PYTHONHASHSEED": "0"}
    os.execve(EXE, [EXE, "-s", "-S", "-B", "-u", script], env)


def reap_uid():
    # Plain mode as root: kill whatever still runs under this run's uid (processes that left the group).
    pid = os.fork()
    if pid == 0:
        try:
            become_uid()
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def become_uid():
    os.setgroups([])
    os.setresgid(UID, UID, UID)
    os.setresuid(UID, UID, UID)


def main():
    os.umask(0o022)
    with open(T + "/work/main.py", "rb") as f:
        code = f.read()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out = os.open(T + "/out", flags, 0o600)
    err = os.open(T + "/err", flags, 0o600)
    status_fd = os.open(T + "/status", flags, 0o600)

    def write_status(lines):
        os.write(status_fd, ("\n".join(lines) + "\n").encode("utf-8", "replace"))

    try:
        if not PLAIN:
            if MODE == "user" and os.geteuid() == 0:
                # Map a kuid of our own, not host root: root's processes are exempt from RLIMIT_NPROC.
                # (This needs an interpreter that other users can reach; the probe checks it works.)
                become_uid()
                prctl(PR_SET_DUMPABLE, 1)  # a uid change made /proc/self/*_map unwritable
            euid, egid = os.geteuid(), os.getegid()
            ns = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
            check(libc.unshare(ns | (CLONE_NEWUSER if MODE == "user" else 0)), "unshare")
            if MODE == "user":
                put("/proc/self/setgroups", "deny")
                put("/proc/self/uid_map", "0 %d 1" % euid)
                put("/proc/self/gid_map", "0 %d 1" % egid)
    except Exception as exc:
        write_status(["setup " + message(exc)])
        return
    errpipe_r, errpipe_w = os.pipe()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(errpipe_r)
            os.close(alive_w)
            child(code, out, err, alive_r, errpipe_w)
        except BaseException as exc:
            try:
                os.write(errpipe_w, message(exc).encode("utf-8", "replace"))
            except BaseException:
                pass
        os._exit(127)
    os.close(errpipe_w)
    os.close(alive_r)
    timed_out = []

    def on_alarm(signum, frame):
        timed_out.append(True)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, WALL)
    setup_error = b""
    while True:
        chunk = os.read(errpipe_r, 4096)
        if not chunk:
            break
        setup_error += chunk
    _, status, usage = os.wait4(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if PLAIN and DROP_UID:
        reap_uid()
    cpu = usage.ru_utime + usage.ru_stime
    lines = ["status %d" % status, "cpu %.3f" % cpu, "timeout %d" % bool(timed_out)]
    if setup_error:
        lines.append("setup " + " ".join(setup_error.decode("utf-8", "replace").split()))
    write_status(lines)


main()
"""


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
    """Captured stdout, decoded as UTF-8 with errors replaced, at most `output_bytes` bytes of it."""
    error: str | None
    """One line when not ok: a limit that was hit, or the last line of the traceback; None when ok."""
    elapsed_s: float
    """Wall-clock seconds the run took on the host, start-up included."""


@dataclass(frozen=True)
class _Probe:
    mode: str  # "root" or "user" (isolated), "plain" or "plain-keep-uid"
    reason: str | None  # why isolation is unavailable, for mode "plain"


_PROBE: _Probe | None = None
_PROBE_LOCK = threading.Lock()
_PLAN: list[tuple[str, str, str]] | None = None


def _under(path: str, parents: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _python_paths() -> tuple[str, list[str]]:
    """The real interpreter and the prefixes it needs, outermost first."""
    exe = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(exe))}
    return exe, sorted(p for p in prefixes if p not in ("", "/"))


def _mount_plan() -> list[tuple[str, str, str]]:
    """What the private root holds, as (kind, host path, arg) triples, parents before children.

    Kinds: "ro" read-only bind of a directory, "file" read-only bind of a file, "dev" bind of a device
    node, "ln" a symlink (arg: its target) mirroring the host, "mask" an empty read-only tmpfs over a
    directory (installed packages, /usr/local) so it is not visible.
    """
    global _PLAN
    if _PLAN is not None:
        return _PLAN
    exe, prefixes = _python_paths()
    binds = ["/usr"]
    links: list[tuple[str, str, str]] = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append(("ln", top, os.readlink(top)))
        elif os.path.isdir(top):
            binds.append(top)
    for prefix in prefixes:
        if not _under(prefix, binds):
            binds.append(prefix)
    plan: list[tuple[str, str, str]] = links + [("ro", b, "") for b in sorted(binds)]
    if os.path.isfile("/etc/ld.so.cache"):
        plan.append(("file", "/etc/ld.so.cache", ""))
    for dev in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"):
        if os.path.exists(dev):
            plan.append(("dev", dev, ""))
    masks: list[str] = []
    if os.path.isdir("/usr/local") and not any(_under(p, ["/usr/local"]) for p in [exe, *prefixes]):
        masks.append("/usr/local")
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for base in [*prefixes, "/usr", "/usr/local"]:
        for sub in (
            f"lib/{version}/site-packages",
            f"lib/{version}/dist-packages",
            "lib/python3/dist-packages",
        ):
            path = os.path.join(base, sub)
            if os.path.isdir(path) and not os.path.islink(path) and _under(path, binds):
                if not _under(path, masks) and os.path.realpath(path) == path:
                    masks.append(path)
    plan += [("mask", m, "") for m in sorted(set(masks))]
    _PLAN = plan
    return plan


def _others_can_run_python() -> bool:
    """Whether an unprivileged uid can run the interpreter (every directory on the way is o+x)."""
    exe, _ = _python_paths()
    for target in (exe, os.path.dirname(os.path.realpath(os.__file__))):
        path = target
        while True:
            try:
                if not os.stat(path).st_mode & stat.S_IXOTH:
                    return False
            except OSError:
                return False
            if path in ("/", ""):
                break
            path = os.path.dirname(path)
    return True


def _expected_root_listing() -> str:
    tops = {p.split("/")[1] for _, p, _ in _mount_plan()} | {"work", "tmp"}
    return repr(sorted(tops))


def _fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _read_head(path: str, limit: int) -> tuple[bytes, int]:
    try:
        with open(path, "rb") as f:
            return f.read(limit), os.fstat(f.fileno()).st_size
    except OSError:
        return b"", 0


def _read_tail(path: str, limit: int) -> tuple[bytes, int]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
            return f.read(limit), size
    except OSError:
        return b"", 0


def _read_status(path: str) -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.rstrip("\n").partition(" ")
                info[key] = value
    except OSError:
        pass
    return info


def _one_line(text: str) -> str:
    text = " ".join(text.split())
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


def _execute(mode: str, code: bytes, limits: SandboxLimits) -> ToolResult:
    """Run `code` once in `mode`; the host side of the launcher protocol."""
    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="parity-sandbox-")
    try:
        os.mkdir(os.path.join(tmp, "work"), 0o700)
        with open(os.path.join(tmp, "work", "main.py"), "wb") as f:
            f.write(code)
        exe, _ = _python_paths()
        argv = [exe, "-I", "-S", "-B", "-c", _LAUNCHER_SOURCE, tmp, mode, exe, repr(float(limits.wall_s))]
        numbers = (limits.cpu_s, limits.memory_mb, limits.output_bytes, limits.nproc, limits.fs_mb)
        argv += [str(v) for v in numbers]
        if not mode.startswith("plain"):
            for triple in _mount_plan():
                argv += triple
        with open(os.path.join(tmp, "launcher.log"), "wb") as log:
            proc = subprocess.Popen(
                argv,
                env={},
                cwd=tmp,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                close_fds=True,
                start_new_session=True,
            )
        exited = reaped = False
        try:
            exited, reaped = _wait_exit(proc, float(limits.wall_s) + _HOST_MARGIN_S)
        finally:
            if not reaped:
                _kill_group(proc.pid)  # leftovers of the group; the launcher itself when it is late
            proc.wait()
        return _collect(tmp, limits, host_timeout=not exited, start=start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(tmp: str, limits: SandboxLimits, host_timeout: bool, start: float) -> ToolResult:
    info = _read_status(os.path.join(tmp, "status"))
    out, out_size = _read_head(os.path.join(tmp, "out"), limits.output_bytes)
    err, err_size = _read_tail(os.path.join(tmp, "err"), _ERR_TAIL_BYTES)
    if out_size > len(out):  # cut mid-stream: leave out a multi-byte character split at the cap
        stdout = codecs.getincrementaldecoder("utf-8")("replace").decode(out, final=False)
    else:
        stdout = out.decode("utf-8", "replace")
    last = _last_line(err)

    def done(error: str | None) -> ToolResult:
        return ToolResult(ok=error is None, stdout=stdout, error=error, elapsed_s=time.monotonic() - start)

    if "setup" in info:
        return done(_one_line(f"sandbox setup failed: {info['setup']}"))
    cap = limits.output_bytes
    if out_size > cap or err_size > cap or last.startswith("OSError: [Errno 27]"):
        return done(f"output limit exceeded ({cap} bytes)")
    if host_timeout or info.get("timeout") == "1":
        return done(f"time limit exceeded ({float(limits.wall_s)} s wall)")
    if "status" not in info:
        log, _ = _read_tail(os.path.join(tmp, "launcher.log"), _ERR_TAIL_BYTES)
        return done(_one_line(f"sandbox launcher failed: {_last_line(log) or 'no status'}"))
    code = os.waitstatus_to_exitcode(int(info["status"]))
    if code < 0:
        sig = -code
        cpu = float(info.get("cpu", "0") or 0)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s - 0.05):
            return done("cpu time limit exceeded")
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return done(f"killed by signal {name}")
    if last.split(":", 1)[0].strip() == "MemoryError":
        return done("memory limit exceeded")
    if code != 0:
        return done(last or f"exit status {code}")
    return done(None)


def _run_probe() -> _Probe:
    modes = ["root", "user"] if os.geteuid() == 0 else ["user"]
    reasons: list[str] = []
    expected = _expected_root_listing()
    for mode in modes:
        try:
            result = _execute(mode, _PROBE_CODE.encode(), SandboxLimits())
        except OSError as exc:
            reasons.append(f"{mode} mode: {exc}")
            continue
        if result.ok and result.stdout.strip() == expected:
            return _Probe(mode, None)
        why = result.error or f"unexpected root listing {result.stdout.strip()[:200]!r}"
        why = why.removeprefix("sandbox setup failed: ")
        if why not in reasons:
            reasons.append(why)
    plain = "plain" if os.geteuid() != 0 or _others_can_run_python() else "plain-keep-uid"
    return _Probe(plain, "; ".join(reasons) or "no isolation mode worked")


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

    def __init__(self, limits: SandboxLimits | None = None, require_isolation: bool = False):
        self.limits = limits if limits is not None else SandboxLimits()
        if not isinstance(self.limits, SandboxLimits):
            raise ConfigError(f"Sandbox.limits must be a SandboxLimits, got {type(self.limits).__name__}")
        probe = _probe()
        self._mode = probe.mode
        self.unavailable_reason: str | None = probe.reason
        self.isolated: bool = probe.mode in ("root", "user")
        if require_isolation and not self.isolated:
            raise ParityError(f"sandbox isolation is unavailable: {probe.reason}")
        lim = self.limits
        rlimits = (
            f"rlimits cpu {lim.cpu_s} s / mem {lim.memory_mb} MiB / nproc {lim.nproc} / "
            f"output {_fmt_bytes(lim.output_bytes)}"
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
            if os.geteuid() == 0:
                protections.append(
                    "unprivileged per-run uid" if probe.mode == "plain" else "root without capabilities"
                )
            protections.append("no_new_privs")
        protections += [rlimits, f"wall {lim.wall_s:g} s"]
        self.protections: list[str] = protections
        self._description = "sandbox: " + ", ".join(protections)
        if not self.isolated:
            self._description += f"; NO filesystem/network isolation ({probe.reason})"

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
        return _execute(self._mode, data, self.limits)
