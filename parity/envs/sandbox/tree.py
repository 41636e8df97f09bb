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

CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")
"""Whether the kernel lists each thread's children (CONFIG_PROC_CHILDREN); else /proc is scanned."""


def _parents():
    """{pid: parent pid} of every process, from /proc/PID/stat (where the kernel lists no children)."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat", "rb") as f:
                    stat = f.read()
                found[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                pass  # (gone meanwhile)
    return found


def children(of="self", parents=None):
    """The children of process `of` (in the plain modes the launcher is their subreaper: every
    orphan of the run, a double-forked daemon in its own session too, becomes one): from the
    kernel's list of each thread's children, or where it keeps none, from `parents` (`_parents`).
    A process gone meanwhile has none."""
    if not CHILDREN_FILES:
        me = os.getpid() if of == "self" else of
        parents = parents if parents is not None else _parents()
        return [pid for pid, parent in parents.items() if parent == me]
    found = []
    try:
        for tid in os.listdir("/proc/" + str(of) + "/task"):
            with open("/proc/" + str(of) + "/task/" + tid + "/children", "rb") as f:
                found += [int(p) for p in f.read().split()]
    except OSError:
        pass  # (the process, or one of its threads, ended while it was read)
    return found


def run_tree():
    """Every process of the run: the launcher's descendants (the code, whatever it started, and
    in the plain modes the orphans it left, which the launcher adopts)."""
    parents = None if CHILDREN_FILES else _parents()  # (one scan of /proc for the whole walk)
    found, todo = [], children(parents=parents)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children(pid, parents)
    return found


def _fields(path, names):
    """The kB figures of `names` in a /proc file of "Name:  N kB" lines ({} if it cannot be read)."""
    out = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                key = line.split(b":", 1)[0]
                if key in names:
                    out[key] = int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        return {}
    return out


def run_memory(pids):
    """Bytes of memory the processes `pids` hold between them: each one's proportional share of
    its resident anonymous and shared-memory pages and of its swap (heap, stacks, memfd and tmpfs
    mappings; a page that forked processes share counts once among them, as a cgroup counts it),
    from /proc/PID/smaps_rollup; where that has no proportional figures (Linux < 5.7, or not
    readable), resident anonymous and shared pages from /proc/PID/status, a shared page then once
    per process. Not the interpreter's and libraries' file pages, which the host shares."""
    total = 0
    for pid in pids:
        pss = _fields(f"/proc/{pid}/smaps_rollup", (b"Pss_Anon", b"Pss_Shmem", b"SwapPss"))
        if b"Pss_Anon" in pss:
            total += sum(pss.values())
        else:
            total += sum(_fields(f"/proc/{pid}/status", (b"RssAnon", b"RssShmem", b"VmSwap")).values())
    return total


def running(pids):
    """How many of `pids` are running: not zombies (an orphan the launcher adopted stays one until
    the run ends and the launcher reaps it) and not gone."""
    count = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] not in (b"Z", b"X"):
            count += 1
    return count


def kill_run(pid, alive, plain):
    """SIGKILL the run, by pids that cannot have been reused: with a pid namespace its first
    process `pid` (the kernel ends every process of the namespace with it), while it is not yet
    reaped (`alive`); in the plain modes the launcher's own children (zombies until the launcher
    reaps them), the orphans they leave becoming its children in turn (`reap_children` ends them)."""
    for p in children() if plain else [pid] if alive else []:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


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
