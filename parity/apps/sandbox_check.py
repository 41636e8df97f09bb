"""`parity sandbox`: say which sandbox protections hold on this machine, and try what they stop.

Before a run executes model-written code on a new machine (a cluster node, a container), an operator
wants to know what that code could reach there. This command starts the sandbox the tool task would
use (the degraded one too, where namespaces are not permitted, so that it can be judged) and runs a
few escapes in it, each the kind of thing a model's code has done or a red team tried: read and write
a host file this process can, fill the host's /dev/shm (memory no process owns; the isolated root has
a /dev/shm of the run's own), reach a TCP listener of this process, signal this process, see its
environment, and outlast the time limit. A table says, for each, whether the sandbox held it, with
what the code met ("not tried" where the sandbox could not be set up to run it). Exit 0 only when
every escape was held.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass

from ..envs.sandbox import Sandbox, SandboxLimits
from .ui import status, table

_ATTEMPT = """
import errno, os, socket, sys
def attempt(act):
    try:
        act()
        print("done")
    except OSError as exc:
        print(errno.errorcode.get(exc.errno, exc.errno))
"""


@dataclass
class Escape:
    name: str
    """What the code tried."""
    held: bool
    """Whether the sandbox stopped it."""
    detail: str
    """What the code met (an errno name, the sandbox's verdict, or 'done'), or why it did not run."""
    tried: bool = True
    """False where the sandbox could not be set up for it (held is then False: nothing was shown)."""


def _escapes(host_file: str, host_dir: str, shm: str, port: int,
             secret: str) -> list[tuple[str, str, str | None]]:
    """(name, code, written) of each escape: the code prints 'done' where it got through; `written`,
    for a write, is the host path it leaves (a write that leaves none went to a path of the run's
    own: the isolated root has a /dev/shm of its own)."""
    pid = os.getpid()
    planted = os.path.join(host_dir, "planted")
    return [
        ("read a host file this process can read", f"attempt(lambda: open({host_file!r}).read())", None),
        ("write into a host directory open to everyone",
         f"attempt(lambda: open({planted!r}, 'w').write('x'))", planted),
        ("write a file in the host's /dev/shm (memory no process owns)",
         f"attempt(lambda: open({shm!r}, 'w').write('x'))", shm),
        ("connect to a TCP listener of this process",
         f"attempt(lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2).close())", None),
        ("signal this process",  # (in a pid namespace the number may be one of the run's own)
         f"print('its own pid') if {pid} == os.getpid() else attempt(lambda: os.kill({pid}, 0))", None),
        ("see this process's environment",
         f"print('done' if {secret!r} in str(os.environ) else 'not there')", None),
    ]


def run_escapes(box: Sandbox) -> list[Escape]:
    """Each escape in `box`, with a host file, directory, listener and environment variable made
    for it (and removed after)."""
    secret = f"parity-sandbox-check-{os.getpid()}"
    shm = f"/dev/shm/{secret}"
    results: list[Escape] = []
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as listener:
        host_dir = os.path.join(tmp, "open")
        os.mkdir(host_dir)
        os.chmod(tmp, 0o755)
        os.chmod(host_dir, 0o777)
        host_file = os.path.join(tmp, "readable")
        with open(host_file, "w") as f:
            f.write("host data\n")
        os.chmod(host_file, 0o644)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        os.environ["PARITY_SANDBOX_CHECK"] = secret
        try:
            for name, line, written in _escapes(host_file, host_dir, shm, listener.getsockname()[1], secret):
                r = box.run(_ATTEMPT + line + "\n")
                if r.infra:  # (no code ran: neither held nor got through)
                    results.append(Escape(name, False, r.error or "the sandbox could not be set up", False))
                    continue
                said = r.stdout.strip().splitlines()[-1] if r.ok and r.stdout.strip() else (r.error or "?")
                if said == "done" and written is not None and not os.path.exists(written):
                    said = "wrote a path of its own"
                results.append(Escape(name, said != "done", said))
            r = box.run("while True:\n    pass\n")  # (the wall and cpu limits end it)
            results.append(Escape(f"run past the time limit ({box.limits.wall_s:g} s)",
                                  r.limit in ("time", "cpu") and not r.infra, r.error or "ran to its end",
                                  not r.infra))
        finally:
            os.environ.pop("PARITY_SANDBOX_CHECK", None)
            if os.path.exists(shm):
                os.remove(shm)
    return results


def main(args) -> int:
    """`parity sandbox`."""
    status("sandbox: probing what this machine permits")
    box = Sandbox(SandboxLimits(wall_s=2.0, cpu_s=1), require_isolation=False)
    status("sandbox: trying the escapes")
    results = run_escapes(box)
    status("")
    held = all(e.held for e in results)
    if args.json:
        print(json.dumps({"isolated": box.isolated, "description": box.describe(),
                          "escapes": [asdict(e) for e in results], "all_held": held}, indent=2))
        return 0 if held else 1
    print(box.describe())
    print(table(["escape", "held", "what the code met"],
                [[e.name, "yes" if e.held else "NO" if e.tried else "not tried", e.detail] for e in results]))
    if not box.isolated:
        print("namespaces are not permitted here: a run refuses this sandbox unless "
              "task.require_isolation = false or PARITY_ALLOW_DEGRADED_SANDBOX=1")
    untried = sum(not e.tried for e in results)
    print("every escape held" if held else
          f"{untried} escape(s) not tried: the sandbox could not run code here (a run's tool calls would "
          f"fail the same way)" if untried else
          "NOT every escape held: model-written code could reach this machine")
    return 0 if held else 1
