"""The sandbox's seccomp filter: the system calls model-written code never needs, refused.

Built on the host as a classic-BPF program (the launcher only loads it, after no_new_privs, right
before it execs the interpreter). Refused with EPERM: new namespaces (unshare, setns, and clone with
any CLONE_NEW* flag; clone3 answers ENOSYS so libc falls back to clone), mounting and changing root,
the kernel keyrings (keyctl, add_key, request_key), bpf, perf_event_open, userfaultfd, io_uring,
inotify and fanotify, the kernel log (syslog), ptrace and process_vm_readv/writev and pidfd_getfd
(another process's file descriptors), module, kexec, reboot, swap and accounting calls; SysV shared
memory, semaphores and message queues, and POSIX message queues (their memory is no process's:
without an IPC namespace, in the plain modes, a run held 1.6 GiB past a 512 MiB limit in detached
segments that outlived it, and a queue's name carried data to the next run); `fallocate` beyond the
file size (`ARGS_ONLY_X86_64`); and sockets of any family but AF_UNIX, AF_INET and AF_INET6
(`socket`, `socketpair`): the network namespace isolates those, not every family (AF_VSOCK reached
the hypervisor's port space from inside a Firecracker guest). In the plain modes, which have no
namespaces, also `socket` whatever the family (`socketpair` AF_UNIX only), changes to a file's mode,
owner, times, extended attributes and flags (`PLAIN_DENIED_X86_64`, `PLAIN_IOCTLS_REFUSED`), and
scheduling, priority and resource-limit calls on any process but the caller
(`PLAIN_ARGS_ONLY_X86_64`). Every call numbered past `NEWEST_KNOWN` (those a later kernel adds:
listmount, open_tree_attr, ... reached the kernel) answers ENOSYS, as on an older kernel, so the
list cannot fall behind the kernel. A call from another ABI than the filter's (x86-64's x32, 32-bit
entry) kills the process. x86-64 only; elsewhere `build_filter` returns None and the sandbox says
seccomp is unavailable.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS, RET_ALLOW = 0x80000000, 0x7FFF0000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..., BPF_RET|K
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # struct seccomp_data (little-endian: arg0's low word at 16)
ARG_SIZE = 8  # (argument i's low word at OFF_ARG0 + 8 i; pids, flags and modes are 32-bit ints)

CLONE_NEW_FLAGS = 0x7E020080  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

DENIED_X86_64: dict[str, int] = {
    "ptrace": 101, "syslog": 103, "chroot": 161, "acct": 163, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "delete_module": 176,
    "pivot_root": 155, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "inotify_init": 253, "unshare": 272, "inotify_init1": 294, "perf_event_open": 298,
    "fanotify_init": 300, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320,
    "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "pidfd_getfd": 438, "mount_setattr": 442,
    "shmget": 29, "shmat": 30, "semget": 64, "msgget": 68,
    "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244,
    "mq_getsetattr": 245,
}
PLAIN_DENIED_X86_64: dict[str, int] = {
    "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "utime": 132,
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198,
    "fremovexattr": 199, "utimes": 235, "fchownat": 260, "futimesat": 261, "fchmodat": 268,
    "utimensat": 280, "fchmodat2": 452,
}
"""Refused in the plain modes too: a file's mode, owner, times and extended attributes. Landlock
does not cover them, and there the code's uid owns the host's files (root's, as root: a root-owned
binary in reach was made setuid, and a file's attribute carried data from one run to the next)."""
ARGS_ONLY_X86_64: dict[int, tuple[tuple[int, int], ...]] = {285: ((1, 0),)}  # fallocate
"""Calls allowed only with these (argument index, value) pairs, EPERM otherwise, in every mode:
`fallocate` with mode 0 (FALLOC_FL_KEEP_SIZE reserved 2 GiB of disk past the file-size limit)."""
PLAIN_ARGS_ONLY_X86_64: dict[int, tuple[tuple[int, int], ...]] = {
    142: ((0, 0),), 144: ((0, 0),), 203: ((0, 0),), 302: ((0, 0),), 314: ((0, 0),),
    141: ((0, 0), (1, 0)), 251: ((0, 1), (1, 0)),
}
"""The same in the plain modes: sched_setparam, sched_setscheduler, sched_setaffinity, prlimit64 and
sched_setattr of pid 0 only, setpriority and ioprio_set of the calling process only (not by user or
group). Without a pid namespace the code reached the host's processes: `prlimit` set the host's
open-file limit to 12 and its next tool call failed. (The isolated modes' pid namespace keeps the
code to its own processes: `prlimit(os.getpid())` works there.)"""
PLAIN_IOCTLS_REFUSED = (0x40086602, 0x40046602, 0x401C5820)
"""`ioctl` requests refused in the plain modes: FS_IOC_SETFLAGS (64- and 32-bit) and
FS_IOC_FSSETXATTR, a file's flags (nodump was set on a root-owned file out of the run)."""
SYS_IOCTL = 16
CLONE_X86_64, CLONE3 = 56, 435
NEWEST_KNOWN = 452
"""fchmodat2 (Linux 6.6): calls numbered past it answer ENOSYS (libc falls back where it uses one)."""
SOCKET_CALLS_X86_64 = {"socket": 41, "socketpair": 53}
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
"""The only socket families the code may create (`socket`, `socketpair`; EPERM for the others)."""
PLAIN_SOCKET_FAMILIES = {"AF_UNIX": 1}
"""`socketpair`'s only family in the plain modes, where `socket` is refused whatever the family: no
network namespace holds the code there, and a UNIX socket by path reaches whatever listens on
the host (Landlock does not cover connecting to one)."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _refuse(nr: int, arg: int, values: tuple[int, ...], allow: int, eperm: int) -> list[bytes]:
    """For call `nr`: EPERM if argument `arg` is one of `values`, else allowed; other calls jump
    past it."""
    body = [_insn(LD_ABS, 0, 0, OFF_ARG0 + ARG_SIZE * arg)]
    body += [_insn(JEQ, len(values) - i, 0, v) for i, v in enumerate(values)]
    body += [_insn(RET, 0, 0, allow), _insn(RET, 0, 0, eperm)]
    return [_insn(JEQ, 0, len(body), nr)] + body


def _rule(nr: int, checks: tuple[tuple[int, int], ...], allow: int, eperm: int) -> list[bytes]:
    """For call `nr`: allowed if every (argument, value) of `checks` holds, else EPERM; other calls
    jump past it."""
    body: list[bytes] = []
    for i, (arg, value) in enumerate(checks):
        body += [_insn(LD_ABS, 0, 0, OFF_ARG0 + ARG_SIZE * arg),
                 _insn(JEQ, 0, 2 * (len(checks) - i) - 1, value)]
    body += [_insn(RET, 0, 0, allow), _insn(RET, 0, 0, eperm)]
    return [_insn(JEQ, 0, len(body), nr)] + body


def build_filter(machine: str | None = None, plain: bool = False) -> bytes | None:
    """The filter as packed `struct sock_filter` entries, or None where it is not implemented;
    `plain`: for the plain modes (PLAIN_DENIED_X86_64 refused too; `socket` refused, `socketpair`
    AF_UNIX only)."""
    if (machine or platform.machine()) != "x86_64":
        return None
    allow, eperm, enosys = RET_ALLOW, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    prog = [_insn(LD_ABS, 0, 0, OFF_ARCH),
            _insn(JEQ, 1, 0, AUDIT_ARCH_X86_64),
            _insn(RET, 0, 0, RET_KILL_PROCESS),
            _insn(LD_ABS, 0, 0, OFF_NR),
            _insn(JGE, 0, 1, X32_SYSCALL_BIT),
            _insn(RET, 0, 0, RET_KILL_PROCESS),
            _insn(JGE, 0, 1, NEWEST_KNOWN + 1),
            _insn(RET, 0, 0, enosys)]
    denied = {**DENIED_X86_64, **(PLAIN_DENIED_X86_64 if plain else {})}
    for nr in sorted(denied.values()):
        prog += [_insn(JEQ, 0, 1, nr), _insn(RET, 0, 0, eperm)]
    prog += [_insn(JEQ, 0, 1, CLONE3), _insn(RET, 0, 0, enosys)]
    for nr, checks in {**ARGS_ONLY_X86_64, **(PLAIN_ARGS_ONLY_X86_64 if plain else {})}.items():
        prog += _rule(nr, checks, allow, eperm)
    if plain:
        prog += _refuse(SYS_IOCTL, 1, PLAIN_IOCTLS_REFUSED, allow, eperm)
    if plain:  # socket refused; socketpair (the nr is still loaded) AF_UNIX only
        prog += [_insn(JEQ, 0, 1, SOCKET_CALLS_X86_64["socket"]), _insn(RET, 0, 0, eperm)]
        unix = PLAIN_SOCKET_FAMILIES["AF_UNIX"]
        prog += _rule(SOCKET_CALLS_X86_64["socketpair"], ((0, unix),), allow, eperm)
    else:  # socket / socketpair: the family (arg0) must be one of SOCKET_FAMILIES
        prog += [_insn(JEQ, 1, 0, SOCKET_CALLS_X86_64["socket"]),
                 _insn(JEQ, 0, 3 + len(SOCKET_FAMILIES), SOCKET_CALLS_X86_64["socketpair"]),
                 _insn(LD_ABS, 0, 0, OFF_ARG0)]
        families = sorted(SOCKET_FAMILIES.values())
        for i, family in enumerate(families):  # jump to the ALLOW after the last test, else on
            prog.append(_insn(JEQ, len(families) - 1 - i, 1 if i == len(families) - 1 else 0, family))
        prog += [_insn(RET, 0, 0, allow), _insn(RET, 0, 0, eperm)]
    prog += [_insn(JEQ, 0, 3, CLONE_X86_64),
             _insn(LD_ABS, 0, 0, OFF_ARG0),
             _insn(JSET, 0, 1, CLONE_NEW_FLAGS),
             _insn(RET, 0, 0, eperm),
             _insn(RET, 0, 0, allow)]
    return b"".join(prog)


def describe(program: bytes | None, plain: bool = False) -> str:
    if program is None:
        return f"no seccomp filter (not implemented for {platform.machine()})"
    refused = len(DENIED_X86_64) + 2 + (len(PLAIN_DENIED_X86_64) if plain else 0)
    if plain:
        return (f"seccomp filter ({refused} syscalls refused and any newer than Linux 6.6, no sockets but "
                f"UNIX socket pairs, no changes to a file's mode, owner, times, attributes or flags, "
                f"priorities and limits of its own processes only)")
    return (f"seccomp filter ({refused} syscalls refused and any newer than Linux 6.6, sockets only "
            f"{'/'.join(f.removeprefix('AF_') for f in SOCKET_FAMILIES)})")
