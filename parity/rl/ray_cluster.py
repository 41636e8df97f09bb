"""The Ray cluster a run's rollout actors live on: Ray itself (a one-line error when it is not
installed), a private head on this machine that dies with the learner (its own session, so a
terminal's Ctrl-C reaches only the learner, and its parent-death signal set), a reachability check
of a given head's address, and how many GPUs each actor reserves."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError, ParityError


def require_ray():
    """The `ray` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("rollout.backend = 'ray' needs Ray: pip install -e '.[ray]' "
                          "(or pip install 'ray>=2.9')") from None
    return ray


_PDEATHSIG_EXEC = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 15, 0, 0, 0); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])")
"""Run argv[2:] with SIGTERM as its parent-death signal (kept across exec), unless the parent
(argv[1]) is already gone."""


def start_local_head(num_cpus: int, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """A Ray head on this machine's loopback that stops (all its processes) when this process dies;
    returns the head's process and its address."""
    log_file = tempfile.NamedTemporaryFile(prefix="parity-ray-head-", suffix=".log", delete=False)
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    argv = [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *ray_cli, "start", "--head", "--block",
            f"--num-cpus={num_cpus}", "--port=0", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
            "--disable-usage-stats"]
    # the learner's Ray read its authentication mode when it was imported (unset means disabled);
    # the head must use the same one
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    # its own session: a terminal's Ctrl-C (to the foreground process group) reaches the learner,
    # which stops at a step boundary and saves, not the head under its running actors
    proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = open(log_file.name, errors="replace").read()
        found = re.search(r"ray start --address='([^']+)'", text)
        if found:
            os.unlink(log_file.name)
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    tail = [ln for ln in open(log_file.name, errors="replace").read().splitlines() if ln.strip()][-1:]
    raise ParityError(f"could not start a Ray head on this machine ({tail[0] if tail else 'no output'}; "
                      f"log: {log_file.name})")


def _private_head_auth() -> None:
    """Token authentication for the run-private head, as Ray's own local clusters have it (Ray reads
    the mode once, on import). `ray start` refuses token mode without a token and, unlike
    `ray.init()`, makes none: with no token at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
    ~/.ray/auth_token) the run makes its own, in its environment only (the head, the actors and
    this driver inherit it; nothing is written to the home directory)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"].lower() != "token":
        return
    have = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not have and not (Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def actor_gpus(cfg, workers: int, cluster_gpus: float) -> float:
    """GPUs each rollout actor reserves: none for a CPU model; for a CUDA model
    `ray.gpus_per_worker`, else one each when the cluster has a GPU per worker, else an equal
    share of one (Ray hides the GPUs from an actor that reserves none). A one-line error when the
    cluster has too few."""
    if not str(cfg.model.device).startswith("cuda"):
        return 0.0
    each = cfg.ray.gpus_per_worker
    if each is None:
        each = 1.0 if cluster_gpus >= workers else 1.0 / workers
    if cluster_gpus < min(each * workers, 1.0):
        raise ConfigError(f"model.device is {cfg.model.device!r} but the Ray cluster has {cluster_gpus:g} "
                          f"GPUs; rollout.workers={workers} x {each:g} GPU each need {each * workers:g}")
    return each


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A one-line error now when nothing answers at a Ray head's `host:port` (or `ray://host:port`),
    or something that is not a Ray head does: `ray.init` itself retries a wrong address for many
    minutes, printing its GCS client's warnings. 'auto' and 'local' are Ray's own lookups and are
    left to it, as is a cluster with TLS (RAY_USE_TLS), whose handshake this check does not speak."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d+)", address.strip())
    if not m:
        if address.strip() in ("auto", "local"):
            return
        raise ConfigError(f"ray.address must be host:port, ray://host:port, 'auto' or 'local', "
                          f"got {address!r}")
    try:
        conn = socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout_s)
    except (OSError, ValueError, OverflowError) as exc:
        raise ParityError(f"cannot reach the Ray head at {address}: "
                          f"{getattr(exc, 'strerror', None) or exc or type(exc).__name__}") from None
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("0", "false", "") and not _speaks_grpc(conn):
            raise ParityError(f"{address} answers but is not a Ray head (no gRPC reply there); "
                              f"give the head's GCS port (6379 by default) or its ray:// client port")


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""What an HTTP/2 client sends first: the connection preface, then an empty SETTINGS frame."""


def _speaks_grpc(conn: socket.socket) -> bool:
    """Whether the peer answers an HTTP/2 connection preface with a SETTINGS frame, as every gRPC
    server does (Ray's GCS and its client server are gRPC). A web server, an SSH daemon or a port
    that accepts and stays silent does not, and `ray.init` would retry it for minutes."""
    try:
        conn.sendall(_HTTP2_PREFACE)
        header = b""
        while len(header) < 9:
            chunk = conn.recv(9 - len(header))
            if not chunk:
                return False
            header += chunk
    except OSError:  # a reset, or no answer within the connection's timeout
        return False
    return header[3] == 4 and header[4] & 1 == 0  # a SETTINGS frame that is not an ACK
