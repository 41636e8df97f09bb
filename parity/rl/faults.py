"""Fault injection for the reliability tests: named faults fired at chosen points of a run.

`PARITY_FAULTS` lists faults as `name@index[:argument]`, comma-separated, e.g.
`worker-hang@2,corrupt-batch@1`; each fires once per `PARITY_FAULT_STATE` directory (a marker
file records that it fired, so a restarted worker does not repeat it). Without the variables
nothing happens and `fire` costs one dictionary lookup. The points:

- `worker-hang@b`: the rollout worker stops (sleeps forever) after sampling batch b;
- `worker-exit@b`: the rollout worker process exits after sampling batch b;
- `worker-hold@b:PATH`: the rollout worker holds batch b back until PATH exists (at most 10
  minutes; a test says when the batch may finish);
- `worker-oom@b:CGROUP`: the worker joins the memory cgroup CGROUP and allocates until the
  kernel's OOM killer ends it;
- `corrupt-batch@b`: the worker writes garbage instead of batch b;
- `actor-init@b`: the Ray rollout actor whose first batch is b raises a ParityError while it
  starts;
- `ckpt-kill@s`: the learner's process is SIGKILLed half-way through writing checkpoint-s.
"""

from __future__ import annotations

import os
import signal
import time


def _configured() -> dict[tuple[str, int], str]:
    out = {}
    for item in filter(None, os.environ.get("PARITY_FAULTS", "").split(",")):
        name, _, rest = item.partition("@")
        index, _, argument = rest.partition(":")
        out[(name.strip(), int(index))] = argument
    return out


def fire(name: str, index: int) -> str | None:
    """The fault's argument ('' when it has none) if `name@index` is configured and has not
    fired yet in this state directory; else None."""
    faults = _configured()
    if (name, index) not in faults:
        return None
    state = os.environ.get("PARITY_FAULT_STATE")
    if state:
        try:
            os.close(os.open(os.path.join(state, f"{name}@{index}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
    return faults[(name, index)]


def worker_faults(batch_index: int) -> bool:
    """The rollout worker's fault points after sampling a batch; True: write a corrupt batch."""
    if fire("worker-hang", batch_index) is not None:
        while True:
            time.sleep(3600)
    if fire("worker-exit", batch_index) is not None:
        os._exit(1)
    gate = fire("worker-hold", batch_index)
    if gate:
        deadline = time.monotonic() + 600
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
    cgroup = fire("worker-oom", batch_index)
    if cgroup is not None:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        hog = []
        while True:
            hog.append(bytearray(64 << 20))
    return fire("corrupt-batch", batch_index) is not None


def checkpoint_fault(step: int) -> None:
    """The checkpoint writer's fault point (between the model files and the manifest)."""
    if fire("ckpt-kill", step) is not None:
        os.kill(os.getpid(), signal.SIGKILL)


def actor_init_fault(first_batch: int) -> None:
    """The Ray rollout actor's fault point in its start-up."""
    if fire("actor-init", first_batch) is not None:
        from ..errors import ParityError

        raise ParityError(f"injected fault: actor start-up (actor-init@{first_batch})")
