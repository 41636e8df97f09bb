#!/usr/bin/env python3
"""The sandbox's aarch64 and riscv64 seccomp filters, checked on a real kernel of that architecture.

The unit tests run every architecture's filter on a model of the kernel's BPF (`seccomp.decide`)
and, on x86-64, the real filter in the real sandbox. This script closes the gap for aarch64 and
riscv64 on a machine that is neither: it boots that architecture's Linux kernel under
`qemu-system-<arch>` (TCG, no hardware needed) with an initramfs whose init (`seccomp_vm_runner.c`,
built static with the cross compiler) makes each call of a list, every refused one included, in a
child process of its own: once without a filter (the control), once under the isolated modes'
filter, once under the plain modes', once under the plain mode's for a per-run uid (`own`) and
once under the x86-64 filter (a foreign architecture's calls: every one must be killed). The
calls' numbers come from the cross toolchain's headers, not
from `syscalls.py`, and the verdict each should get from the documented policy (`seccomp.DENIED`,
... by name); the kernel and the model (`seccomp.decide`) must both give it. One line per filter;
exit 0 only when every call agrees.

    apt-get install qemu-system-arm gcc-aarch64-linux-gnu libc6-dev-arm64-cross
    dpkg --add-architecture arm64 && apt-get update && apt-get download linux-image-6.1.0-57-arm64:arm64
    python scripts/seccomp_vm_check.py --kernel linux-image-6.1.0-57-arm64_*.deb [--json out.json]

    apt-get install qemu-system-misc opensbi gcc-riscv64-linux-gnu libc6-dev-riscv64-cross
    # a riscv64 linux-image .deb (Debian 13's pool/main/l/linux/), then
    python scripts/seccomp_vm_check.py --arch riscv64 --kernel linux-image-6.12.*-riscv64_*.deb

`--kernel` takes the kernel's Image (or vmlinuz) or a Debian linux-image .deb holding one.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parity.envs.sandbox import seccomp  # noqa: E402
from parity.envs.sandbox.syscalls import AUDIT_ARCH  # noqa: E402

ARCHS = {
    "aarch64": {"gcc": "aarch64-linux-gnu-gcc", "console": "ttyAMA0",
                "qemu": ["qemu-system-aarch64", "-M", "virt", "-cpu", "max"]},
    "riscv64": {"gcc": "riscv64-linux-gnu-gcc", "console": "ttyS0",
                "qemu": ["qemu-system-riscv64", "-M", "virt", "-bios", "default"]},
}
"""Per architecture: the cross compiler, the machine qemu emulates and its serial console."""
SIGSYS = 31
HERE = os.path.dirname(os.path.abspath(__file__))


ALLOW, EPERM, ENOSYS, KILL = "allow", "EPERM", "ENOSYS", "killed"


def toolchain_numbers(machine: str) -> dict[str, int]:
    """The call numbers as the cross toolchain's own headers define them: independent of
    `syscalls.py`, so a wrong number there shows as a call the kernel did not refuse."""
    out = subprocess.run([ARCHS[machine]["gcc"], "-E", "-dM", "-include", "asm/unistd.h", "-x", "c",
                          os.devnull], capture_output=True, text=True, check=True).stdout
    defines = dict(line.split()[1:3] for line in out.splitlines() if line.startswith("#define __NR"))
    numbers = {name: defines.get(value, value) for name, value in defines.items()}  # (__NR3264_mmap)
    return {name.removeprefix("__NR_"): int(value) for name, value in numbers.items()
            if name.startswith("__NR_") and value.isdigit()}


def cases(machine: str, nr: dict[str, int]) -> list[tuple[str, tuple[int, ...], dict[str, str]]]:
    """(what, (nr, a0..a5), the verdict the documented policy wants under each filter): every call
    the policy names, each argument rule's allowed and refused forms, socket families, clone
    flags, calls past NEWEST_KNOWN and some calls every program makes. Arguments are chosen to
    fail harmlessly unfiltered (fd -1, NULL pointers)."""
    out = []

    def add(what: str, number: int, args: tuple[int, ...], isolated: str, plain: str,
            own: str | None = None) -> None:  # (own: the plain mode's per-run uid; plain's by default)
        call = (number, *args, *[0] * (6 - len(args)))
        out.append((what, call, {"isolated": isolated, "plain": plain, "own": own or plain, "foreign": KILL}))

    relaxed = (*seccomp.OWN_FILES_MODE_ARG, *seccomp.OWN_FILES_TIMES)
    for name in seccomp.DENIED + seccomp.PLAIN_DENIED:
        if name in nr or name in seccomp.NUMBERS[machine]:  # (fchmodat2: newer than the headers)
            number = nr.get(name, seccomp.NUMBERS[machine][name])
            add(name, number, (-1,), EPERM if name in seccomp.DENIED else ALLOW, EPERM,
                ALLOW if name in relaxed else None)
    for name, arg in seccomp.OWN_FILES_MODE_ARG.items():  # a mode with setuid: refused to the per-run uid
        if name in nr or name in seccomp.NUMBERS[machine]:
            args = [-1] + [0] * (arg - 1) + [0o4755]
            add(f"{name} setuid", nr.get(name, seccomp.NUMBERS[machine][name]), tuple(args), ALLOW, EPERM,
                EPERM)
    for name, arg in seccomp.CREATE_MODE_ARG.items():  # a file made setuid: refused in the plain modes
        if name in nr:
            args = [-100 if name.endswith("at") else 0] + [0] * (arg - 1)  # (a NULL path: EFAULT)
            add(f"{name} 0644", nr[name], (*args, 0o644), ALLOW, ALLOW)
            add(f"{name} setuid", nr[name], (*args, 0o4755), ALLOW, EPERM)
    add("openat2", nr["openat2"], (-100, 0, 0, 24), ALLOW, ENOSYS)
    for table, plain_only in ((seccomp.ARGS_ONLY, False), (seccomp.PLAIN_ARGS_ONLY, True)):
        for name, checks in table.items():
            base = [-1, 0, 0, 0, 0, 0]
            for arg, value in checks:
                base[arg] = value
            add(f"{name}{tuple(base[:2])}", nr[name], tuple(base), ALLOW, ALLOW)
            for arg, value in checks:
                other = list(base)
                other[arg] = value + 4242
                isolated = ALLOW if plain_only else EPERM
                add(f"{name}{tuple(other[:2])}", nr[name], tuple(other), isolated, EPERM)
    for request in seccomp.PLAIN_IOCTLS_REFUSED:
        add(f"ioctl {request:#x}", nr["ioctl"], (-1, request), ALLOW, EPERM)
    add("ioctl TCGETS", nr["ioctl"], (-1, 0x5401), ALLOW, ALLOW)
    for family in (1, 2, 10, 16, 38, 40):  # UNIX, INET, INET6; netlink, AF_ALG, AF_VSOCK
        isolated = ALLOW if family in seccomp.SOCKET_FAMILIES.values() else EPERM
        add(f"socket {family}", nr["socket"], (family, 2), isolated, EPERM)
        pair = ALLOW if family in seccomp.PLAIN_SOCKET_FAMILIES.values() else EPERM
        add(f"socketpair {family}", nr["socketpair"], (family, 1, 0, 0), isolated, pair)
    add("clone SIGCHLD", nr["clone"], (17,), ALLOW, ALLOW)
    for flag in ("NEWUSER", "NEWPID", "NEWNET", "NEWNS"):
        value = {"NEWUSER": 0x10000000, "NEWPID": 0x20000000, "NEWNET": 0x40000000, "NEWNS": 0x20000}[flag]
        add(f"clone {flag}", nr["clone"], (value | 17,), EPERM, EPERM)
    add("clone3", nr["clone3"], (0, 0), ENOSYS, ENOSYS)
    for number in (seccomp.NEWEST_KNOWN + 1, 458, 467):
        add(f"nr {number}", number, (-1,), ENOSYS, ENOSYS)
    for name, args in (("openat", (-100, 0, 0)), ("close", (-1,)), ("read", (-1, 0, 0)),
                       ("write", (-1, 0, 0)), ("uname", (0,)), ("getpid", ()), ("getuid", ()),
                       ("mmap", (0, 4096, 1, 0x22, -1, 0)), ("prlimit64", (0, 7, 0, 0)),
                       ("execve", (0, 0, 0))):
        add(name, nr[name], args, ALLOW, ALLOW)
    return out


def cpio(entries: list[tuple[str, int, bytes, tuple[int, int]]]) -> bytes:
    """A newc archive of (name, mode, data, (rdev major, minor)) entries, as the kernel unpacks."""
    blob = b""
    for ino, (name, mode, data, (major, minor)) in enumerate([*entries, ("TRAILER!!!", 0, b"", (0, 0))], 1):
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, major, minor, len(name) + 1, 0]
        head = b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0"
        blob += head + b"\0" * (-len(head) % 4) + data + b"\0" * (-len(data) % 4)
    return blob


def kernel_image(path: str, tmp: str) -> str:
    if not path.endswith(".deb"):
        return path
    subprocess.run(["dpkg-deb", "-x", path, os.path.join(tmp, "deb")], check=True)
    found = sorted(glob.glob(os.path.join(tmp, "deb", "boot", "vmlinu[xz]-*")))
    if not found:
        raise SystemExit(f"error: no boot/vmlinuz-* or boot/vmlinux-* in {path}")
    return found[-1]


def verdicts(lines: list[str]) -> dict[tuple[str, int], tuple]:
    got = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 5 and parts[0] == "R":
            value = ("killed", int(parts[4])) if parts[3] == "killed" else (
                ("exit", int(parts[4])) if parts[3] == "exit" else (int(parts[3]), int(parts[4])))
            got[(parts[1], int(parts[2]))] = value
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="aarch64", help="the kernel's architecture")
    ap.add_argument("--kernel", required=True, help="the kernel's Image (or vmlinuz), or a linux-image .deb")
    ap.add_argument("--json", help="write the verdicts and the summary here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the machine's run")
    args = ap.parse_args()
    machine = args.arch
    spec = ARCHS[machine]
    for tool in (spec["qemu"][0], spec["gcc"]):
        if shutil.which(tool) is None:
            print(f"error: {tool} is not installed (see this script's docstring)", file=sys.stderr)
            return 2
    if not os.path.exists(args.kernel):
        print(f"error: no kernel at {args.kernel}", file=sys.stderr)
        return 2
    filters = {"none": None, "isolated": seccomp.build_filter(machine),
               "plain": seccomp.build_filter(machine, plain=True),
               "own": seccomp.build_filter(machine, plain=True, per_run_uid=True),
               "foreign": seccomp.build_filter("x86_64")}
    calls = cases(machine, toolchain_numbers(machine))
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        subprocess.run([spec["gcc"], "-static", "-O1", "-o", init,
                        os.path.join(HERE, "seccomp_vm_runner.c")], check=True)
        entries = [("dev", 0o40755, b"", (0, 0)), ("dev/console", 0o20600, b"", (5, 1)),
                   ("init", 0o100755, open(init, "rb").read(), (0, 0)),
                   ("cases", 0o100644, "".join(" ".join(map(str, c)) + "\n" for _, c, _ in calls).encode(),
                    (0, 0)),
                   ("filters", 0o100644, "\n".join(filters).encode() + b"\n", (0, 0))]
        entries += [(name, 0o100644, prog, (0, 0)) for name, prog in filters.items() if prog is not None]
        with open(os.path.join(tmp, "initrd"), "wb") as f:
            f.write(cpio(entries))
        image = kernel_image(args.kernel, tmp)
        start = time.monotonic()
        run = subprocess.run([*spec["qemu"], "-m", "512", "-nographic",
                              "-nic", "none",
                              "-no-reboot", "-kernel", image, "-initrd", os.path.join(tmp, "initrd"),
                              "-append", f"console={spec['console']} rdinit=/init panic=-1 quiet"],
                             capture_output=True, text=True, errors="replace", timeout=args.timeout)
        seconds = time.monotonic() - start
    lines = run.stdout.replace("\r", "").split("\n")
    release = next((line.split()[1] for line in lines if line.startswith("UNAME ")), "unknown")
    got = verdicts(lines)
    if f"CASES {len(calls)}" not in lines:
        print(f"error: the machine did not read the {len(calls)} calls", file=sys.stderr)
        return 1
    if "DONE" not in lines:
        print(f"error: the machine did not finish ({len(got)} verdicts); its last lines:", file=sys.stderr)
        print("\n".join(lines[-20:]), file=sys.stderr)
        return 1
    arch, report, failures = AUDIT_ARCH[machine], {}, []
    wanted = {KILL: ("killed", SIGSYS), EPERM: (-1, errno.EPERM), ENOSYS: (-1, errno.ENOSYS)}
    model_says = {seccomp.RET_KILL_PROCESS: KILL, seccomp.RET_EPERM: EPERM, seccomp.RET_ENOSYS: ENOSYS,
                  seccomp.RET_ALLOW: ALLOW}

    def outcome(v):  # an allowed call: success or the errno, as without a filter
        return v if v is None or isinstance(v[0], str) else (v[0] >= 0, v[1] if v[0] < 0 else 0)

    for name, prog in filters.items():
        if prog is None:
            continue
        agree = refused = differs = allowed = 0
        for i, (what, call, policy) in enumerate(calls):
            model = model_says.get(seccomp.decide(prog, arch, *call), "?")
            kernel, control = got.get((name, i)), got.get(("none", i))
            if policy[name] == ALLOW:  # (an errno the control did not get, EPERM included, fails)
                ok = kernel is not None and outcome(kernel) == outcome(control)
                allowed += ok
            else:
                ok = kernel == wanted[policy[name]]
                refused += ok
                differs += ok and control != wanted[policy[name]]  # (unfiltered it answered otherwise)
            ok = ok and model == policy[name]
            agree += ok
            if not ok:
                failures.append(f"{name}: {what} (nr {call[0]}): the policy says {policy[name]}, the model "
                                f"{model}; the kernel answered {kernel} ({control} unfiltered)")
        report[name] = {"calls": len(calls), "agree": agree, "refused": refused,
                        "refused_differs_from_unfiltered": differs, "allowed_as_unfiltered": allowed}
        print(f"{name:9s} filter: {agree}/{len(calls)} calls as the policy says, on the kernel and the "
              f"model: {refused} refused ({differs} of them answered otherwise unfiltered), {allowed} "
              f"allowed and answered as unfiltered")
    for line in failures:
        print("MISMATCH " + line)
    print(f"kernel {release} ({machine}, qemu TCG), {seconds:.0f} s: "
          + ("all agree" if not failures else f"{len(failures)} disagree"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": release, "seconds": round(seconds, 1), "filters": report,
                       "failures": failures, "cases": [w for w, _, _ in calls],
                       "verdicts": {f"{k[0]} {k[1]}": v for k, v in sorted(got.items())}}, f, indent=1)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
