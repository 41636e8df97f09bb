"""The sandbox launcher: builds the isolated environment and runs the model's code in it.

The host (`parity.envs.sandbox`) never imports this file; it runs it as a script, in an empty
environment, with an isolated interpreter that sees no site-packages:

    python -I -S -B launcher.py TMP MODE EXE WALL CPU MEM OUT NPROC FS_MB CGROUPS STATUS_FD OUT_FD ERR_FD
        LANDLOCK [KIND SRC ARG]...

MODE is "root" (namespaces, per-run uid), "user" (a user namespace too), "plain" (no namespaces;
per-run uid when root) or "plain-keep-uid" (no namespaces, uid unchanged). The launcher enters new
mount/pid/net/ipc/uts namespaces, forks the child that becomes pid 1 of the pid namespace (so
everything it starts dies with it), and enforces the wall-clock limit. (In the plain modes the
child stays in the host's namespaces and restricts itself with Landlock where the kernel has it,
to the same paths, `landlock.py`, unless LANDLOCK is 0.) The child builds a private
root on a tmpfs from the mount plan (KIND SRC ARG triples: read-only binds of the Python runtime,
device nodes, symlinks, empty tmpfs masks over installed packages), pivots into it, drops privileges
and capabilities, joins a fresh anonymous session keyring, sets rlimits, loads the seccomp filter
the host built (TMP/seccomp.bpf) and execs a fresh interpreter on TMP/work/main.py. Before anything
else the launcher joins the run's cgroups (CGROUPS: comma-separated directories, or "-"), so every
process of the run counts against the whole-run memory, process and CPU limits; where there are
none, it sums the memory of every process of the run every 50 ms and kills the run beyond MEM MiB
(each process is also held to MEM MiB of address space) or beyond NPROC processes (RLIMIT_NPROC
does not hold root's). In the new IPC namespace it sets the SysV
IPC limits to zero. The code's stdout and stderr are pipes: the launcher keeps at most OUT bytes of
each (in the files the host opened, OUT_FD and ERR_FD) and kills the run when either goes beyond, so
nothing the code does grows a file on the host disk. The code's processes are the OOM killer's first
choice (oom_score_adj 1000), so a run out of memory loses the code, not the launcher's verdict. In
the plain modes the launcher is not dumpable: a process of its uid cannot open its /proc/PID/fd or
read its memory. The launcher writes its verdict to STATUS_FD, a socket to the host that no file
names and the code never holds (it is closed when the code's interpreter is exec'd; a status *file*
in TMP could be rewritten by the code in the plain modes, where TMP is within its reach, and a pipe
reopened through /proc), as "key value" lines: status (wait status of the child), cpu (its cpu
seconds), timeout (1 when the wall limit killed it), out_bytes / err_bytes (what the code wrote),
output_exceeded, memory_exceeded / nproc_exceeded (the watch killed it), protections (the ones
in force), setup (why the sandbox could not be built, when it could not). Only these lines decide
a verdict; what the code prints never does.

Only modules that are built in or cheap to import are used, to keep start-up fast: no json, no re.
"""

import ctypes
import os
import resource
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # rootfs.py, tree.py (python -I)
from landlock import carve, restrict  # noqa: E402
from rootfs import (  # noqa: E402
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    PR_CAPBSET_DROP,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    build_root,
    check,
    libc,
    message,
    prctl,
    put,
)
from tree import kill_run, reap_children, run_memory, run_tree, running  # noqa: E402

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
PR_SET_CHILD_SUBREAPER = 36
KEYCTL_NR = {"x86_64": 250, "aarch64": 219, "riscv64": 219}  # (tests: as syscalls.py has them)
SYS_KEYCTL = KEYCTL_NR.get(os.uname().machine)
KEYCTL_JOIN_SESSION_KEYRING = 1
IPC_LIMITS = (("shmmni", "0"), ("msgmni", "0"), ("sem", "0 0 0 0"))
WATCH_S = 0.05  # how often the run's memory is summed where no cgroup bounds it


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program):
    """Install the host-built BPF program (8 bytes per instruction); needs no_new_privs."""
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")


def report(fd, name):
    os.write(fd, f"ok {name}\n".encode())


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


def child(code, out, err, alive_r, errpipe_w, program):
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if PLAIN:  # (the launcher is not dumpable; this process will be the code's anyway)
        prctl(PR_SET_DUMPABLE, 1)
    try:  # (inherited by every process the code starts; while /proc is still the host's)
        put("/proc/self/oom_score_adj", "1000")
    except OSError:
        pass
    if PLAIN:
        work = T + "/work"
        if DROP_UID:
            os.chown(work, UID, UID)
            os.chmod(T, 0o711)  # the run's uid must pass through TMP to its work directory
        os.chdir(work)
        script, home, tmp = "main.py", work, work
    else:
        build_root(T, code, PLAN, FS_MB, UID if DROP_UID else None)
        os.chdir("/work")
        script, home, tmp = "/work/main.py", "/work", "/tmp"
    null = os.open("/dev/null", os.O_RDWR)
    if PLAIN and LANDLOCK:  # (carved with the launcher's rights: a run's uid may not list a directory)
        wholly, listed = carve([src for kind, src, _ in PLAN if kind == "ro"],
                               [src for kind, src, _ in PLAN if kind == "mask"])
    drop_privileges()
    if PLAIN and LANDLOCK:  # no private root: Landlock holds the code to the runtime and its own directory
        try:  # (a kernel that refuses it leaves the run as on a kernel without it: not reported in force)
            held = restrict(wholly, [src for kind, src, _ in PLAN if kind == "file"],
                            [src for kind, src, _ in PLAN if kind == "dev"], os.getcwd(), listed)
        except OSError:
            held = []
        for name in held:
            report(errpipe_w, name)
    # a keyring of this run's own: the caller's session keyring is out of reach (and the keyring
    # system calls are refused below, so no key outlives the run)
    if SYS_KEYCTL is not None and libc.syscall(SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, None) >= 0:
        report(errpipe_w, "session-keyring")
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
    resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU))  # SIGKILL at the limit (SIGXCPU would dump core)
    resource.setrlimit(resource.RLIMIT_AS, (MEM << 20, MEM << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTB + 1, OUTB + 1))
    # In "user" mode the launcher shares the child's (namespace, uid) process count.
    nproc = NPROC + 1 if MODE == "user" else NPROC
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    if program:
        load_seccomp(program)
        report(errpipe_w, "seccomp")
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


def set_ipc_limits():
    """No SysV shared memory, message queues or semaphores in the run's IPC namespace (they
    escape the address-space limit)."""
    for name, value in IPC_LIMITS:
        put("/proc/sys/kernel/" + name, value)


def pump(pid, pipes, errpipe_r, watch):
    """Read the child's stdout/stderr pipes into the capped files and its setup reports, until
    the pipes close (or shortly after the child exits); kill the run when output goes beyond the
    cap and, with `watch` (no cgroup holds the run), when its processes together hold more than
    MEM MiB or are more than NPROC (polled every WATCH_S). Returns (wait status, rusage, reports,
    bytes per pipe, output exceeded, memory exceeded, processes exceeded)."""
    counts = {fd: 0 for fd in pipes}
    reports, exceeded, done, done_at = b"", False, None, 0.0
    over, crowded, next_watch = False, False, 0.0
    live = set(pipes) | {errpipe_r}
    while live:
        ready, _, _ = select.select(list(live), [], [], WATCH_S if watch else 0.1)
        if watch and not over and done is None and time.monotonic() >= next_watch:
            next_watch = time.monotonic() + WATCH_S
            tree = run_tree()  # (root's processes are exempt from RLIMIT_NPROC: counted here)
            crowded = running(tree) > NPROC
            over = crowded or run_memory(tree) > MEM << 20
        if over:  # (again each round: in the plain modes, orphans of the processes killed)
            kill_run(pid, done is None, PLAIN)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                live.discard(fd)
            elif fd == errpipe_r:
                reports += chunk
            else:
                room = OUTB - counts[fd]
                if room > 0:
                    os.write(pipes[fd], chunk[:room])
                counts[fd] += len(chunk)
                if counts[fd] > OUTB and not exceeded:
                    exceeded = True
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        if done is None:
            waited, status, usage = os.wait4(pid, os.WNOHANG)
            if waited:
                done, done_at = (status, usage), time.monotonic()
        elif time.monotonic() - done_at > 0.5:
            break  # (no pid namespace) a leftover process holds the pipes: stop reading
    if done is None:
        _, status, usage = os.wait4(pid, 0)
        done = (status, usage)
    return done[0], done[1], reports, list(counts.values()), exceeded, over and not crowded, crowded


def main():
    os.umask(0o022)
    if PLAIN:  # the code runs as a uid of ours: keep it out of /proc/PID/fd and mem of this process
        prctl(PR_SET_DUMPABLE, 0)
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # the run's orphans become this process's children
    protections = []
    for cgroup in CGROUPS:  # first, so that every process of the run is counted
        put(cgroup + "/cgroup.procs", str(os.getpid()))
    if CGROUPS:
        protections.append("cgroup")
    with open(T + "/work/main.py", "rb") as f:
        code = f.read()
    program = open(T + "/seccomp.bpf", "rb").read() if os.path.exists(T + "/seccomp.bpf") else b""
    out, err = OUT_FD, ERR_FD
    for fd in (STATUS_FD, out, err):
        os.set_inheritable(fd, False)  # closed at the exec of the code's interpreter

    def write_status(lines):
        os.write(STATUS_FD, ("\n".join(lines) + "\n").encode("utf-8", "replace"))

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
                put("/proc/self/uid_map", f"0 {euid} 1")
                put("/proc/self/gid_map", f"0 {egid} 1")
            try:
                set_ipc_limits()
                protections.append("ipc-limits")
            except OSError:
                pass
    except Exception as exc:
        write_status(["setup " + message(exc)])
        return
    errpipe_r, errpipe_w = os.pipe()
    alive_r, alive_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (errpipe_r, alive_w, out_r, err_r):
                os.close(fd)
            child(code, out_w, err_w, alive_r, errpipe_w, program)
        except BaseException as exc:
            try:
                os.write(errpipe_w, message(exc).encode("utf-8", "replace"))
            except BaseException:
                pass
        os._exit(127)
    for fd in (errpipe_w, alive_r, out_w, err_w):
        os.close(fd)
    timed_out = []

    def on_alarm(signum, frame):
        timed_out.append(True)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, WALL)
    if not CGROUPS:
        protections.append("memory-watch")
    pipes = {out_r: out, err_r: err}
    status, usage, reports, sizes, exceeded, over, crowded = pump(pid, pipes, errpipe_r, not CGROUPS)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if PLAIN:
        reap_children()
    if PLAIN and DROP_UID:
        reap_uid()
    cpu = usage.ru_utime + usage.ru_stime
    lines = [f"status {status}", f"cpu {cpu:.3f}", f"timeout {int(bool(timed_out))}", f"out_bytes {sizes[0]}",
             f"err_bytes {sizes[1]}", f"output_exceeded {int(exceeded)}", f"memory_exceeded {int(over)}",
             f"nproc_exceeded {int(crowded)}"]
    text = reports.decode("utf-8", "replace").splitlines()
    protections += [ln[3:] for ln in text if ln.startswith("ok ")]
    lines.append("protections " + " ".join(protections))
    setup_error = " ".join(" ".join(ln for ln in text if not ln.startswith("ok ")).split())
    if setup_error:
        lines.append("setup " + setup_error)
    write_status(lines)


def configure(argv):
    """Read the host's arguments (see the module docstring) into this module's settings."""
    global T, MODE, EXE, PLAIN, DROP_UID, WALL, CPU, MEM, OUTB, NPROC, FS_MB, CGROUPS, PLAN, UID
    global STATUS_FD, OUT_FD, ERR_FD, LANDLOCK
    T, MODE, EXE = argv[1:4]
    PLAIN = MODE.startswith("plain")
    DROP_UID = os.geteuid() == 0 and MODE in ("root", "plain")
    WALL = float(argv[4])
    CPU, MEM, OUTB, NPROC, FS_MB = (int(a) for a in argv[5:10])
    CGROUPS = [] if argv[10] == "-" else argv[10].split(",")
    STATUS_FD, OUT_FD, ERR_FD = (int(a) for a in argv[11:14])
    LANDLOCK = argv[14] == "1"
    rest = argv[15:]
    PLAN = [tuple(rest[i:i + 3]) for i in range(0, len(rest), 3)]
    # a fresh random uid per run: no kernel state keyed by uid carries over from an earlier run
    UID = 1500000000 + int.from_bytes(os.urandom(4), "little") % (1 << 28)


if __name__ == "__main__":
    configure(sys.argv)
    main()
