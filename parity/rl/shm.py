"""/dev/shm, where the local rollout backend shares memory, and what running out of it says.

Weight versions go to the workers as PyTorch shared tensors (files in /dev/shm), batches come back
through a spool there, and every queue's semaphores live there too. Out of room, the failures name
no place: a semaphore's `[Errno 28] No space left on device`, PyTorch's "unable to allocate shared
memory(shm) for file </torch_...>", and a restarted worker met the same wall. Containers give
/dev/shm 64 MiB by default, less than a few copies of a real model's weights.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator

from ..errors import ParityError

SHM = "/dev/shm"


FULL_BELOW = 1 << 20
"""A bare ENOSPC (no file named: a semaphore's) is taken for /dev/shm's only while /dev/shm has less
than this free (a write to a full disk raises one too)."""


def check_shared_memory(exc: BaseException) -> None:
    """Raise a ParityError naming /dev/shm (its size, what needs it, how to grow it) when `exc` is
    /dev/shm out of room; return for any other error."""
    text = str(exc)
    try:
        usage = shutil.disk_usage(SHM)
    except OSError:
        usage = None
    bare = isinstance(exc, OSError) and exc.errno == errno.ENOSPC and exc.filename is None
    if not ((bare and usage is not None and usage.free < FULL_BELOW)
            or ("shared memory" in text and "No space left on device" in text)):
        return
    size = f" ({usage.total / 2**20:,.1f} MiB, {usage.free / 2**20:,.1f} MiB free)" if usage else ""
    raise ParityError(f"no space left in {SHM}{size}: local rollout workers share weight versions and "
                      "batches there (a few copies of the model's weights); give it more room (docker run "
                      "--shm-size, a memory-backed emptyDir volume)") from None


@contextlib.contextmanager
def shared_memory_errors() -> Iterator[None]:
    """`check_shared_memory` on whatever the block raises (PyTorch's failure is a RuntimeError)."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        check_shared_memory(exc)
        raise
