#!/usr/bin/env python3
"""The whole sandbox on an aarch64 kernel: `parity sandbox`'s escapes and the kernel surface, in a VM.

`seccomp_vm_check.py` holds the aarch64 filter's verdicts to a kernel's; this script runs the real
thing there: the host side (`parity/envs/sandbox`, which needs only the standard library), the
launcher, namespaces, cgroup v2, Landlock and the filter, under an aarch64 CPython from Debian's
packages, booted with `qemu-system-aarch64` (TCG). In the VM, as root: the isolated sandbox, then
the degraded one (no namespaces, forced as the tests force it, per-run uid, Landlock), each running
`parity sandbox`'s escapes and calls into the kernel surface (keyctl, unshare, bpf, io_uring,
an AF_VSOCK socket, clone with CLONE_NEWUSER; in the degraded one also a setuid chmod, a setuid file
made, and any socket) that a plain child process makes unrefused, the control, and a host file's
mode, which the per-run uid may not change; its own file's mode and `shutil.copy2` must work in
both. Prints what held; exit 0 only when all did.

    dpkg --add-architecture arm64 && apt-get update
    apt-get download python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 \\
        libc6:arm64 libexpat1:arm64 zlib1g:arm64 libffi8:arm64 libuuid1:arm64 libgcc-s1:arm64 ...
    python scripts/sandbox_vm_check.py --kernel linux-image-6.12.*-arm64*.deb --debs DIR_OF_DEBS
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from seccomp_vm_check import cpio, kernel_image  # noqa: E402

REPO = os.path.dirname(HERE)
FILES = ["parity/errors.py", "parity/procs.py", "parity/fields.py", "parity/apps/sandbox_check.py",
         "parity/apps/ui.py"]

INIT = r'''#!/usr/bin/python3.11
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
for src, dst, kind in (("proc", "/proc", b"proc"), ("sys", "/sys", b"sysfs"), ("dev", "/dev", b"devtmpfs"),
                       ("tmp", "/tmp", b"tmpfs"), ("cg", "/sys/fs/cgroup", b"cgroup2"),
                       ("shm", "/dev/shm", b"tmpfs")):
    os.makedirs(dst, exist_ok=True)
    libc.mount(src.encode(), dst.encode(), kind, 0, None)
os.environ.update(PATH="/usr/bin:/bin", HOME="/root")
r = subprocess.run([sys.executable, "/opt/check.py"], cwd="/opt")
print("EXIT", r.returncode, flush=True)
os.sync()
libc.reboot(0x4321FEDC)  # LINUX_REBOOT_CMD_POWER_OFF
'''

CHECK = r'''
import json, os, subprocess, sys, types
sys.path.insert(0, "/opt")
for name in ("parity", "parity.envs", "parity.apps"):  # (the packages' __init__s import torch)
    module = types.ModuleType(name)
    module.__path__ = ["/opt/" + name.replace(".", "/")]
    sys.modules[name] = module
import parity.envs.sandbox as sandbox_module
from parity.envs.sandbox import Sandbox, SandboxLimits, seccomp
from parity.envs.sandbox.syscalls import NUMBERS
from parity.apps.sandbox_check import run_escapes

NR = NUMBERS["aarch64"]
CALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(what, nr, *args):
    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    if rc == 0 and nr == %d:  # (a clone's child leaves at once)
        os._exit(0)
    print(what, "done" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
""" % NR["clone"] + "".join(f"call({w!r}, {NR[n]}, *{a})\n" for w, n, a in (
    ("keyctl", "keyctl", (0, -3, 0)), ("bpf", "bpf", (0, 0, 0)), ("io_uring_setup", "io_uring_setup", (1, 0)),
    ("socket_AF_VSOCK", "socket", (40, 1, 0)),
    ("clone_CLONE_NEWUSER", "clone", (0x10000000 | 17, 0, 0, 0, 0)),
    ("unshare_CLONE_NEWUSER", "unshare", (0x10000000,)))) + """
import shutil, tempfile
path = tempfile.mkstemp(dir=".")[1]
for what, act in (("chmod", lambda: os.chmod(path, 0o4755)), ("chmod_own", lambda: os.chmod(path, 0o640)),
                  ("copy2", lambda: shutil.copy2(path, path + ".copy")),
                  ("chmod_host", lambda: os.chmod("/opt/check.py", 0o644)),
                  ("made_setuid", lambda: os.close(os.open(path + ".s", os.O_CREAT | os.O_WRONLY, 0o4755)))):
    try:
        act()
        print(what, "done")
    except OSError as exc:
        print(what, errno.errorcode[exc.errno])
try:
    __import__("socket").socket(1).close()
    print("socket_AF_UNIX done")
except OSError as exc:
    print("socket_AF_UNIX", errno.errorcode[exc.errno])
"""

control = subprocess.run([sys.executable, "-c", CALLS], capture_output=True, text=True, cwd="/tmp")
report = {"uname": os.uname().release, "control": control.stdout.split("\n")[:-1]}
limits = SandboxLimits(wall_s=40.0, cpu_s=8)  # (under TCG an interpreter takes seconds to start)
for name in ("isolated", "degraded"):
    if name == "degraded":  # forced as the tests force it; the probe's protections from a first run
        sandbox_module._PROBE = sandbox_module._Probe("plain", "forced by the check")
        first = Sandbox(limits, require_isolation=False).run("pass")
        sandbox_module._PROBE = sandbox_module._Probe("plain", "forced by the check", first.protections)
    box = Sandbox(limits, require_isolation=False)
    escapes = run_escapes(box)
    r = box.run(CALLS)
    report[name] = {"describe": box.describe(), "isolated": box.isolated, "protections": r.protections,
                    "escapes": [[e.name, e.held, e.detail] for e in escapes],
                    "calls": r.stdout.split("\n")[:-1] if r.ok else ["error: " + str(r.error)]}
print("REPORT " + json.dumps(report), flush=True)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", required=True, help="an aarch64 kernel Image, or a linux-image .deb")
    ap.add_argument("--debs", required=True, help="a folder of arm64 .debs: CPython 3.11 and its libraries")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    if shutil.which("qemu-system-aarch64") is None:
        print("error: qemu-system-aarch64 is not installed (apt-get install qemu-system-arm)",
              file=sys.stderr)
        return 2
    if not os.path.exists(args.kernel):
        print(f"error: no kernel at {args.kernel}", file=sys.stderr)
        return 2
    debs = os.listdir(args.debs) if os.path.isdir(args.debs) else []
    if not any(d.startswith("python3.11-minimal") for d in debs):
        print(f"error: {args.debs} holds no python3.11-minimal .deb (see this script's docstring)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "root")
        for deb in sorted(os.listdir(args.debs)):
            if deb.endswith(".deb"):
                subprocess.run(["dpkg-deb", "-x", os.path.join(args.debs, deb), root], check=True)
        package = os.listdir(os.path.join(REPO, "parity/envs/sandbox"))
        for rel in FILES + [f"parity/envs/sandbox/{f}" for f in package if f.endswith(".py")]:
            os.makedirs(os.path.join(root, "opt", os.path.dirname(rel)), exist_ok=True)
            shutil.copy(os.path.join(REPO, rel), os.path.join(root, "opt", rel))
        entries = [("dev", 0o40755, b"", (0, 0)), ("dev/console", 0o20600, b"", (5, 1))]
        for top, dirs, files in os.walk(root):
            for name in sorted(dirs + files):
                path = os.path.join(top, name)
                rel, st = os.path.relpath(path, root), os.lstat(path)
                if os.path.islink(path):
                    entries.append((rel, 0o120777, os.readlink(path).encode(), (0, 0)))
                elif os.path.isdir(path):
                    entries.append((rel, 0o40755, b"", (0, 0)))
                else:
                    entries.append((rel, 0o100000 | (st.st_mode & 0o7777), open(path, "rb").read(), (0, 0)))
        for d in ("proc", "sys", "tmp", "root", "bin"):
            entries.append((d, 0o40755 if d != "tmp" else 0o41777, b"", (0, 0)))
        entries += [("init", 0o100755, INIT.encode(), (0, 0)),
                    ("opt/check.py", 0o100644, CHECK.encode(), (0, 0))]
        with open(os.path.join(tmp, "initrd"), "wb") as f:  # (parents before children)
            f.write(cpio(entries))
        image = kernel_image(args.kernel, tmp)
        run = subprocess.run(["qemu-system-aarch64", "-M", "virt", "-cpu", "max", "-smp", "2", "-m", "2048",
                              "-nographic", "-nic", "none", "-no-reboot", "-kernel", image,
                              "-initrd", os.path.join(tmp, "initrd"),
                              "-append", "console=ttyAMA0 rdinit=/init panic=-1 quiet"],
                             capture_output=True, text=True, errors="replace", timeout=args.timeout)
    lines = run.stdout.replace("\r", "").split("\n")
    found = [line for line in lines if line.startswith("REPORT ")]
    if not found:
        print("error: no report from the machine; its last lines:\n" + "\n".join(lines[-30:]),
              file=sys.stderr)
        return 1
    report = json.loads(found[-1][len("REPORT "):])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"kernel {report['uname']} (aarch64, qemu TCG); the control, a plain child process: "
          + ", ".join(report["control"]))
    ok = True
    control = dict(line.split(" ", 1) for line in report["control"])
    for name in ("isolated", "degraded"):
        part = report[name]
        print(f"\n{name}: {part['describe']}\n  protections: {' '.join(part['protections'])}")
        for escape, held, detail in part["escapes"]:
            ok &= held
            print(f"  {'held' if held else 'NOT HELD'}: {escape} ({detail})")
        for line in part["calls"]:
            what, said = line.split(" ", 1)
            allowed = what in ("chmod", "made_setuid", "socket_AF_UNIX") and name == "isolated"  # (own files)
            unrefused = control.get(what, "EPERM") != "EPERM"  # (the control: the kernel lets it through)
            if what in ("chmod_own", "copy2"):  # (a mode and times of its own: the per-run uid's too)
                good = said == "done"
            elif what == "chmod_host":  # (the kernel's refusal: the per-run uid owns no host file)
                good = said != "done" and control.get(what) == "done"
            else:
                good = (said != "EPERM") if allowed else (said == "EPERM" and unrefused)
            ok &= good
            print(f"  {'ok' if good else 'WRONG'}: {what} {said} "
                  f"(a plain child process: {control.get(what)})")
    print("\nall held" if ok else "\nNOT all held")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
