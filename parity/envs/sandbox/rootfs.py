"""The sandbox's private root and the system-call helpers the launcher needs.

Imported only by `launcher.py` (which puts this directory on its path: it runs under `python -I`),
never by the host. `build_root` gives the child a mount namespace of its own and a read-only root
on a tmpfs built from the host's mount plan, with a small writable /work, /tmp and /dev/shm, and pivots
into it. Only built-in modules are used (start-up speed).
"""

import ctypes
import os

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # (tests: as syscalls.py has them)
SYS_PIVOT_ROOT = PIVOT_ROOT_NR.get(os.uname().machine)

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


def build_root(t, code, plan, fs_mb, owner):
    """Build the private root under `t` (the run's directory) holding `code` as /work/main.py and
    pivot into it; /work belongs to uid `owner` when it is not None."""
    # A mount namespace of the child's own: pivot_root moves every process of the namespace whose root
    # is the old root, and the launcher must stay outside.
    check(libc.unshare(CLONE_NEWNS), "unshare mount namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Scratch space over T, in this namespace only (T itself may not be searchable by our uid).
    mount("tmpfs", t, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=700")
    root, rw = t + "/root", t + "/rw"
    os.mkdir(root, 0o755)
    os.mkdir(rw, 0o755)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    # (inodes bounded too: empty directories take no blocks, only kernel memory)
    flags, inodes = MS_NOSUID | MS_NODEV | MS_NOEXEC, fs_mb * 256
    mount("tmpfs", rw, "tmpfs", flags, f"size={fs_mb}m,nr_inodes={inodes},mode=755")
    for name in ("work", "tmp", "shm"):
        os.mkdir(rw + "/" + name, 0o755)
    os.chmod(rw + "/tmp", 0o1777)
    os.chmod(rw + "/shm", 0o1777)
    fd = os.open(rw + "/work/main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, code)
    finally:
        os.close(fd)
    if owner is not None:
        os.chown(rw + "/work", owner, owner)
    devices = set()
    for kind, src, arg in plan:
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
    for kind, src, _ in plan:
        if kind == "mask":
            flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
            mount("tmpfs", root + src, "tmpfs", flags, "size=4k,mode=755")
    for name in ("work", "tmp"):
        os.mkdir(root + "/" + name, 0o755)
        mount(rw + "/" + name, root + "/" + name, None, MS_BIND)
    # /dev/shm of the run's own (POSIX shared memory and semaphores: multiprocessing's locks and
    # queues, shared_memory), in the writable tmpfs: within fs_mb, its pages charged to the run
    os.makedirs(root + "/dev/shm", 0o755, exist_ok=True)
    mount(rw + "/shm", root + "/dev/shm", None, MS_BIND)
    os.chdir(root)
    if SYS_PIVOT_ROOT is not None and libc.syscall(SYS_PIVOT_ROOT, b".", b".") == 0:
        check(libc.umount2(b".", MNT_DETACH), "umount old root")
    else:
        os.chroot(".")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    check(libc.sethostname(b"sandbox", 7), "sethostname")
