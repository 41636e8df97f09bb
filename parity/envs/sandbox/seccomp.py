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
file size (`ARGS_ONLY`); and sockets of any family but AF_UNIX, AF_INET and AF_INET6
(`socket`, `socketpair`): the network namespace isolates those, not every family (AF_VSOCK reached
the hypervisor's port space from inside a Firecracker guest). In the plain modes, which have no
namespaces, also `socket` whatever the family (`socketpair` AF_UNIX only), changes to a file's mode,
owner, times, extended attributes and flags (`PLAIN_DENIED`, `PLAIN_IOCTLS_REFUSED`; under a per-run
uid its own files' modes and times may change, `OWN_FILES_MODE_ARG`), setuid or setgid files made
(`CREATE_MODE_ARG`), and
scheduling, priority and resource-limit calls on any process but the caller
(`PLAIN_ARGS_ONLY`). Every call numbered past `NEWEST_KNOWN` (those a later kernel adds:
listmount, open_tree_attr, ... reached the kernel) answers ENOSYS, as on an older kernel, so the
list cannot fall behind the kernel. A call from another ABI than the filter's (x86-64's x32 and 32-bit
entry, AArch32) kills the process. For x86-64, aarch64 and riscv64 (`syscalls.py` has their
numbers); elsewhere `build_filter` returns None and the sandbox says seccomp is unavailable.
"""

from __future__ import annotations

import errno
import platform
import struct

from .syscalls import AUDIT_ARCH, NUMBERS

X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS, RET_ALLOW = 0x80000000, 0x7FFF0000
RET_EPERM, RET_ENOSYS = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS  # SECCOMP_RET_ERRNO | errno
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..., BPF_RET|K
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # struct seccomp_data (little-endian: arg0's low word at 16)
ARG_SIZE = 8  # (argument i's low word at OFF_ARG0 + 8 i; pids, flags and modes are 32-bit ints)

CLONE_NEW_FLAGS = 0x7E020080  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

DENIED = (
    "ptrace", "syslog", "chroot", "acct", "mount", "umount2", "swapon", "swapoff", "reboot", "init_module",
    "delete_module", "pivot_root", "kexec_load", "add_key", "request_key", "keyctl", "inotify_init",
    "unshare", "inotify_init1", "perf_event_open", "fanotify_init", "name_to_handle_at",
    "open_by_handle_at", "setns", "process_vm_readv", "process_vm_writev", "finit_module",
    "kexec_file_load", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "pidfd_getfd", "mount_setattr",
    "shmget", "shmat", "semget", "msgget",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
)
"""Refused (EPERM) in every mode, by name: a name the architecture lacks (x86-64's legacy
`inotify_init` on aarch64) has nothing to refuse there."""
PLAIN_DENIED = (
    "chmod", "fchmod", "chown", "fchown", "lchown", "utime", "setxattr", "lsetxattr", "fsetxattr",
    "removexattr", "lremovexattr", "fremovexattr", "utimes", "fchownat", "futimesat", "fchmodat",
    "utimensat", "fchmodat2",
)
"""Refused in the plain modes too: a file's mode, owner, times and extended attributes. Landlock
does not cover them, and there the code's uid owns the host's files (root's, as root: a root-owned
binary in reach was made setuid, and a file's attribute carried data from one run to the next)."""
OWN_FILES_MODE_ARG = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2}
"""Under a per-run uid (the plain mode as root), which owns none of the host's files, a file's mode
may change (the kernel refuses it on files of other uids) but for SETID_BITS: the calls and the
index of their mode argument. `shutil.copy` copies the mode: it failed there (EPERM)."""
OWN_FILES_TIMES = ("utime", "utimes", "futimesat", "utimensat")
"""Allowed under a per-run uid too (`shutil.copy2` copies the times): the kernel lets a uid set the
times of its own files, and only to now on others' it may write."""
SETID_BITS = 0o6000
"""S_ISUID | S_ISGID: refused in a mode under a per-run uid (a program of its own made setuid or
setgid would run as that uid for whoever ran it), and, in every plain mode, in a new file's mode
(CREATE_MODE_ARG)."""
CREATE_MODE_ARG = {"open": 2, "creat": 1, "mknod": 1, "mkdir": 1, "openat": 3, "mknodat": 2, "mkdirat": 2}
"""The calls that make a file or directory with a mode, and the index of that argument: in the
plain modes one with SETID_BITS is refused (EPERM). `os.open(p, O_CREAT, 0o6755)` made a setuid
and setgid file (root's, as root without capabilities; without Landlock one in /tmp outlived the
run). libc passes 0 where no file is made. `openat2`, whose mode sits in a struct the filter cannot
read, answers ENOSYS there (libc and Python open with `openat`)."""
ARGS_ONLY: dict[str, tuple[tuple[int, int], ...]] = {"fallocate": ((1, 0),)}
"""Calls allowed only with these (argument index, value) pairs, EPERM otherwise, in every mode:
`fallocate` with mode 0 (FALLOC_FL_KEEP_SIZE reserved 2 GiB of disk past the file-size limit)."""
PLAIN_ARGS_ONLY: dict[str, tuple[tuple[int, int], ...]] = {
    "sched_setparam": ((0, 0),), "sched_setscheduler": ((0, 0),), "sched_setaffinity": ((0, 0),),
    "prlimit64": ((0, 0),), "sched_setattr": ((0, 0),), "setpriority": ((0, 0), (1, 0)),
    "ioprio_set": ((0, 1), (1, 0)),
}
"""The same in the plain modes: sched_setparam, sched_setscheduler, sched_setaffinity, prlimit64 and
sched_setattr of pid 0 only, setpriority and ioprio_set of the calling process only (not by user or
group). Without a pid namespace the code reached the host's processes: `prlimit` set the host's
open-file limit to 12 and its next tool call failed. (The isolated modes' pid namespace keeps the
code to its own processes: `prlimit(os.getpid())` works there.)"""
PLAIN_IOCTLS_REFUSED = (0x40086602, 0x40046602, 0x401C5820)
"""`ioctl` requests refused in the plain modes: FS_IOC_SETFLAGS (64- and 32-bit) and
FS_IOC_FSSETXATTR, a file's flags (nodump was set on a root-owned file out of the run). The
generic ioctl encoding gives them the same values on every architecture the filter has."""
NEWEST_KNOWN = 452
"""fchmodat2 (Linux 6.6): calls numbered past it answer ENOSYS (libc falls back where it uses one)."""
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


def _relaxed(plain: bool, per_run_uid: bool) -> tuple[str, ...]:
    """The PLAIN_DENIED calls a per-run uid's filter lets through (its own files' modes and times)."""
    return (*OWN_FILES_MODE_ARG, *OWN_FILES_TIMES) if plain and per_run_uid else ()


def _unless_bits(nr: int, arg: int, bits: int, allow: int, eperm: int) -> list[bytes]:
    """For call `nr`: EPERM if argument `arg` has any of `bits` set, else allowed; other calls jump
    past it."""
    body = [_insn(LD_ABS, 0, 0, OFF_ARG0 + ARG_SIZE * arg), _insn(JSET, 0, 1, bits),
            _insn(RET, 0, 0, eperm), _insn(RET, 0, 0, allow)]
    return [_insn(JEQ, 0, len(body), nr)] + body


def build_filter(machine: str | None = None, plain: bool = False, per_run_uid: bool = False) -> bytes | None:
    """The filter for `machine` (this one's by default) as packed `struct sock_filter` entries, or
    None where it is not implemented (an architecture without a table in `syscalls.NUMBERS`);
    `plain`: for the plain modes (PLAIN_DENIED and PLAIN_ARGS_ONLY too; `socket` refused,
    `socketpair` AF_UNIX only); `per_run_uid` (with `plain`): the code's uid owns none of the host's
    files, so its own files' modes (but SETID_BITS) and times may change."""
    arch = machine or platform.machine()
    if arch not in NUMBERS:
        return None
    nr = NUMBERS[arch]
    allow, eperm = RET_ALLOW, RET_EPERM
    prog = [_insn(LD_ABS, 0, 0, OFF_ARCH),
            _insn(JEQ, 1, 0, AUDIT_ARCH[arch]),
            _insn(RET, 0, 0, RET_KILL_PROCESS),
            _insn(LD_ABS, 0, 0, OFF_NR)]
    if arch == "x86_64":  # x32 shares the arch value; its calls carry this bit
        prog += [_insn(JGE, 0, 1, X32_SYSCALL_BIT), _insn(RET, 0, 0, RET_KILL_PROCESS)]
    prog += [_insn(JGE, 0, 1, NEWEST_KNOWN + 1), _insn(RET, 0, 0, RET_ENOSYS)]
    own = _relaxed(plain, per_run_uid)
    denied = [name for name in DENIED + (PLAIN_DENIED if plain else ()) if name in nr and name not in own]
    for number in sorted(nr[name] for name in denied):
        prog += [_insn(JEQ, 0, 1, number), _insn(RET, 0, 0, eperm)]
    prog += [_insn(JEQ, 0, 1, nr["clone3"]), _insn(RET, 0, 0, RET_ENOSYS)]
    for name, checks in {**ARGS_ONLY, **(PLAIN_ARGS_ONLY if plain else {})}.items():
        prog += _rule(nr[name], checks, allow, eperm)
    if plain:
        prog += _refuse(nr["ioctl"], 1, PLAIN_IOCTLS_REFUSED, allow, eperm)
    if own:  # (the times calls are simply not denied)
        prog += [x for name, arg in OWN_FILES_MODE_ARG.items() if name in nr
                 for x in _unless_bits(nr[name], arg, SETID_BITS, allow, eperm)]
    if plain:  # no setuid or setgid file made either
        prog += [x for name, arg in CREATE_MODE_ARG.items() if name in nr
                 for x in _unless_bits(nr[name], arg, SETID_BITS, allow, eperm)]
        prog += [_insn(JEQ, 0, 1, nr["openat2"]), _insn(RET, 0, 0, RET_ENOSYS)]
    if plain:  # socket refused; socketpair (the nr is still loaded) AF_UNIX only
        prog += [_insn(JEQ, 0, 1, nr["socket"]), _insn(RET, 0, 0, eperm)]
        prog += _rule(nr["socketpair"], ((0, PLAIN_SOCKET_FAMILIES["AF_UNIX"]),), allow, eperm)
    else:  # socket / socketpair: the family (arg0) must be one of SOCKET_FAMILIES
        prog += [_insn(JEQ, 1, 0, nr["socket"]),
                 _insn(JEQ, 0, 3 + len(SOCKET_FAMILIES), nr["socketpair"]),
                 _insn(LD_ABS, 0, 0, OFF_ARG0)]
        families = sorted(SOCKET_FAMILIES.values())
        for i, family in enumerate(families):  # jump to the ALLOW after the last test, else on
            prog.append(_insn(JEQ, len(families) - 1 - i, 1 if i == len(families) - 1 else 0, family))
        prog += [_insn(RET, 0, 0, allow), _insn(RET, 0, 0, eperm)]
    prog += [_insn(JEQ, 0, 3, nr["clone"]),
             _insn(LD_ABS, 0, 0, OFF_ARG0),
             _insn(JSET, 0, 1, CLONE_NEW_FLAGS),
             _insn(RET, 0, 0, eperm),
             _insn(RET, 0, 0, allow)]
    return b"".join(prog)


def decide(program: bytes, arch: int, nr: int, *args: int) -> int:
    """What `program` returns for call `nr` with `args` from an ABI whose `seccomp_data.arch` is
    `arch`: the kernel's classic-BPF semantics for the instructions `build_filter` emits (the tests
    and `scripts/seccomp_vm_check.py` hold it to a kernel's verdicts)."""
    words = [a & 0xFFFFFFFFFFFFFFFF for a in args] + [0] * (6 - len(args))
    data = struct.pack("<II", nr & 0xFFFFFFFF, arch) + struct.pack("<Q", 0) + struct.pack("<6Q", *words)
    insns = [struct.unpack("<HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == LD_ABS:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code == RET:
            return k
        else:
            taken = {JEQ: acc == k, JGE: acc >= k, JSET: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)


def describe(program: bytes | None, plain: bool = False, per_run_uid: bool = False) -> str:
    if program is None:
        return f"no seccomp filter (not implemented for {platform.machine()})"
    nr = NUMBERS[platform.machine()]
    own = _relaxed(plain, per_run_uid)
    refused = sum(name in nr and name not in own for name in DENIED + (PLAIN_DENIED if plain else ())) + 2
    if plain:
        files = ("no setuid or setgid files, no changes to a file's owner, attributes or flags" if own else
                 "no setuid or setgid files, no changes to a file's mode, owner, times, attributes or flags")
        return (f"seccomp filter ({refused} syscalls refused and any newer than Linux 6.6, no sockets but "
                f"UNIX socket pairs, {files}, priorities and limits of its own processes only)")
    return (f"seccomp filter ({refused} syscalls refused and any newer than Linux 6.6, sockets only "
            f"{'/'.join(f.removeprefix('AF_') for f in SOCKET_FAMILIES)})")
