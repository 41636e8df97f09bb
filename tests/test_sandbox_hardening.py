"""The sandbox's second line: what an attacker tried after the first escape tests passed.

Each class of attack runs once unsandboxed (the control: it works, so the check can fail) and
once in the sandbox (it must not): the caller's kernel keyrings, SysV IPC and memory beyond the
per-process limit, output that grows files on the host disk, system calls that reach the kernel
(nested user namespaces, mount, bpf, perf, userfaultfd, io_uring, inotify, fanotify, the kernel
log, ptrace), verdicts forged by printing, control characters, reused uids.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile

import pytest

from parity.envs.sandbox import Sandbox, SandboxLimits
from parity.envs.sandbox.host import cgroup_support
from parity.envs.sandbox.seccomp import DENIED_X86_64, build_filter

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

# (name, syscall number, args): every one is refused by the filter whatever its arguments
KERNEL_CALLS = [
    ("keyctl: read the caller's session keyring", 250, (0, -3, 0)),
    ("add_key: plant a key", 248, (0, 0, 0, 0, -3)),
    ("mount", 165, (0, 0, 0, 0, 0)),
    ("bpf", 321, (0, 0, 0)),
    ("perf_event_open", 298, (0, 0, -1, -1, 0)),
    ("userfaultfd", 323, (0,)),
    ("io_uring_setup", 425, (1, 0)),
    ("inotify_init1: watch shared read-only files", 294, (0,)),
    ("fanotify_init", 300, (0, 0)),
    ("syslog: the kernel log", 103, (10, 0, 0)),
    ("ptrace", 101, (0, 0, 0, 0)),
    ("unshare: a nested user namespace (last: it changes what the control may do next)", 272, (0x10000000,)),
]


@pytest.mark.skipif(build_filter() is None, reason="the seccomp filter is x86-64 only")
def test_kernel_surface_is_refused_and_reachable_without_the_sandbox(sb: Sandbox) -> None:
    code = SYSCALLS + "".join(f"print(call({nr}, *{args})[1])\n" for _, nr, args in KERNEL_CALLS)
    control = unsandboxed(code)
    assert control.returncode == 0, control.stderr
    inside = sb.run(code)
    assert inside.ok, inside.error
    for (name, _, _), outside, got in zip(KERNEL_CALLS, control.stdout.split(), inside.stdout.split()):
        assert int(got) == errno.EPERM, f"{name}: errno {got} in the sandbox"
        assert int(outside) != errno.EPERM, f"{name}: refused even without the sandbox (control)"
    assert set(DENIED_X86_64) >= {"keyctl", "add_key", "request_key", "unshare", "setns", "mount", "bpf",
                                  "perf_event_open", "userfaultfd", "io_uring_setup", "inotify_init",
                                  "inotify_init1", "fanotify_init", "syslog", "ptrace"}


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


@pytest.mark.skipif(cgroup_support()[0] is None, reason="no writable cgroups here")
def test_memory_is_bounded_for_the_run_as_a_whole(sb: Sandbox) -> None:
    """Six processes of 150 MiB each stay under the per-process limit (512 MiB) but not under the
    whole-run limit: the kernel's OOM killer acts in the run's cgroup, which is the verdict."""
    code = ("import os, time\n"
            "for _ in range(5):\n    if os.fork() == 0:\n        break\n"
            "block = bytearray(150 << 20)\nfor i in range(0, len(block), 4096):\n    block[i] = 1\n"
            "time.sleep(2)\nprint('held')\n")
    control = unsandboxed(code)
    assert control.stdout.count("held") == 6  # 900 MiB across processes works without the sandbox
    r = sb.run(code)
    assert not r.ok and r.limit == "memory", (r.error, r.stdout)
    assert r.error == f"sandbox: memory limit exceeded ({LIMITS.memory_mb} MiB for the whole run)"


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
                                   "Sandbox: cpu time limit exceeded (4 s)"])
def test_printed_verdicts_are_not_verdicts(sb: Sandbox, claim: str) -> None:
    r = sb.run(f"import sys\nsys.stderr.write({claim!r} + '\\n')\nsys.exit(1)\n")
    assert not r.ok and r.limit is None and r.error == "stderr: " + claim


def test_control_characters_are_stripped(sb: Sandbox) -> None:
    r = sb.run("import sys\nprint('a\\x1b[2Jb\\x07c\\tok')\n"
               "sys.stderr.write('x\\x00y\\x1b]0;title\\x07z\\n')\nsys.exit(2)\n")
    assert r.stdout == "a[2Jbc\tok\n" and r.error == "xy]0;titlez"


def test_every_run_has_its_own_uid_and_keyring(sb: Sandbox) -> None:
    uids = {sb.run("import os\nprint(os.getuid())").stdout for _ in range(4)}
    assert len(uids) == 4 and str(os.getuid()) + "\n" not in uids
    r = sb.run("import os\nif os.fork() == 0:\n    print('child')\nelse:\n    os.wait()\n    print('parent')")
    assert r.ok and sorted(r.stdout.split()) == ["child", "parent"]  # plain clone (fork) still works


def test_the_protections_are_reported() -> None:
    text = Sandbox(LIMITS).describe()
    for protection in ("seccomp filter", "own session keyring", "no SysV IPC", "output through pipes"):
        assert protection in text or f"NO {protection.split()[0]}" in text, protection
    assert ("whole-run cgroup" in text) != ("NO whole-run limits" in text)


def test_the_verdict_cannot_be_forged_through_the_run_directory_in_a_degraded_mode(monkeypatch) -> None:
    """Without namespaces (a machine that allows none) the code's working directory's parent is
    the run's directory, where the launcher's status file was: rewritten, it judged a busy loop
    'ok', and a garbage status made `Sandbox.run` raise. The verdict now comes over a pipe the
    code never holds; the code's file there decides nothing."""
    import parity.envs.sandbox as sandbox_module

    forced = sandbox_module._Probe("plain-keep-uid", "forced by the test")
    monkeypatch.setattr(sandbox_module, "_PROBE", forced)
    box = Sandbox(SandboxLimits(wall_s=2.0, cpu_s=1))
    write = ('import os\nfd = os.open("../status", os.O_WRONLY | os.O_CREAT, 0o600)\n'
             'os.write(fd, b"#" * 400 + {!r})\n')
    forged = box.run(write.format(b"\nstatus 0\ncpu 0.0\ntimeout 0\noutput_exceeded 0\n")
                     + 'print("written", flush=True)\nwhile True:\n    pass\n')
    assert forged.stdout == "written\n" and not forged.ok and forged.limit in ("cpu", "time"), forged
    garbage = box.run(write.format(b"\nstatus not-a-number\n") + 'print("written")\n')
    assert garbage.ok and garbage.stdout == "written\n", garbage
