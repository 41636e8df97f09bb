"""The run's processes as the sandbox launcher sees them: find them, sum their memory, kill them.

Imported only by `launcher.py` (which puts this directory on its path: it runs under `python -I`),
never by the host. In the plain modes the launcher is the subreaper of the run, so every orphan
the code leaves (a double-forked daemon in its own session too) becomes its child; in the
namespace modes they are the descendants of the pid namespace's first process. Where no cgroup
holds the run, `run_memory` over `run_tree` is the whole-run memory bound the launcher enforces.
Only built-in modules are used (start-up speed).
"""

import os
import signal
import time


def children(of="self"):
    """The children of process `of` (in the plain modes the launcher is their subreaper: every
    orphan of the run, a double-forked daemon in its own session too, becomes one): from the
    kernel's list of each thread's children, or where it has none (CONFIG_PROC_CHILDREN), from
    every /proc/PID/stat."""
    try:
        found = []
        for tid in os.listdir("/proc/" + str(of) + "/task"):
            with open("/proc/" + str(of) + "/task/" + tid + "/children", "rb") as f:
                found += [int(p) for p in f.read().split()]
        return found
    except OSError:
        pass
    parent, found = os.getpid() if of == "self" else of, []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat", "rb") as f:
                    stat = f.read()
                if int(stat[stat.rindex(b")") + 2:].split()[1]) == parent:
                    found.append(int(name))
            except (OSError, ValueError, IndexError):
                pass  # (gone meanwhile)
    return found


def run_tree():
    """Every process of the run: the launcher's descendants (the code, whatever it started, and
    in the plain modes the orphans it left, which the launcher adopts)."""
    found, todo = [], children()
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children(pid)
    return found


def run_memory(pids):
    """Bytes of memory the processes `pids` hold: their resident anonymous and shared-memory
    pages (heap, stacks, memfd and tmpfs mappings; not the interpreter's and libraries' file
    pages, which every process shares with the host)."""
    total = 0
    for pid in pids:
        try:
            with open("/proc/" + str(pid) + "/status", "rb") as f:
                for line in f:
                    if line.startswith((b"RssAnon:", b"RssShmem:")):
                        total += int(line.split()[1]) << 10
        except (OSError, ValueError, IndexError):
            pass  # (gone meanwhile)
    return total


def reap_children(limit_s=1.0):
    """Kill and reap every process the run left behind, until none is left (or `limit_s` passed):
    without a pid namespace, a cgroup or a uid of its own, nothing else ends them."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        left = children()
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in left:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
