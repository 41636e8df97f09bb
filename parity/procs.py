"""Whether a process named in a left-behind file is gone: the one test behind every cleanup of
what a SIGKILLed run could not remove (sandbox cgroups and scratch directories, batch spools in
/dev/shm, half-built base policies).

A pid that is alive, belongs to another user, or cannot be a pid at all (a name of digits too
large for the kernel's pid type) keeps what names it: only a pid the kernel says does not exist
lets a cleanup remove anything.
"""

from __future__ import annotations

import os


def gone(pid: int | str) -> bool:
    """True only when no process `pid` exists (`kill(pid, 0)` answers ESRCH)."""
    try:
        pid = int(pid)
        if pid <= 0:  # (0 and negatives name process groups, not one process)
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, OverflowError):  # alive and another user's; not a pid
        return False
    return False
