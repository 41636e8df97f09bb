"""Landlock for the sandbox's plain modes: the filesystem and signals held to the run, without namespaces.

Where namespaces are not permitted (the plain modes: a container's default seccomp profile, a kernel
without unprivileged user namespaces), Landlock, an unprivileged Linux security module (5.13+),
still lets a process restrict itself and every process it starts. `restrict` allows reading and
executing the directories and files of the host's mount plan (/usr, the interpreter's prefix, the
libraries: what the isolated root binds) but not the files below its masks (the installed
packages, /usr/local: Landlock cannot take back a path below one it allows, so a directory with a
mask below it is allowed entry by entry, the entry on the way to the mask left out; `carve`; the
names, sizes and times there stay visible), reading and writing
the plan's device nodes, everything within the run's own working directory, and nothing else: not
the host's files, /proc, or /dev/shm (whose files are memory no process owns, out of the memory
watch's sight). From ABI 6 (Linux 6.12) it also scopes signals and abstract UNIX sockets to the run:
the code cannot signal the host's processes or connect to their abstract sockets. From ABI 4 (Linux
6.7) it refuses TCP bind and connect, which the seccomp filter refuses too where there is one
(x86-64, aarch64 and riscv64: elsewhere this is the plain modes' only bound on the network). What
Landlock does not cover (a file's mode, owner, times and attributes; sockets by path; resource
limits of other processes) the plain modes' seccomp filter refuses (`seccomp.py`).

Imported by `launcher.py` (built-in modules only: it runs under `python -I -S`) and by the tests.
x86-64, aarch64 and riscv64 share the system call numbers.
"""

import ctypes
import os
import stat
import struct

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_V1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3 (IOCTL_DEV, ABI 5, is left unhandled: ioctls as before)
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # (the rights a rule on a non-directory may hold)
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
BIND_TCP, CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4: handled with no rule, no TCP port is allowed
READ_RUNTIME = EXECUTE | READ_FILE | READ_DIR

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is absent, disabled or refused."""
    if os.uname().machine not in ("x86_64", "aarch64", "riscv64"):
        return 0
    version = _libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(int(version), 0)


def handled_fs(version: int) -> int:
    return FS_V1 | (REFER if version >= 2 else 0) | (TRUNCATE if version >= 3 else 0)


def _error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"landlock {what}: {os.strerror(err)}")


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def carve(read_dirs, masks) -> tuple[list[str], list[str]]:
    """The paths to allow so that all of `read_dirs` but `masks` can be read: (wholly, listed only).
    A directory with no mask below it is allowed wholly; one with a mask below it is replaced by its
    entries, the entry on the way to the mask carved in turn and a mask itself left out, and is
    allowed to be listed (the interpreter lists the directories it imports from). Landlock allows
    listing a whole hierarchy, so below a mask names and what `stat` and `readlink` say (sizes,
    times, link targets) stay visible; contents do not. Symbolic links among the entries are left
    out: opening one follows it, and Landlock judges the file it reaches, which is either allowed by
    its own entry or was not readable through the link before. Paths are compared as real paths (a
    mask written through a link or with `.` or `//` in it was a string no directory matched, and its
    parent was allowed whole); a directory that cannot be listed is left out."""
    masks = [os.path.realpath(m) for m in masks]
    wholly: list[str] = []
    listed: list[str] = []

    def walk(path: str) -> None:
        if any(_within(path, m) for m in masks):
            return
        if not any(_within(m, path) for m in masks):
            wholly.append(path)
            return
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return
        listed.append(path)
        for name in names:
            entry = os.path.join(path, name)
            if not os.path.islink(entry):
                walk(entry)

    for top in read_dirs:
        walk(os.path.realpath(top))
    return wholly, listed


def restrict(read_dirs, read_files, devices, own_dir, listed=()) -> list[str]:
    """Restrict this process and its future children: read and execute `read_dirs` and `read_files`,
    list `listed` (`carve` makes both lists from a plan's directories and masks), read and write
    `devices`, do anything within `own_dir`. Needs no_new_privs set. Returns the names
    of the protections now in force ("landlock-fs", "landlock-net" from ABI 4: no TCP bind or connect,
    "landlock-scope" from ABI 6); [] where the
    kernel has no Landlock. Paths that do not exist or that this uid cannot reach are skipped. An
    OSError once the ruleset exists (the kernel refusing a rule or the restriction) leaves this
    process unrestricted; the caller decides."""
    version = abi()
    if version < 1:
        return []
    fs = handled_fs(version)
    net = BIND_TCP | CONNECT_TCP if version >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0
    # struct landlock_ruleset_attr {u64 handled_access_fs, handled_access_net, scoped}: as long as this
    # kernel's ABI knows it (an older kernel refuses a longer one whose extra fields are not zero)
    attr = struct.pack("<QQQ", fs, net, scoped)[:24 if scoped else 16 if net else 8]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _libc.syscall(SYS_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _error("create_ruleset")
    try:
        rules = [(p, READ_RUNTIME) for p in read_dirs] + [(p, READ_DIR) for p in listed]
        rules += [(p, READ_FILE | EXECUTE) for p in read_files]
        rules += [(p, READ_FILE | WRITE_FILE | TRUNCATE) for p in devices] + [(own_dir, fs)]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # (gone, or not this uid's to reach: no rule needed)
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= FILE_RIGHTS
                # struct landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd} (packed)
                rule = ctypes.create_string_buffer(struct.pack("<Qi", access & fs, fd), 12)
                if _libc.syscall(SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH),
                                 rule, ctypes.c_uint32(0)) != 0:
                    raise _error(f"add_rule {path}")
            finally:
                os.close(fd)
        if _libc.syscall(SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise _error("restrict_self")
    finally:
        os.close(ruleset)
    return ["landlock-fs"] + (["landlock-net"] if net else []) + (["landlock-scope"] if scoped else [])
