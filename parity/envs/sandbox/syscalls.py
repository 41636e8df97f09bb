"""The system call numbers the sandbox's seccomp filter names, per architecture.

x86-64 has its own table (arch/x86/entry/syscalls/syscall_64.tbl); aarch64 and riscv64 share the
generic one (include/uapi/asm-generic/unistd.h), which has none of x86-64's legacy calls (`chmod`,
`chown`, `utime`, `inotify_init`, ...: only their `*at` forms). Since Linux 5.1 (424 onward) every
architecture numbers new calls alike. `tests/test_sandbox_hardening.py` checks both tables against
the kernel headers where the machine has them, and `scripts/seccomp_vm_check.py` checks the aarch64
filter on an aarch64 kernel.
"""

from __future__ import annotations

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "riscv64": 0xC00000F3}
"""`seccomp_data.arch` of each architecture's native calls (64-bit, little-endian); a call from
another ABI (x86-64's 32-bit entry, AArch32 compat) carries another value."""

_LATER = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435,
    "pidfd_getfd": 438, "mount_setattr": 442, "landlock_create_ruleset": 444, "landlock_add_rule": 445,
    "landlock_restrict_self": 446, "openat2": 437, "fchmodat2": 452,
}
"""Calls added since Linux 5.1, numbered alike on every architecture. (The launcher's own calls,
keyctl, pivot_root and Landlock's, are here too: `launcher.py`, `rootfs.py` and `landlock.py` run
by path with built-in modules only, keep their numbers themselves, and a test holds them to these.)"""

X86_64 = {
    "open": 2, "mkdir": 83, "creat": 85, "mknod": 133, "openat": 257, "mkdirat": 258, "mknodat": 259,
    "ioctl": 16, "shmget": 29, "shmat": 30, "socket": 41, "socketpair": 53, "clone": 56, "semget": 64,
    "msgget": 68, "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "ptrace": 101,
    "syslog": 103, "utime": 132, "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144,
    "pivot_root": 155, "chroot": 161, "acct": 163, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "init_module": 175, "delete_module": 176, "setxattr": 188,
    "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199,
    "sched_setaffinity": 203, "utimes": 235, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242,
    "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "ioprio_set": 251, "inotify_init": 253, "fchownat": 260,
    "futimesat": 261, "fchmodat": 268, "unshare": 272, "utimensat": 280, "fallocate": 285,
    "inotify_init1": 294, "perf_event_open": 298, "fanotify_init": 300, "prlimit64": 302,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "finit_module": 313, "sched_setattr": 314, "kexec_file_load": 320,
    "bpf": 321, "userfaultfd": 323, **_LATER,
}

GENERIC = {
    "mknodat": 33, "mkdirat": 34, "openat": 56,
    "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15,
    "fremovexattr": 16, "inotify_init1": 26, "ioctl": 29, "ioprio_set": 30, "umount2": 39, "mount": 40,
    "pivot_root": 41, "fallocate": 47, "chroot": 51, "fchmod": 52, "fchmodat": 53, "fchownat": 54,
    "fchown": 55, "utimensat": 88, "acct": 89, "unshare": 97, "kexec_load": 104, "init_module": 105,
    "delete_module": 106, "syslog": 116, "ptrace": 117, "sched_setparam": 118,
    "sched_setscheduler": 119, "sched_setaffinity": 122, "setpriority": 140, "reboot": 142,
    "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
    "mq_getsetattr": 185, "msgget": 186, "semget": 190, "shmget": 194, "shmat": 196, "socket": 198,
    "socketpair": 199, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220, "swapon": 224,
    "swapoff": 225, "perf_event_open": 241, "prlimit64": 261, "fanotify_init": 262,
    "name_to_handle_at": 264, "open_by_handle_at": 265, "setns": 268, "process_vm_readv": 270,
    "process_vm_writev": 271, "finit_module": 273, "sched_setattr": 274, "bpf": 280, "userfaultfd": 282,
    "kexec_file_load": 294, **_LATER,
}

NUMBERS = {"x86_64": X86_64, "aarch64": GENERIC, "riscv64": GENERIC}
"""Each architecture's numbers for the calls the filter names; a name an architecture lacks is
absent from its table (the kernel has no such call there to refuse)."""
