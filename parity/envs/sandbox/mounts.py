"""What the sandbox's private root holds (the host's mount plan) and who can run the interpreter.

Computed on the host, once per process, from where this interpreter and its standard library
live; the launcher receives the plan as arguments and builds the root from it (`rootfs.py`).
"""

from __future__ import annotations

import os
import stat
import sys

_PLAN: list[tuple[str, str, str]] | None = None


def _under(path: str, parents: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def python_paths() -> tuple[str, list[str]]:
    """The real interpreter and the prefixes it needs, outermost first."""
    exe = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(exe))}
    return exe, sorted(p for p in prefixes if p not in ("", "/"))


def mount_plan() -> list[tuple[str, str, str]]:
    """What the private root holds, as (kind, host path, arg) triples, parents before children.

    Kinds: "ro" read-only bind of a directory, "file" read-only bind of a file, "dev" bind of a device
    node, "ln" a symlink (arg: its target) mirroring the host, "mask" an empty read-only tmpfs over a
    directory (installed packages, /usr/local) so it is not visible.
    """
    global _PLAN
    if _PLAN is not None:
        return _PLAN
    exe, prefixes = python_paths()
    binds = ["/usr"]
    links: list[tuple[str, str, str]] = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append(("ln", top, os.readlink(top)))
        elif os.path.isdir(top):
            binds.append(top)
    for prefix in prefixes:
        if not _under(prefix, binds):
            binds.append(prefix)
    plan: list[tuple[str, str, str]] = links + [("ro", b, "") for b in sorted(binds)]
    if os.path.isfile("/etc/ld.so.cache"):
        plan.append(("file", "/etc/ld.so.cache", ""))
    for dev in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"):
        if os.path.exists(dev):
            plan.append(("dev", dev, ""))
    masks: list[str] = []
    local = os.path.realpath("/usr/local")  # (the real path: /usr/local may be a link within /usr)
    if os.path.isdir(local) and _under(local, binds) and not any(_under(p, [local])
                                                                  for p in [exe, *prefixes]):
        masks.append(local)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for base in [*prefixes, "/usr", "/usr/local"]:
        for sub in (
            f"lib/{version}/site-packages",
            f"lib/{version}/dist-packages",
            f"lib64/{version}/site-packages",  # (Fedora's and RHEL's compiled packages)
            "lib/python3/dist-packages",
        ):
            path = os.path.join(base, sub)
            if os.path.isdir(path) and not os.path.islink(path) and _under(path, binds):
                if not _under(path, masks) and os.path.realpath(path) == path:
                    masks.append(path)
    plan += [("mask", m, "") for m in sorted(set(masks))]
    _PLAN = plan
    return plan


def others_can_run_python() -> bool:
    """Whether an unprivileged uid can run the interpreter (every directory on the way is o+x)."""
    exe, _ = python_paths()
    for target in (exe, os.path.dirname(os.path.realpath(os.__file__))):
        path = target
        while True:
            try:
                if not os.stat(path).st_mode & stat.S_IXOTH:
                    return False
            except OSError:
                return False
            if path in ("/", ""):
                break
            path = os.path.dirname(path)
    return True


def expected_root_listing() -> str:
    tops = {p.split("/")[1] for _, p, _ in mount_plan()} | {"work", "tmp"}
    return repr(sorted(tops))
