"""The sandbox's second line: what an attacker tried after the first escape tests passed.

Each class of attack runs once unsandboxed (the control: it works, so the check can fail) and
once in the sandbox (it must not): the caller's kernel keyrings, SysV IPC and memory beyond the
per-process limit, output that grows files on the host disk, system calls that reach the kernel
(nested user namespaces, mount, bpf, perf, userfaultfd, io_uring, inotify, fanotify, the kernel
log, ptrace), socket families the network namespace does not isolate, verdicts forged by
printing, control and format characters, reused uids, empty directories that fill memory; and in
the degraded modes (no namespaces), the run directory and the launcher's descriptors within the
code's reach.
"""

from __future__ import annotations

import ast
import errno
import os
import platform
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

import parity.envs.sandbox as sandbox_module
from parity.envs.sandbox import Sandbox, SandboxLimits, cgroup, host, landlock
from parity.envs.sandbox.host import cgroup_support
from parity.envs.sandbox.seccomp import (
    ARGS_ONLY,
    CREATE_MODE_ARG,
    DENIED,
    NEWEST_KNOWN,
    OWN_FILES_MODE_ARG,
    OWN_FILES_TIMES,
    PLAIN_ARGS_ONLY,
    PLAIN_DENIED,
    PLAIN_IOCTLS_REFUSED,
    PLAIN_SOCKET_FAMILIES,
    RET_ALLOW,
    RET_ENOSYS,
    RET_EPERM,
    RET_KILL_PROCESS,
    SOCKET_FAMILIES,
    build_filter,
    decide,
)
from parity.envs.sandbox.syscalls import AUDIT_ARCH, NUMBERS

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=4)


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    box = Sandbox(LIMITS)
    if not box.isolated:
        pytest.skip(f"namespace isolation unavailable here: {box.unavailable_reason}")
    return box


def unsandboxed(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


SYSCALLS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return rc, ctypes.get_errno() if rc == -1 else 0
"""

NO_FILTER = "no seccomp filter for this architecture"
NR = NUMBERS.get(platform.machine(), {})
"""This machine's system call numbers, by name."""

# (what, syscall name, args): every one is refused by the filter whatever its arguments
KERNEL_CALLS = [
    ("keyctl: read the caller's session keyring", "keyctl", (0, -3, 0)),
    ("add_key: plant a key", "add_key", (0, 0, 0, 0, -3)),
    ("mount", "mount", (0, 0, 0, 0, 0)),
    ("bpf", "bpf", (0, 0, 0)),
    ("perf_event_open", "perf_event_open", (0, 0, -1, -1, 0)),
    ("userfaultfd", "userfaultfd", (0,)),
    ("io_uring_setup", "io_uring_setup", (1, 0)),
    ("inotify_init1: watch shared read-only files", "inotify_init1", (0,)),
    ("fanotify_init", "fanotify_init", (0, 0)),
    ("syslog: the kernel log", "syslog", (10, 0, 0)),
    ("ptrace", "ptrace", (0, 0, 0, 0)),
    ("unshare: a nested user namespace (last: it changes what the control may do next)", "unshare",
     (0x10000000,)),
]


@pytest.mark.skipif(build_filter() is None, reason=NO_FILTER)
def test_kernel_surface_is_refused_and_reachable_without_the_sandbox(sb: Sandbox) -> None:
    code = SYSCALLS + "".join(f"print(call({NR[name]}, *{args})[1])\n" for _, name, args in KERNEL_CALLS)
    control = unsandboxed(code)
    assert control.returncode == 0, control.stderr
    inside = sb.run(code)
    assert inside.ok, inside.error
    for (name, _, _), outside, got in zip(KERNEL_CALLS, control.stdout.split(), inside.stdout.split()):
        assert int(got) == errno.EPERM, f"{name}: errno {got} in the sandbox"
        assert int(outside) != errno.EPERM, f"{name}: refused even without the sandbox (control)"
    assert set(DENIED) >= {"keyctl", "add_key", "request_key", "unshare", "setns", "mount", "bpf",
                                  "perf_event_open", "userfaultfd", "io_uring_setup", "inotify_init",
                                  "inotify_init1", "fanotify_init", "syslog", "ptrace"}


@pytest.mark.skipif(build_filter() is None, reason=NO_FILTER)
def test_calls_newer_than_the_filter_answer_enosys(sb: Sandbox) -> None:
    """listmount, lsm_set_self_attr and open_tree_attr (Linux 6.8-6.15) reached the kernel from the
    sandbox (EINVAL there): a denylist falls behind each new kernel. Every call past
    `NEWEST_KNOWN` now answers ENOSYS, as on a kernel without it; Python itself needs none."""
    calls = [(458, (0, 0, 0, 0)), (460, (0, 0, 0, 0)), (467, (-1, 0, 0, 0, 0)), (NEWEST_KNOWN + 1, ())]
    code = SYSCALLS + "".join(f"print(call({nr}, *{args})[1])\n" for nr, args in calls)
    inside = sb.run(code)
    assert inside.ok, inside.error
    assert [int(x) for x in inside.stdout.split()] == [errno.ENOSYS] * len(calls)
    outside = [int(x) for x in unsandboxed(code).stdout.split()]
    if tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2]) >= (6, 15):  # (control:
        # this kernel has them)
        assert outside[:3] != [errno.ENOSYS] * 3, outside
    last = SYSCALLS + f"print(call({NEWEST_KNOWN}, -1, 0, 0, 0)[1])\n"  # fchmodat2 itself: let through
    assert sb.run(last).stdout == unsandboxed(last).stdout


def test_the_callers_keyring_is_out_of_reach(sb: Sandbox) -> None:
    """A key the host holds in its session keyring: readable by a plain child, not by the code."""
    secret = "parity-host-key"
    code = SYSCALLS + (
        "rc = libc.syscall(248, b'user', b'parity-probe', b'" + secret + "', 6, ctypes.c_long(-3))\n"
        "print('added' if rc > 0 else 'refused')\n")
    assert "added" in unsandboxed(code).stdout  # the control: keys can be planted
    r = sb.run(code)
    assert r.ok and r.stdout == "refused\n"


def test_sysv_ipc_is_off(sb: Sandbox) -> None:
    """Shared memory escapes the address-space limit (one run held 2 GiB under a 512 MiB limit)."""
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "shm = libc.shmget(0, ctypes.c_size_t(64 << 20), 0o1600)\nprint(shm)\n"
            "print(libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600))\n"
            "if shm >= 0:\n    libc.shmctl(shm, 0, None)\n")
    control = unsandboxed(code + "import sys; sys.stdout.flush()\n")
    assert int(control.stdout.split()[0]) >= 0  # a plain process gets 64 MiB of shared memory
    r = sb.run(code)
    assert r.ok and r.stdout.split() == ["-1", "-1", "-1"]


SIX_PROCESSES = ("import os, time\n"
                 "for _ in range(5):\n    if os.fork() == 0:\n        break\n"
                 "block = bytearray({mib} << 20)\nfor i in range(0, len(block), 4096):\n    block[i] = 1\n"
                 "time.sleep(2)\nprint('held', flush=True)\n"
                 "try:\n    while True:\n        os.wait()\nexcept ChildProcessError:\n    pass\n")


@pytest.mark.parametrize("cgroups", [pytest.param(True, marks=pytest.mark.skipif(
    cgroup_support()[0] is None, reason="no writable cgroups here")), False])
def test_memory_is_bounded_for_the_run_as_a_whole(sb: Sandbox, monkeypatch, cgroups: bool) -> None:
    """Six processes of 150 MiB each stay under the per-process limit (512 MiB) but not under the
    whole-run limit: the kernel's OOM killer acts in the run's cgroup, which is the verdict. Without
    a cgroup (a non-root run: 2026-12-07, the six held 900 MiB, bounded only at 16 x 512 MiB) the
    launcher sums the run's memory every 50 ms and kills it past the limit."""
    if not cgroups:
        monkeypatch.setattr(host, "_CGROUP", (None, "no cgroup: forced by the test"))
    code = SIX_PROCESSES.format(mib=150)
    control = unsandboxed(code)
    assert control.stdout.count("held") == 6  # 900 MiB across processes works without the sandbox
    r = sb.run(code)
    assert not r.ok and r.limit == "memory", (r.error, r.stdout)
    assert r.error == f"sandbox: memory limit exceeded ({LIMITS.memory_mb} MiB for the whole run)"
    assert ("memory-watch" in r.protections) != cgroups
    r = sb.run(SIX_PROCESSES.format(mib=50))  # (300 MiB in all: within the limit, the watch leaves it)
    assert r.ok and r.stdout.count("held") == 6, r
    r = sb.run(SHARED_BY_FORKS)  # (the watch counted a page shared by forks once per process: killed)
    assert r.ok and r.stdout.count("held") == 3, r


SHARED_BY_FORKS = "\n".join([
    "import mmap, os, time",
    "block = bytearray(200 << 20)",
    "for i in range(0, len(block), 4096):",
    "    block[i] = 1",
    "shared = mmap.mmap(-1, 100 << 20)",
    "shared.write(b'x' * (100 << 20))",
    "for _ in range(2):",
    "    if os.fork() == 0:",
    "        time.sleep(1)",
    "        print('held', flush=True)",
    "        os._exit(0)",
    "os.wait()",
    "os.wait()",
    "print('held')", ""])
"""300 MiB written once (copy-on-write heap, a shared mapping), then held by three processes."""


def test_memory_is_bounded_for_the_run_as_a_whole_in_a_degraded_mode(degraded: Sandbox, monkeypatch) -> None:
    """Without namespaces and without a cgroup the run's processes (and the orphans it leaves,
    which the launcher adopts) are summed too."""
    monkeypatch.setattr(host, "_CGROUP", (None, "no cgroup: forced by the test"))
    r = degraded.run(SIX_PROCESSES.format(mib=150))
    assert not r.ok and r.limit == "memory" and "memory-watch" in r.protections, r


def test_sysv_ipc_is_off_in_a_degraded_mode(degraded: Sandbox) -> None:
    """Without an IPC namespace (the plain modes) SysV segments are the host's: eight detached ones
    of 200 MiB held 1.6 GiB under a 512 MiB limit, in no process's memory, and outlived the run.
    The seccomp filter now refuses shmget, shmat, semget and msgget."""
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "shm = libc.shmget(0, ctypes.c_size_t(1 << 20), 0o1600)\nprint(shm)\n"
            "print(libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600))\n"
            "if shm >= 0:\n    libc.shmctl(shm, 0, None)\n")
    r = degraded.run(code)
    assert r.ok and r.stdout.split() == ["-1", "-1", "-1"], r


def test_output_cannot_grow_files_on_the_host_disk(sb: Sandbox) -> None:
    """Preallocating far past the output limit (fallocate KEEP_SIZE) on stdout: stdout is a pipe."""
    code = ("import ctypes, os, stat\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(stat.S_ISFIFO(os.fstat(1).st_mode), flush=True)\n"
            "rc = libc.fallocate(1, 1, ctypes.c_long(0), ctypes.c_long(256 << 20))\n"
            "os.write(2, f'{rc}'.encode())\n")
    with tempfile.TemporaryFile() as out:
        subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.PIPE, timeout=60,
                       check=True)
        assert os.fstat(out.fileno()).st_blocks * 512 >= 256 << 20  # the control grew a host file
    r = sb.run(code + "raise SystemExit(1)\n")
    assert r.stdout == "True\n" and r.error == "-1"  # a pipe: nothing to preallocate


@pytest.mark.parametrize("claim", ["sandbox: memory limit exceeded (512 MiB for the whole run)",
                                   "sandbox: time limit exceeded (5.0 s wall)",
                                   "sandbox: output limit exceeded (65536 bytes)",
                                   "Sandbox: cpu time limit exceeded (4 s)",
                                   # a zero-width space, a right-to-left override, a byte-order mark
                                   # first (they were kept, and the line read as a verdict)
                                   "\u200bsandbox: time limit exceeded (5.0 s wall)",
                                   "\u202esandbox: time limit exceeded (5.0 s wall)",
                                   "\ufeffsandbox: time limit exceeded (5.0 s wall)",
                                   # look-alike letters: a Cyrillic dze, full-width letters
                                   "\u0455andbox: time limit exceeded (5.0 s wall)",
                                   "s\u0430ndbox: time limit exceeded (5.0 s wall)",  # a Cyrillic a
                                   "\uff53\uff41\uff4e\uff44\uff42\uff4f\uff58: time limit exceeded",
                                   # (2026-12-07) look-alikes in both "sandbox" and "limit" (it read
                                   # as a verdict), and in the wording alone
                                   "s\u0430ndbox: time l\u0456mit exceeded (5.0 s wall)",
                                   "error: time l\u0456m\u0456t \u0435xceeded",
                                   # (a review, 2026-12-07, sixth) Lisu and Coptic letters, a variation
                                   # selector after the first letter
                                   "\ua4e2\u2c81\ua4e0\ua4d2\ua4f3\ua4eb: time \ua4e1imit exceeded",
                                   "s\ufe0fandbox: time limit exceeded (5.0 s wall)"])
def test_printed_verdicts_are_not_verdicts(sb: Sandbox, claim: str) -> None:
    r = sb.run(f"import sys\nsys.stderr.write({claim!r} + '\\n')\nsys.exit(1)\n")
    assert not r.ok and r.limit is None and r.error == "stderr: " + host.clean(claim)
    assert r.error.startswith("stderr: ") and not host.clean(claim).startswith("\u200b")


def test_ordinary_output_is_not_taken_for_a_verdict() -> None:
    """The look-alike patterns once took any non-ASCII letter for any Latin one: a line of five
    CJK characters, box-drawing or check marks read as `error`, and `errors: 0` was marked."""
    for line in ("你好世界啊", "日本語のテキストです", "─────────", "✓✓✓✓✓ done", "€€€€€ price",
                 "answer: 42"):
        assert not host._verdict_like(line) and not host.looks_like_error(line), line
    for line in ("errors: 0", "error_rate = 0.5", "ErrorHandler ok", "Sandbox ok", "rate limit exceeded"):
        assert not host.looks_like_error(line), line
    for line in ("error: x", " Error : y", "ERR\u041er: z", "s\u0430ndbox: time limit exceeded",
                 # (2026-12-07, sixth) a variation selector, colon look-alikes, Lisu letters
                 host.clean("e\ufe0frror: sandbox: time limit exceeded"), "error\u02d0 x", "error\u2236 x",
                 "\ua4f0\ua4e3\ua4e3\ua4f3\ua4e3: x"):
        assert host.looks_like_error(line), line


def test_control_characters_are_stripped(sb: Sandbox) -> None:
    r = sb.run("import sys\nprint('a\\x1b[2Jb\\x07c\\tok\\u202eevil\\u200b!\\u3164\\u034f')\n"
               "sys.stderr.write('x\\x00y\\x1b]0;title\\x07z\\u2066\\n')\nsys.exit(2)\n")
    assert r.stdout == "a[2Jbc\tokevil!\n" and r.error == "xy]0;titlez"  # (a Hangul filler and a
    # combining grapheme joiner, which show as nothing, were kept)


def test_every_run_has_its_own_uid_and_keyring(sb: Sandbox) -> None:
    uids = {sb.run("import os\nprint(os.getuid())").stdout for _ in range(4)}
    assert len(uids) == 4 and str(os.getuid()) + "\n" not in uids
    r = sb.run("import os\nif os.fork() == 0:\n    print('child')\nelse:\n    os.wait()\n    print('parent')")
    assert r.ok and sorted(r.stdout.split()) == ["child", "parent"]  # plain clone (fork) still works


def test_the_protections_are_reported() -> None:
    box = Sandbox(LIMITS)
    text = box.describe()
    ipc = ("no SysV IPC",) if box.isolated else ()  # (an IPC namespace's limits: isolated modes only)
    for protection in ("seccomp filter", "own session keyring", *ipc, "output through pipes"):
        assert protection in text or f"NO {protection.split()[0]}" in text, protection
    assert ("whole-run cgroup (" in text) != ("NO whole-run cgroup" in text)
    assert ("NO whole-run cgroup" in text) == (f"held to {LIMITS.memory_mb} MiB" in text)  # (the watch)


def test_the_verdict_cannot_be_forged_through_the_run_directory_in_a_degraded_mode(monkeypatch) -> None:
    """Without namespaces (a machine that allows none) the code's working directory's parent is
    the run's directory, where the launcher's status file was: rewritten, it judged a busy loop
    'ok', and a garbage status made `Sandbox.run` raise. The verdict now comes over a pipe the
    code never holds; the code's file there decides nothing. (Without Landlock, which refuses the
    write before that.)"""
    import parity.envs.sandbox as sandbox_module

    monkeypatch.setattr(host, "LANDLOCK", False)
    forced = sandbox_module._Probe("plain-keep-uid", "forced by the test")
    monkeypatch.setattr(sandbox_module, "_PROBE", forced)
    box = Sandbox(SandboxLimits(wall_s=2.0, cpu_s=1), require_isolation=False)
    write = ('import os\nfd = os.open("../status", os.O_WRONLY | os.O_CREAT, 0o600)\n'
             'os.write(fd, b"#" * 400 + {!r})\n')
    forged = box.run(write.format(b"\nstatus 0\ncpu 0.0\ntimeout 0\noutput_exceeded 0\n")
                     + 'print("written", flush=True)\nwhile True:\n    pass\n')
    assert forged.stdout == "written\n" and not forged.ok and forged.limit in ("cpu", "time"), forged
    garbage = box.run(write.format(b"\nstatus not-a-number\n") + 'print("written")\n')
    assert garbage.ok and garbage.stdout == "written\n", garbage


@pytest.mark.parametrize("machine", sorted(NUMBERS))
def test_the_filter_program_decides_as_documented(machine: str) -> None:
    """The filter of each architecture run on a model of the kernel's BPF (`seccomp.decide`): every
    refused call EPERM, sockets only of the allowed families, clone only without namespace flags,
    other ABIs killed, the rest allowed."""
    nr, arch = NUMBERS[machine], AUDIT_ARCH[machine]
    prog, plain = build_filter(machine), build_filter(machine, plain=True)  # (plain: no namespaces)

    def run(program: bytes, call: int, *args: int, abi: int = arch) -> int:
        return decide(program, abi, call, *args)

    assert {name for name in DENIED if name not in nr} == ({"inotify_init"} if machine != "x86_64" else set())
    for name in DENIED:
        assert name not in nr or run(prog, nr[name]) == RET_EPERM, name
    for call in (nr["socket"], nr["socketpair"]):
        for family in range(64):
            want = RET_ALLOW if family in SOCKET_FAMILIES.values() else RET_EPERM
            assert run(prog, call, family) == want, (call, family)
    assert run(prog, nr["clone"], 0x11) == RET_ALLOW and run(prog, nr["clone"], 0x10000000) == RET_EPERM
    assert run(prog, nr["clone3"]) == RET_ENOSYS and run(prog, NEWEST_KNOWN + 1) == RET_ENOSYS
    assert run(prog, NEWEST_KNOWN, -1) == RET_ALLOW  # (fchmodat2, in the isolated modes)
    allowed = {"x86_64": (0, 1, 2, 3, 9, 59), "aarch64": (56, 57, 63, 64, 221, 222)}  # read/openat .. execve
    for call in allowed.get(machine, allowed["aarch64"]):
        assert run(prog, call) == RET_ALLOW == run(plain, call), call
    for other in set(AUDIT_ARCH.values()) - {arch} | {0x40000003, 0x40000028}:  # (i386, AArch32)
        assert run(prog, 0, abi=other) == RET_KILL_PROCESS == run(plain, 0, abi=other), hex(other)
    if machine == "x86_64":  # x32 shares x86-64's arch value
        assert run(prog, 0x40000000 | 41, 40) == RET_KILL_PROCESS
    for family in range(64):
        assert run(plain, nr["socket"], family) == RET_EPERM, family
        want = RET_ALLOW if family in PLAIN_SOCKET_FAMILIES.values() else RET_EPERM
        assert run(plain, nr["socketpair"], family) == want, family
    refused = [nr[name] for name in DENIED + PLAIN_DENIED if name in nr]
    assert len(refused) == {"x86_64": 69}.get(machine, 62)  # (no chmod, chown, lchown, utime(s), futimesat)
    assert all(run(plain, call) == RET_EPERM for call in refused)
    assert all(run(prog, nr[name]) == RET_ALLOW for name in PLAIN_DENIED if name in nr)  # (isolated: allowed)
    rules = [(prog, ARGS_ONLY), (plain, {**ARGS_ONLY, **PLAIN_ARGS_ONLY})]
    for program, table in rules:  # fallocate's mode; in the plain modes the caller's own processes only
        for name, checks in table.items():
            args = dict(checks)
            assert run(program, nr[name], args.get(0, 0), args.get(1, 0)) == RET_ALLOW, name
            for arg, value in checks:  # any one argument otherwise: refused
                other = {**args, arg: value + 4242}
                assert run(program, nr[name], other.get(0, 0), other.get(1, 0)) == RET_EPERM, (name, arg)
    assert all(run(prog, nr[name], 4242, 4242) == RET_ALLOW for name in PLAIN_ARGS_ONLY)  # (pid ns)
    for request in PLAIN_IOCTLS_REFUSED:  # a file's flags: refused in the plain modes only
        assert run(plain, nr["ioctl"], 3, request) == RET_EPERM
        assert run(prog, nr["ioctl"], 3, request) == RET_ALLOW
    assert run(plain, nr["ioctl"], 3, 0x5401) == RET_ALLOW  # (TCGETS, as isatty asks)
    for name, arg in CREATE_MODE_ARG.items():  # no setuid or setgid file made, in the plain modes
        if name in nr:
            args = [3, 0, 0, 0][:arg]
            assert run(plain, nr[name], *args, 0o755) == RET_ALLOW == run(prog, nr[name], *args, 0o4755)
            assert run(plain, nr[name], *args, 0o4755) == RET_EPERM == run(plain, nr[name], *args, 0o2700)
    assert run(plain, nr["openat2"]) == RET_ENOSYS and run(prog, nr["openat2"]) == RET_ALLOW
    own = build_filter(machine, plain=True, per_run_uid=True)  # (a uid that owns no host file)
    for name, arg in OWN_FILES_MODE_ARG.items():  # its own files' modes, but setuid and setgid
        if name in nr:
            for mode, want in ((0o644, RET_ALLOW), (0o1777, RET_ALLOW), (0o4755, RET_EPERM),
                               (0o2755, RET_EPERM), (0o6755, RET_EPERM)):
                args = [3, 0, 0][:arg] + [mode]
                assert run(own, nr[name], *args) == want, (name, oct(mode))
                assert run(plain, nr[name], *args) == RET_EPERM, name
    assert all(run(own, nr[name]) == RET_ALLOW for name in OWN_FILES_TIMES if name in nr)
    relaxed = {nr[name] for name in (*OWN_FILES_MODE_ARG, *OWN_FILES_TIMES) if name in nr}
    kept = [nr[name] for name in PLAIN_DENIED if name in nr and nr[name] not in relaxed]
    assert len(kept) == {"x86_64": 10}.get(machine, 8) and all(run(own, call) == RET_EPERM for call in kept)
    assert all(run(own, call) == run(plain, call) for call in range(NEWEST_KNOWN + 2) if call not in relaxed)


def test_the_launchers_own_call_numbers_are_the_tables() -> None:
    """The launcher, rootfs.py and landlock.py run by path with built-in modules only, so they keep
    the numbers of their own calls (keyctl, pivot_root, Landlock's) themselves: on every
    architecture they must be those of `syscalls.py`, which the headers check."""
    here = os.path.dirname(sandbox_module.__file__)

    def constant(module: str, name: str):
        tree = ast.parse(open(os.path.join(here, module)).read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], (ast.Name, ast.Tuple)):
                names = [t.id for t in getattr(node.targets[0], "elts", [node.targets[0]])]
                if name in names:
                    value = ast.literal_eval(node.value)
                    return value[names.index(name)] if len(names) > 1 else value
        raise AssertionError(f"no {name} in {module}")

    for machine, table in NUMBERS.items():
        assert constant("launcher.py", "KEYCTL_NR")[machine] == table["keyctl"], machine
        assert constant("rootfs.py", "PIVOT_ROOT_NR")[machine] == table["pivot_root"], machine
        for name, call in (("SYS_CREATE_RULESET", "landlock_create_ruleset"),
                           ("SYS_ADD_RULE", "landlock_add_rule"),
                           ("SYS_RESTRICT_SELF", "landlock_restrict_self")):
            assert constant("landlock.py", name) == table[call], (machine, name)


GENERIC_HEADER = "/usr/include/asm-generic/unistd.h"
HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": GENERIC_HEADER,
           "riscv64": GENERIC_HEADER}


@pytest.mark.parametrize("machine", sorted(NUMBERS))
def test_the_syscall_numbers_are_the_kernel_headers(machine: str) -> None:
    """Each table against the kernel's own header (x86-64's unistd_64.h; asm-generic's unistd.h,
    which aarch64 and riscv64 use), where this machine has it. A call newer than the header must be
    one that every architecture numbers alike (424 onward)."""
    header = HEADERS[machine]
    if not os.path.exists(header):
        pytest.skip(f"no {header} here (the linux-libc-dev package)")
    text = open(header).read()
    found = re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", text)
    defined = {m.group(1): int(m.group(2)) for m in found}
    table = NUMBERS[machine]
    assert {name: table[name] for name in table if name in defined} == {
        name: defined[name] for name in table if name in defined}
    assert all(table[name] >= 424 for name in table if name not in defined), sorted(set(table) - set(defined))
    assert len([name for name in table if name in defined]) >= len(table) - 2


FAMILIES = """
import socket
for family in (socket.AF_NETLINK, socket.AF_VSOCK, socket.AF_ALG, socket.AF_UNIX, socket.AF_INET,
               socket.AF_INET6):
    try:
        socket.socket(family, socket.SOCK_DGRAM if family == socket.AF_NETLINK else socket.SOCK_SEQPACKET
                      if family == socket.AF_ALG else socket.SOCK_STREAM).close()
        print("ok")
    except OSError as exc:
        print(exc.errno)
"""


@pytest.mark.skipif(build_filter() is None, reason=NO_FILTER)
def test_socket_families_the_network_namespace_does_not_isolate_are_refused(sb: Sandbox) -> None:
    """AF_VSOCK has no network namespace: from inside a Firecracker guest's sandbox it bound
    ports of the guest's own vsock space (and could reach the hypervisor's). Only AF_UNIX,
    AF_INET and AF_INET6 sockets may be created; netlink is the control (it works unsandboxed)."""
    control = unsandboxed(FAMILIES)
    assert control.stdout.split()[0] == "ok", control.stdout  # a plain process opens netlink
    r = sb.run(FAMILIES)
    assert r.ok and r.stdout.split() == [str(errno.EPERM)] * 3 + ["ok"] * 3, r


def test_empty_directories_cannot_fill_the_runs_memory(sb: Sandbox) -> None:
    """Empty directories take no tmpfs blocks, only kernel memory: unbounded, they ran the run
    into its memory limit, the OOM killer chose the launcher, and the run's cgroup leaked. The
    tmpfs now has an inode limit; the code gets ENOSPC and the launcher keeps its verdict."""
    r = sb.run("import os\ni = 0\ntry:\n    while True:\n        os.mkdir(f'/work/d{i}')\n        i += 1\n"
               "except OSError as exc:\n    print(exc.errno, i < 20000)\n")
    assert r.ok and r.stdout == f"{errno.ENOSPC} True\n" and "seccomp" in r.protections, r


@pytest.fixture
def degraded(monkeypatch) -> Sandbox:
    """The sandbox of a machine that allows no namespaces (the code runs as a uid of the host's)."""
    keep_uid = os.geteuid() == 0 and not sandbox_module._others_can_run_python()
    forced = sandbox_module._Probe("plain-keep-uid" if keep_uid else "plain", "forced by the test")
    monkeypatch.setattr(sandbox_module, "_PROBE", forced)
    return Sandbox(SandboxLimits(wall_s=3.0, cpu_s=1), require_isolation=False)


@pytest.fixture
def as_host_uid(monkeypatch) -> Sandbox:
    """A degraded sandbox whose code runs as the host's uid (root without capabilities, as root):
    what it is refused, the uid's own permissions would allow, so the refusal is the sandbox's."""
    mode = "plain-keep-uid" if os.geteuid() == 0 else "plain"
    monkeypatch.setattr(sandbox_module, "_PROBE", sandbox_module._Probe(mode, "forced by the test"))
    return Sandbox(SandboxLimits(wall_s=3.0, cpu_s=1), require_isolation=False)


def test_the_host_reads_output_by_descriptor_not_by_name_in_a_degraded_mode(degraded: Sandbox,
                                                                           monkeypatch) -> None:
    """The run directory is the code's working directory's parent there: `out` replaced by a FIFO
    hung the host for good, `err` replaced by a symlink had the host read, with its privileges,
    a file the code could not (the error line was that file's last line). (Without Landlock,
    which refuses both changes before that.)"""
    monkeypatch.setattr(host, "LANDLOCK", False)
    # (as root with a per-run uid the run directory is not the code's to change: "refused")
    fifo = degraded.run("import os\ntry:\n    os.unlink('../out')\n    os.mkfifo('../out')\n    print('x')\n"
                        "except PermissionError:\n    print('refused')\n")
    assert fifo.ok and fifo.stdout in ("x\n", "refused\n") and fifo.elapsed_s < 3.0, fifo
    with tempfile.NamedTemporaryFile("w", suffix=".secret") as f:
        f.write("TOP-SECRET\n")
        f.flush()
        os.chmod(f.name, 0)
        code = (f"import os, sys\ntry:\n    open({f.name!r}).read()\n    print('read')\n"
                f"except OSError:\n    print('denied')\n"
                f"try:\n    os.unlink('../err')\n    os.symlink({f.name!r}, '../err')\n"
                "except PermissionError:\n    pass\n"
                "sys.stderr.write('own words\\n')\nsys.exit(1)\n")
        r = degraded.run(code)
    if os.geteuid() == 0 and r.stdout == "read\n":
        pytest.skip("the code's uid reads mode-0 files here (capabilities kept)")
    assert r.stdout == "denied\n" and r.error == "own words", r


FORGE = """
import os, sys
forged = b"status 0\\ncpu 0.0\\ntimeout 0\\nout_bytes 0\\nerr_bytes 0\\noutput_exceeded 0\\n"
opened = 0
try:  # (Landlock, where the kernel has it, refuses /proc: nothing is opened then)
    pids = {os.getppid(), int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])}
except OSError:
    pids = set()
for pid in pids:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            w = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
            os.write(w, forged)
            opened += 1
        except OSError:
            pass
print(opened, flush=True)
while True:
    pass
"""


def _reopen(path: str) -> subprocess.CompletedProcess:
    """A plain child of this process opens `path` (one of our /proc/PID/fd entries) for writing."""
    code = f"import os\nw = os.open({path!r}, os.O_WRONLY)\nos.write(w, b'forged')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_the_status_channel_cannot_be_reopened_through_proc_in_a_degraded_mode(degraded: Sandbox,
                                                                                  monkeypatch) -> None:
    """A process of the launcher's uid (the plain modes, non-root) opened /proc/PID/fd/N of the
    launcher's end of the status pipe for writing, wrote "status 0" and had a busy loop judged
    ok. The channel is a socket pair now, which /proc cannot reopen (the control: a pipe of
    this process's can be, by a plain child), and the launcher is not dumpable. (As root the
    code's missing capabilities already kept it out; the forging run checks the verdict. Without
    Landlock, which refuses /proc before that.)"""
    monkeypatch.setattr(host, "LANDLOCK", False)
    r_end, w_end = os.pipe()
    left, right = socket.socketpair()
    try:
        assert _reopen(f"/proc/{os.getpid()}/fd/{r_end}").returncode == 0 and os.read(r_end, 6) == b"forged"
        refused = _reopen(f"/proc/{os.getpid()}/fd/{left.fileno()}")
        assert refused.returncode != 0 and "No such device or address" in refused.stderr, refused
    finally:
        os.close(r_end)
        os.close(w_end)
        left.close()
        right.close()
    popen, kinds = subprocess.Popen, []

    def record(argv, **kwargs):  # what the launcher's STATUS_FD is
        kinds.append(stat.S_ISSOCK(os.fstat(int(argv[15])).st_mode))
        return popen(argv, **kwargs)

    monkeypatch.setattr(host.subprocess, "Popen", record)
    r = degraded.run(FORGE)
    assert kinds == [True] and not r.ok and r.limit in ("cpu", "time"), (kinds, r)


@pytest.mark.parametrize("cgroups", [pytest.param(True, marks=pytest.mark.skipif(
    cgroup_support()[0] is None, reason="no writable cgroups here")), False])
def test_processes_left_behind_die_with_the_run_in_a_degraded_mode(degraded: Sandbox, monkeypatch,
                                                                   cgroups: bool) -> None:
    """Without a pid namespace, a double-forked, setsid'd process outlived the run (running as
    the host's uid in plain-keep-uid mode); the run's cgroup is emptied when the run ends, and
    without a cgroup (a non-root run, 2026-12-07: it outlived the run) the launcher, the run's
    subreaper, kills every orphan of the run."""
    if not cgroups:
        monkeypatch.setattr(host, "_CGROUP", (None, "no cgroup: forced by the test"))
    code = ("import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.write(w, str(os.getpid()).encode())\n        os.close(w)\n        time.sleep(60)\n"
            "    os._exit(0)\nos.close(w)\nprint(os.read(r, 32).decode())\n")
    r = degraded.run(code)
    assert r.ok, r
    pid, deadline = int(r.stdout), time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail(f"process {pid} of the run outlived it")


def test_a_cgroup_that_cannot_be_made_is_a_setup_failure_not_an_exception(monkeypatch, tmp_path) -> None:
    """A parent cgroup left by a root run is not writable by a later non-root one: the probe
    took it as usable and every `Sandbox.run` raised PermissionError. The probe now makes and
    removes a child group, and a run whose cgroup fails is reported as a setup failure."""
    monkeypatch.setattr(host, "_CGROUP", ("v2", ""))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/sys/fs/cgroup/parity-sandbox/run-1")

    monkeypatch.setattr(cgroup, "RunCgroup", refuse)
    r = Sandbox(LIMITS).run("print(1)")
    assert not r.ok and r.infra and r.error.startswith("sandbox setup failed: the run's cgroup"), r
    for c in cgroup.V1_CONTROLLERS:  # a v1 tree whose parent groups exist
        (tmp_path / c / cgroup.PARENT).mkdir(parents=True)
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)
    assert cgroup._v1_ready()  # the control: children can be made
    mkdir = cgroup.Path.mkdir

    def no_children(self, *args, **kwargs):
        if self.parent.name == cgroup.PARENT:
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(cgroup.Path, "mkdir", no_children)
    assert not cgroup._v1_ready()


def test_a_degraded_mode_that_cannot_run_code_is_not_chosen(monkeypatch) -> None:
    """As root without namespaces, the per-run uid could not reach its script through the
    root-only run directory: every tool call failed "Permission denied" (judged the policy's
    error, a host path in it), and the probe, which never looked at its run, chose that mode.
    The run directory is now passable by the run's uid, and the probe takes the first degraded
    mode that runs its code."""
    runs: list[str] = []

    def execute(mode, code, limits):
        runs.append(mode)
        if mode == "plain-keep-uid":
            return host.ToolResult(True, "ok\n", None, 0.0, protections=("seccomp",))
        return host.ToolResult(False, "", "can't open file 'main.py': [Errno 13] Permission denied", 0.0)

    monkeypatch.setattr(sandbox_module, "execute", execute)
    monkeypatch.setattr(sandbox_module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox_module, "others_can_run_python", lambda: True)
    probe = sandbox_module._run_probe()
    assert runs == ["root", "user", "plain", "plain-keep-uid"] and probe.mode == "plain-keep-uid"
    assert "plain mode: can't open file 'main.py'" in probe.reason and probe.protections == ("seccomp",)
    runs.clear()  # any other failure keeps the per-run uid (root's own is never taken for it)
    slow = host.ToolResult(False, "", "sandbox: time limit exceeded (5.0 s wall)", 5.0, limit="time")
    monkeypatch.setattr(sandbox_module, "execute", lambda mode, code, limits: runs.append(mode) or slow)
    probe = sandbox_module._run_probe()
    assert runs == ["root", "user", "plain"] and probe.mode == "plain" and "time limit" in probe.reason


def test_what_a_host_killed_mid_call_left_is_removed_by_the_next_one(monkeypatch, tmp_path) -> None:
    """A rollout worker SIGKILLed during a tool call never closes the call's cgroup(s) or its
    temporary directory (four of each were left in a review). The next process to probe the
    sandbox removes those whose host pid is gone and that are a minute old, and an empty group
    only; the controls stay: a live host's, a young one, another pid namespace's directory (its
    pid means nothing here), a group with a process in it."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # (a pid nobody has now)
    old = time.time() - 2 * cgroup.STALE_AFTER_S
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ns = host._pid_namespace()
    made = {name: tmp_path / f"parity-sandbox-{pid}-{namespace}-x{name}" for name, pid, namespace in
            (("stale", dead.pid, ns), ("live", os.getpid(), ns), ("young", dead.pid, ns),
             ("other namespace", dead.pid, ns + 1))}
    for name, path in made.items():
        (path / "work").mkdir(parents=True)
        if name != "young":
            os.utime(path, (old, old))
    version = cgroup_support()[0]
    groups = {}
    if version is not None:
        parent = cgroup.ROOT / cgroup.PARENT if version == "v2" else cgroup.ROOT / "memory" / cgroup.PARENT
        groups = {name: parent / f"run-{pid}-test{name}" for name, pid in
                  (("stale", dead.pid), ("live", os.getpid()), ("busy", dead.pid))}
        for path in groups.values():
            path.mkdir()
            os.utime(path, (old, old))
        sleeper = subprocess.Popen(["sleep", "30"])
        (groups["busy"] / "cgroup.procs").write_text(str(sleeper.pid))
    try:
        monkeypatch.setattr(host, "_CGROUP", None)  # (a new process's first probe)
        assert cgroup_support()[0] == version
        assert [n for n, p in made.items() if p.exists()] == ["live", "young", "other namespace"]
        if groups:
            assert [n for n, p in groups.items() if p.exists()] == ["live", "busy"]
    finally:
        if groups:
            sleeper.kill()
            sleeper.wait()
            for path in groups.values():
                for _ in range(50):
                    try:
                        path.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)


ATTEMPT = """
def attempt(what, act):  # one line per act: done, or the errno it met
    try:
        act()
        print(what, "done")
    except OSError as exc:
        print(what, exc.errno)
"""

REACH = ATTEMPT + """
import os, socket
host_file, host_dir, shm = {args}
attempt("read", lambda: open(host_file).read())
attempt("write", lambda: open(os.path.join(host_dir, "planted"), "w").write("x"))
attempt("shm", lambda: open(shm, "w").write("x" * 4096))
attempt("list", lambda: os.listdir("/"))
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close())
attempt("tcp", lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close())
attempt("own", lambda: (os.makedirs("a/b"), open("a/b/f", "w").write("x"), os.remove("a/b/f")))
"""


@pytest.mark.skipif(landlock.abi() < 1 or build_filter() is None, reason="no Landlock or seccomp here")
def test_a_degraded_run_is_held_to_its_own_directory_and_has_no_network(as_host_uid: Sandbox, tmp_path,
                                                                         monkeypatch) -> None:
    """Without namespaces the code read and wrote what its uid could (root's files, as root), wrote
    memory-backed files in /dev/shm that no process owns (out of the memory watch's sight, outliving
    the run) and reached the network. Landlock now holds it to reading the Python runtime and
    writing its own directory, and the seccomp filter refuses network sockets there. The controls:
    a plain child process does all of it, the same run without Landlock all but the sockets."""
    host_dir = tmp_path / "open"
    host_dir.mkdir(mode=0o777)
    os.chmod(host_dir, 0o777)
    secret = host_dir / "readable"
    secret.write_text("host data\n")
    os.chmod(secret, 0o644)
    shm = f"/dev/shm/parity-test-{os.getpid()}"
    code = REACH.format(args=f"{str(secret)!r}, {str(host_dir)!r}, {shm!r}")
    denied, eperm = str(errno.EACCES), str(errno.EPERM)
    acts = ("read", "write", "shm", "list", "udp", "tcp", "own")
    try:
        (tmp_path / "control").mkdir()
        control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                 cwd=tmp_path / "control")
        assert control.stdout.split("\n")[:7] == [f"{w} done" for w in acts], control
        for leftover in (host_dir / "planted", shm):
            os.remove(leftover)
        monkeypatch.setattr(host, "LANDLOCK", False)
        r = as_host_uid.run(code)
        assert r.ok and r.stdout.split("\n")[:7] == [*(f"{w} done" for w in acts[:4]), f"udp {eperm}",
                                                      f"tcp {eperm}", "own done"], r
        for leftover in (host_dir / "planted", shm):
            os.remove(leftover)
        monkeypatch.setattr(host, "LANDLOCK", True)
        r = as_host_uid.run(code)
        assert r.ok and r.stdout.split("\n")[:7] == [f"read {denied}", f"write {denied}", f"shm {denied}",
                                                      f"list {denied}", f"udp {eperm}", f"tcp {eperm}",
                                                      "own done"], r
        assert "landlock-fs" in r.protections and not os.path.exists(shm)
        assert not (host_dir / "planted").exists()
    finally:
        if os.path.exists(shm):
            os.remove(shm)


def _a_file_under_each_mask() -> dict[str, str]:
    """One readable regular file (not a link) under each of the mount plan's masks that holds one."""
    found = {}
    for kind, mask, _ in host.mount_plan():
        if kind != "mask":
            continue
        for parent, dirs, files in os.walk(mask):
            dirs.sort()
            name = next((f for f in sorted(files) if os.path.isfile(os.path.join(parent, f))
                         and not os.path.islink(os.path.join(parent, f))), None)
            if name is not None:
                found[mask] = os.path.join(parent, name)
                break
    return found


HIDDEN = ATTEMPT + """
import json, decimal, os  # the standard library beside the packages stays readable
paths = {args}
for mask, path in paths.items():
    try:
        print("list", mask, "names" if os.listdir(mask) else "empty")
    except OSError as exc:
        print("list", mask, exc.errno)
    attempt("read " + path, lambda: open(path, "rb").read(1))
print("stdlib", bool(open(os.__file__).read(1)), decimal.Decimal("1.5") + 1, json.dumps([1]))
"""


def _hidden_outcome(r, paths: dict[str, str]) -> list[str]:
    assert r.ok, r
    lines = r.stdout.strip().split("\n")
    assert lines[-1] == "stdlib True 2.5 [1]" and len(lines) == 2 * len(paths) + 1, r
    return lines[:-1]


def test_the_isolated_root_hides_the_installed_packages(sb: Sandbox) -> None:
    """The isolated root masks the installed packages and /usr/local with empty tmpfs: they list as
    empty and their files are not there, while the standard library is. The control: the host reads
    each of those files."""
    paths = _a_file_under_each_mask()
    if not paths:
        pytest.skip("no mask of the mount plan holds a file here")
    for path in paths.values():
        assert open(path, "rb").read(1) is not None  # the control: readable on the host
    r = sb.run(HIDDEN.format(args=repr(paths)))
    assert _hidden_outcome(r, paths) == [x for mask, path in paths.items()
                                         for x in (f"list {mask} empty", f"read {path} {errno.ENOENT}")]


@pytest.mark.skipif(landlock.abi() < 1, reason="no Landlock here")
def test_a_degraded_run_cannot_read_the_installed_packages(as_host_uid: Sandbox, monkeypatch) -> None:
    """The plain modes allowed all of /usr and the interpreter's prefix, the installed packages and
    /usr/local among them, which the isolated root hides: Landlock allows a path with all below it.
    Now a directory with a mask below it is allowed entry by entry (`landlock.carve`): the files
    below a mask are refused (their names stay listable: Landlock allows listing a whole hierarchy,
    and the interpreter lists the directories it imports from), the standard library still reads and
    imports. The control is the same run without Landlock, which reads them all."""
    paths = _a_file_under_each_mask()
    if not paths:
        pytest.skip("no mask of the mount plan holds a file here")
    code = HIDDEN.format(args=repr(paths))
    monkeypatch.setattr(host, "LANDLOCK", False)
    r = as_host_uid.run(code)
    assert _hidden_outcome(r, paths) == [x for mask, path in paths.items()
                                         for x in (f"list {mask} names", f"read {path} done")]
    monkeypatch.setattr(host, "LANDLOCK", True)
    r = as_host_uid.run(code)
    denied = errno.EACCES
    assert _hidden_outcome(r, paths) == [x for mask, path in paths.items()
                                         for x in (f"list {mask} names", f"read {path} {denied}")]
    assert "landlock-fs" in r.protections


def test_carve_leaves_out_the_masks_and_only_them(tmp_path) -> None:
    """`carve` replaces a directory with a mask below it by its entries, down to the mask, leaves
    out links (Landlock judges what a link reaches) and keeps every other path whole; the directories
    it replaced are allowed to be listed. Paths are compared as real paths."""
    for d in ("top/a/hidden/deep", "top/a/kept", "top/b", "other"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "top/a/file").write_text("x")
    (tmp_path / "top/link").symlink_to(tmp_path / "top/a/hidden")
    t = os.path.realpath(tmp_path)
    (tmp_path / "top/a/hidden_link").symlink_to("hidden")
    got = landlock.carve([f"{t}/top", f"{t}/other"], [f"{t}/top/a/hidden"])
    assert got == ([f"{t}/top/a/file", f"{t}/top/a/kept", f"{t}/top/b", f"{t}/other"],
                   [f"{t}/top", f"{t}/top/a"])
    # a mask (or a directory) written through a link, with `.` or `//`: the same real path (the red
    # team's case: a string no directory matched, and its parent was allowed whole)
    for mask in (f"{t}//top/a/hidden", f"{t}/top/./a/hidden", f"{t}/top/a/hidden_link", f"{t}/top/a/hidden/"):
        assert landlock.carve([f"{t}/top/", f"{t}/other"], [mask]) == got, mask
    assert landlock.carve([f"{t}/top"], [f"{t}/top"]) == ([], [])
    assert landlock.carve([f"{t}/top"], []) == ([f"{t}/top"], [])


@pytest.mark.skipif(landlock.abi() < 6, reason="Landlock's signal scope needs ABI 6 (Linux 6.12)")
def test_a_degraded_run_cannot_signal_the_hosts_processes(as_host_uid: Sandbox, monkeypatch) -> None:
    """As the host's uid (or root) the code could signal the host's processes: this one, its
    training run. Landlock's scope (ABI 6) keeps signals within the run; the control is the same
    run without Landlock, and the run's own processes still signal each other."""
    code = (f"import os, signal\ntry:\n    os.kill({os.getpid()}, 0)\n    print('reached')\n"
            "except OSError as exc:\n    print(exc.errno)\n"
            "pid = os.fork()\nif pid == 0:\n    signal.pause()\nos.kill(pid, signal.SIGKILL)\n"
            "print(os.waitpid(pid, 0)[1] & 0x7f)\n")
    monkeypatch.setattr(host, "LANDLOCK", False)
    r = as_host_uid.run(code)
    assert r.ok and r.stdout.split() == ["reached", str(signal.SIGKILL.value)], r
    monkeypatch.setattr(host, "LANDLOCK", True)
    r = as_host_uid.run(code)
    assert r.ok and r.stdout.split() == [str(errno.EPERM), str(signal.SIGKILL.value)], r
    assert "landlock-scope" in r.protections


HOST_REACH = ATTEMPT + """
import ctypes, os, resource
libc = ctypes.CDLL(None, use_errno=True)
def check(rc):
    if rc < 0:
        raise OSError(ctypes.get_errno(), "")
    return rc
def queue():
    check(libc.mq_open(b"/parity-test-{pid}", os.O_CREAT | os.O_RDWR, 0o600, None))
    check(libc.mq_unlink(b"/parity-test-{pid}"))
def reserve():
    fd = os.open("reserved", os.O_RDWR | os.O_CREAT)
    check(libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(1 << 20)))  # FALLOC_FL_KEEP_SIZE
def flags():
    import fcntl
    fd = os.open({path!r}, os.O_RDONLY)
    fcntl.ioctl(fd, 0x40086602, (0x40).to_bytes(8, "little"))  # FS_IOC_SETFLAGS: nodump
attempt("chmod", lambda: os.chmod({path!r}, 0o4755))
attempt("xattr", lambda: os.setxattr({path!r}, "user.stash", b"answer"))
attempt("flags", flags)
attempt("utime", lambda: os.utime({path!r}, (0, 0)))
attempt("prlimit", lambda: resource.prlimit({pid}, resource.RLIMIT_NOFILE))
attempt("mq", queue)
attempt("fallocate", reserve)
attempt("unix", lambda: __import__("socket").socket(1).close())
"""


@pytest.mark.skipif(build_filter() is None, reason=NO_FILTER)
def test_a_degraded_run_cannot_change_the_hosts_files_or_processes(as_host_uid: Sandbox, tmp_path,
                                                                    monkeypatch) -> None:
    """As a uid of the host's the code changed what Landlock does not cover (red team, 2026-12-07):
    it made a root-owned binary setuid, reset the host's open-file limit to 12 (its next tool call
    failed), left a POSIX message queue whose name the next run read, reserved 2 GiB of disk past
    the file-size limit, and could reach any UNIX socket by path. The seccomp filter of the plain
    modes refuses all of it (checked with Landlock off, which refuses opening the file for its
    flags first); a plain child process, the control, does all of it."""
    monkeypatch.setattr(host, "LANDLOCK", False)
    target = tmp_path / "host-file"
    target.write_text("x")
    code = HOST_REACH.format(path=str(target), pid=os.getpid())
    (tmp_path / "control").mkdir()
    control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path / "control")
    acts = ("chmod", "xattr", "flags", "utime", "prlimit", "mq", "fallocate", "unix")
    assert control.stdout.split("\n")[:8] == [f"{a} done" for a in acts], control
    target.unlink()
    target.write_text("x")
    os.chmod(target, 0o644)
    stamp = target.stat().st_mtime
    r = as_host_uid.run(code)
    assert r.ok and r.stdout.split("\n")[:8] == [f"{a} {errno.EPERM}" for a in acts], r
    assert not os.listxattr(target)
    assert target.stat().st_mode & 0o7777 == 0o644 and target.stat().st_mtime == stamp


OWN_FILES = ATTEMPT + """
import os, shutil
open("a", "w").write("x")
attempt("chmod", lambda: os.chmod("a", 0o640))
attempt("utime", lambda: os.utime("a", (1, 2)))
attempt("copy2", lambda: shutil.copy2("a", "b"))
attempt("copy", lambda: shutil.copy("a", "c"))
print("modes", oct(os.stat("a").st_mode & 0o7777), *[oct(os.stat(f).st_mode & 0o7777) for f in "bc" if
      os.path.exists(f)], os.stat("b").st_mtime if os.path.exists("b") else None)
attempt("setuid", lambda: os.chmod("a", 0o4755))
attempt("setgid", lambda: os.chmod("a", 0o2755))
attempt("host", lambda: os.chmod({host!r}, 0o600))
os.umask(0)
attempt("made-setuid", lambda: os.close(os.open("s", os.O_CREAT | os.O_WRONLY, 0o6755)))
attempt("made-setgid", lambda: os.mknod("m", 0o102755))
"""


@pytest.mark.skipif(build_filter() is None, reason=NO_FILTER)
def test_a_per_run_uids_filter_lets_it_copy_files_but_not_make_them_setuid(as_host_uid: Sandbox, tmp_path,
                                                                           monkeypatch) -> None:
    """`shutil.copy` copies the mode and `copy2` the times too: both failed (EPERM) in every plain mode.
    Under a per-run uid, which owns none of the host's files, the filter allows a file's mode but
    setuid and setgid, and its times. Checked on this kernel with that filter loaded in the mode run
    as the host's uid (the plain mode's per-run uid needs an interpreter every uid can reach), which
    then also changes a host file's mode: the reason the host's uid keeps the stricter filter, the
    control, under which the copies fail. A plain child process makes the file setuid, and makes
    setuid and setgid files (red team: `os.open` with mode 0o6755 got round the filter); the
    plain modes refuse those bits in a new file's mode whatever the uid."""
    target = tmp_path / "host-file"
    target.write_text("x")
    code = OWN_FILES.format(host=str(target))
    (tmp_path / "control").mkdir()
    control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path / "control")
    made = ["made-setuid", "made-setgid"]
    assert control.stdout.split("\n")[-6:-1] == ["setuid done", "setgid done", "host done",
                                                 *[f"{m} done" for m in made]], control
    strict = as_host_uid.run(code)
    said = [line.split()[-1] for line in strict.stdout.split("\n")[:4]]
    assert strict.ok and said == [str(errno.EPERM)] * 4, strict
    assert strict.stdout.split("\n")[-3:-1] == [f"{m} {errno.EPERM}" for m in made], strict
    monkeypatch.setattr(host, "per_run_uid", lambda mode: True)
    os.chmod(target, 0o644)
    r = as_host_uid.run(code)
    assert r.ok and r.stdout.split("\n")[:-1] == [
        "chmod done", "utime done", "copy2 done", "copy done", "modes 0o640 0o640 0o640 2.0",
        f"setuid {errno.EPERM}", f"setgid {errno.EPERM}", "host done", f"made-setuid {errno.EPERM}",
        f"made-setgid {errno.EPERM}"], r
    assert target.stat().st_mode & 0o7777 == 0o600  # (the host's uid owns it: why this filter is not its)


@pytest.mark.skipif(os.geteuid() or not sandbox_module._others_can_run_python() or build_filter() is None,
                    reason="a per-run uid needs root and an interpreter every uid can reach")
def test_a_per_run_uid_copies_its_own_files_and_cannot_change_the_hosts(monkeypatch, tmp_path) -> None:
    """The plain mode as root, its code under a per-run uid: the copies work, setuid is refused by
    the filter and a host file's mode by the kernel (its uid owns none of the host's files)."""
    monkeypatch.setattr(sandbox_module, "_PROBE", sandbox_module._Probe("plain", "forced by the test"))
    box = Sandbox(SandboxLimits(wall_s=3.0, cpu_s=1), require_isolation=False)
    shared = tempfile.mkdtemp()
    try:
        os.chmod(shared, 0o755)
        target = os.path.join(shared, "host-file")
        with open(target, "w") as f:
            f.write("x")
        os.chmod(target, 0o666)
        r = box.run(OWN_FILES.format(host=target))
        assert r.ok and r.stdout.split("\n")[:-1] == [
            "chmod done", "utime done", "copy2 done", "copy done", "modes 0o640 0o640 0o640 2.0",
            f"setuid {errno.EPERM}", f"setgid {errno.EPERM}", f"host {errno.EPERM}",
            f"made-setuid {errno.EPERM}", f"made-setgid {errno.EPERM}"], r
        assert os.stat(target).st_mode & 0o7777 == 0o666
    finally:
        shutil.rmtree(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="RLIMIT_NPROC holds every uid but root's")
def test_a_degraded_run_without_a_cgroup_is_held_to_its_process_count(as_host_uid: Sandbox,
                                                                       monkeypatch) -> None:
    """The kernel exempts root from RLIMIT_NPROC: as root without a cgroup (plain-keep-uid) 40
    forks went through a limit of 16, sharing their pages, so the memory watch barely saw them.
    The watch counts the run's processes too; the control is the same code under the limit."""
    monkeypatch.setattr(host, "_CGROUP", (None, "no cgroup: forced by the test"))
    code = ("import os, time\nfor _ in range({n}):\n    if os.fork() == 0:\n        time.sleep(2)\n"
            "        os._exit(0)\nprint('forked', flush=True)\ntime.sleep(1)\n")
    r = as_host_uid.run(code.format(n=40))
    assert not r.ok and r.limit == "processes", r
    nproc = as_host_uid.limits.nproc
    assert r.error == f"sandbox: process limit exceeded ({nproc} processes for the whole run)"
    r = as_host_uid.run(code.format(n=4))
    assert r.ok and r.stdout == "forked\n", r
    orphans = ("import os, time\nfor _ in range(30):\n    if os.fork() == 0:\n        if os.fork() == 0:\n"
               "            os._exit(0)\n        os._exit(0)\n    os.wait()\n"
               "time.sleep(0.3)\nprint('done')\n")
    r = as_host_uid.run(orphans)  # (60 processes one after another, at most 3 at once: their zombies
    assert r.ok and r.stdout == "done\n", r  # wait for the launcher, which adopted them, but run no more)


@pytest.mark.skipif(landlock.abi() < 4, reason="Landlock's TCP rules need ABI 4 (Linux 6.7)")
def test_without_a_seccomp_filter_landlock_still_refuses_tcp(as_host_uid: Sandbox, monkeypatch) -> None:
    """Where the seccomp filter is not implemented (before 2026-12-07, every machine but x86-64) a
    degraded run's network was open: Landlock (ABI 4) refuses TCP bind and connect there too. The
    control is the same run, filter still off, without Landlock: it reaches this process's
    listener."""
    monkeypatch.setattr(host.seccomp, "build_filter", lambda **kwargs: None)  # (as on a machine without one)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        code = ATTEMPT + (f"import socket\nattempt('connect', lambda: socket.create_connection("
                          f"('127.0.0.1', {listener.getsockname()[1]}), timeout=2).close())\n")
        monkeypatch.setattr(host, "LANDLOCK", False)
        r = as_host_uid.run(code)
        assert r.ok and r.stdout == "connect done\n" and "seccomp" not in r.protections, r
        monkeypatch.setattr(host, "LANDLOCK", True)
        r = as_host_uid.run(code)
        assert r.ok and r.stdout == f"connect {errno.EACCES}\n" and "landlock-net" in r.protections, r
