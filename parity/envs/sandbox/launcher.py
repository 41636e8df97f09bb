"""The sandbox launcher: builds the isolated environment and runs the model's code in it.

The host (`parity.envs.sandbox`) never imports this file; it runs it as a script, in an empty
environment, with an isolated interpreter that sees no site-packages:

    python -I -S -B launcher.py TMP MODE EXE WALL CPU MEM OUT NPROC FS_MB [KIND SRC ARG]...

MODE is "root" (namespaces, per-run uid), "user" (a user namespace too), "plain" (no
namespaces; per-run uid when root) or "plain-keep-uid" (no namespaces, uid unchanged). The
launcher enters new mount/pid/net/ipc/uts namespaces, forks the child that becomes pid 1 of the
pid namespace (so everything it starts dies with it), and enforces the wall-clock limit. The
child builds a private root on a tmpfs from the mount plan (KIND SRC ARG triples: read-only
binds of the Python runtime, device nodes, symlinks, empty tmpfs masks over installed
packages), pivots into it, drops privileges and capabilities, sets rlimits and execs a fresh
interpreter on TMP/work/main.py. The launcher writes TMP/status as "key value" lines: status
(wait status of the child), cpu (its cpu seconds), timeout (1 when the wall limit killed it),
setup (why the sandbox could not be built, when it could not).

Only modules that are built in or cheap to import are used, to keep start-up fast: no json, no re.
"""

import ctypes
import os
import resource
import signal
import sys

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
        raise Fail(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def enc(s):
    return None if s is None else os.fsencode(s)


def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def prctl(option, arg):
    check(libc.prctl(option, arg, 0, 0, 0), f"prctl {option}")


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
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


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
    mount("tmpfs", rw, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={FS_MB}m,mode=755")
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
    for kind, src, _ in PLAN:
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
                put("/proc/self/uid_map", f"0 {euid} 1")
                put("/proc/self/gid_map", f"0 {egid} 1")
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
    lines = [f"status {status}", f"cpu {cpu:.3f}", f"timeout {int(bool(timed_out))}"]
    if setup_error:
        lines.append("setup " + " ".join(setup_error.decode("utf-8", "replace").split()))
    write_status(lines)


def configure(argv):
    """Read the host's arguments (see the module docstring) into this module's settings."""
    global T, MODE, EXE, PLAIN, DROP_UID, WALL, CPU, MEM, OUTB, NPROC, FS_MB, PLAN, UID
    T, MODE, EXE = argv[1:4]
    PLAIN = MODE.startswith("plain")
    DROP_UID = os.geteuid() == 0 and MODE in ("root", "plain")
    WALL = float(argv[4])
    CPU, MEM, OUTB, NPROC, FS_MB = (int(a) for a in argv[5:10])
    rest = argv[10:]
    PLAN = [tuple(rest[i:i + 3]) for i in range(0, len(rest), 3)]
    UID = 1500000000 + os.getpid()


if __name__ == "__main__":
    configure(sys.argv)
    main()
