"""The Ray rollout backend: `rollout.workers` RolloutWorker actors on a Ray cluster.

- Each actor (`RolloutActor`) is one process holding model + engine + environment (and its
  sandbox) around one `RolloutWorker`. It has two concurrency groups of one thread each:
  "weights" (`receive`, `stop`) and "rollout" (`sample`, run in submission order), so weights
  arrive while a batch is being sampled (admission waits, in-flight updates) and batches are
  sampled one at a time.
- Each published version goes into the object store once (`ray.put`); every actor receives the
  reference. Batches come back by reference (the result of `sample.remote(b)`) and the learner
  fetches them in order.
- Admission control is the worker's (batch b only with weights >= b - max_policy_lag, exactly
  that version in deterministic mode); the driver keeps each actor's next admissible batches
  submitted, so rollout runs ahead up to the lag bound, as with the local backend.
- A dead actor is replaced: the new one starts from the batch the learner waits for and its
  unconsumed batches are submitted again; nothing consumed is repeated, nothing is lost.
- With `ray.address` unset the run starts a Ray head on this machine (`ray start --head
  --block`, with enough logical CPUs for the workers) whose parent-death signal is set, so it
  takes every Ray process down with it even when the learner is killed; with an address the run
  joins that cluster, and Ray ends the run's actors when their owner, the learner, dies.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import TrainConfig
from ..errors import ConfigError, ParityError
from ..model import ModelConfig
from .build import build_env, model_skeleton
from .faults import worker_faults
from .local import split_threads
from .rollout_worker import RolloutWorker, State, first_batch, resume_floor, start_version
from .trajectory import RolloutBatch

log = logging.getLogger(__name__)

_GROUPS = {"weights": 1, "rollout": 1}


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
    proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env)
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


class RolloutActor:
    """The body of a rollout-worker actor (made a Ray actor class by `RayRollout`)."""

    def __init__(self, cfg: TrainConfig, model_config: ModelConfig, state: State, version: int,
                 threads: int, floor: int = 0):
        torch.set_num_threads(threads)
        model = model_skeleton(cfg, model_config)
        model.load_state_dict(state)
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._last_beat = time.monotonic()
        self.worker = RolloutWorker(cfg, model, build_env(cfg, model_config.vocab_size), version, self._poll,
                                    self._beat)
        self.worker.floor = floor

    def _beat(self) -> None:
        self._last_beat = time.monotonic()

    def silence(self) -> float:
        """Seconds since the worker last showed a sign of life (answered from another thread)."""
        return time.monotonic() - self._last_beat

    def _poll(self, block: bool) -> list[tuple[int, State]]:
        got: list[tuple[int, State]] = []
        try:
            while True:
                got.append(self._inbox.get(block=block, timeout=0.5 if block else None))
                block = False
        except queue.Empty:
            pass
        return got

    def receive(self, version: int, state: State) -> None:
        """A newly published version ("weights" group: runs while a batch is being sampled)."""
        self._inbox.put((version, state))

    def stop(self) -> None:
        self._stop.set()

    def sample(self, batch_index: int) -> RolloutBatch | None:
        """Wait for admissible weights, then sample batch `batch_index` (None when stopped)."""
        wait_s = self.worker.wait_for(batch_index, self._stop.is_set)
        if wait_s is None:
            return None
        batch = self.worker.sample(batch_index, wait_s)
        worker_faults(batch_index)  # (fault-injection tests only)
        return batch

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A one-line error now when nothing answers at a Ray head's `host:port` (or `ray://host:port`):
    `ray.init` itself retries a wrong address for many minutes. 'auto' and 'local' are Ray's own
    lookups and are left to it."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d+)", address.strip())
    if not m:
        if address.strip() in ("auto", "local"):
            return
        raise ConfigError(f"ray.address must be host:port, ray://host:port, 'auto' or 'local', "
                          f"got {address!r}")
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout_s).close()
    except (OSError, ValueError, OverflowError) as exc:
        raise ParityError(f"cannot reach the Ray head at {address}: "
                          f"{getattr(exc, 'strerror', None) or exc or type(exc).__name__}") from None


class RayRollout:
    """Rollout on Ray actors, with the local backend's interface: start, publish, next_batch, close."""

    max_restarts = 3
    """Actor restarts allowed over the run (all workers together) before it gives up."""

    def __init__(self, cfg: TrainConfig, model_config: ModelConfig,
                 versions: Callable[[], dict[int, State]]):
        if cfg.ray.address is None and "ray" not in sys.modules:
            _private_head_auth()
        elif cfg.ray.address is not None:
            check_reachable(cfg.ray.address)  # before the run writes anything
        self.ray = require_ray()
        self.cfg, self.model_config, self.versions = cfg, model_config, versions
        self.n = cfg.rollout.workers
        self.actors: list = [None] * self.n
        self.next_submit = [0] * self.n  # per worker: the next batch to submit
        self.pending: dict[int, object] = {}  # batch index -> ObjectRef of its RolloutBatch
        self.ready: dict[int, RolloutBatch] = {}  # batches restored from a checkpoint
        self.floor = 0  # the oldest version batches may ask for (see RolloutWorker.floor)
        self.refs: dict[int, object] = {}  # version -> ObjectRef of its weights
        self.restarts = 0
        self._head: subprocess.Popen | None = None  # the Ray head this run started, if any
        self._actor_class = None

    # ------------------------------------------------------------------ cluster
    def _connect(self) -> None:
        ray, cfg = self.ray, self.cfg
        needed = math.ceil(self.n * cfg.ray.cpus_per_worker)
        if not ray.is_initialized():
            address = cfg.ray.address
            if address is None:
                self._head, address = start_local_head(max(os.cpu_count() or 1, needed))
            try:
                ray.init(address=address, namespace=cfg.ray.namespace, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = cfg.ray.address or "this machine"
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ParityError(f"cannot start or join Ray at {where}: {reason}") from None
        total = ray.cluster_resources().get("CPU", 0)
        if total < needed:
            raise ConfigError(f"the Ray cluster has {total:g} CPUs; rollout.workers={self.n} x "
                              f"ray.cpus_per_worker={cfg.ray.cpus_per_worker:g} need {needed}")
        # actors start from the cluster's environment: pass on the fault-injection settings, if any
        faults = {k: os.environ[k] for k in ("PARITY_FAULTS", "PARITY_FAULT_STATE") if k in os.environ}
        options = {"runtime_env": {"env_vars": faults}} if faults else {}
        gpus = actor_gpus(cfg, self.n, ray.cluster_resources().get("GPU", 0))
        if gpus:
            options["num_gpus"] = gpus
        self._actor_class = ray.remote(num_cpus=cfg.ray.cpus_per_worker, concurrency_groups=_GROUPS,
                                       max_restarts=0, **options)(RolloutActor)

    def _ref(self, version: int, state: State):
        """The object-store reference of a version's weights: one put per version."""
        if version not in self.refs:
            self.refs[version] = self.ray.put(state)
        return self.refs[version]

    @property
    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    # ------------------------------------------------------------------ the backend interface
    def start(self, start_batch: int, ready: list[RolloutBatch] | None = None) -> None:
        """Start the actors on batches start_batch, ...; `ready` batches (from a checkpoint) are
        served as they are."""
        self.ready = {b.index: b for b in ready or [] if b.index >= start_batch}
        self.floor = resume_floor(self.cfg, self.versions(), start_batch)
        self._connect()
        torch.set_num_threads(split_threads(self.cfg)[1])
        for i in range(self.n):
            self._start_actor(i, start_batch)
        self._submit(start_batch)
        nodes = set(self.ray.get([a.node.remote() for a in self.actors]))
        log.info("%d rollout actor(s) on %d Ray node(s) (%g CPU each)", self.n, len(nodes),
                 self.cfg.ray.cpus_per_worker)

    def _start_actor(self, i: int, from_batch: int) -> None:
        history = self.versions()
        first = first_batch(i, self.n, from_batch)
        while first in self.ready:  # restored from a checkpoint: not sampled again
            first += self.n
        version = start_version(self.cfg, history, first)
        if version not in history:
            raise ParityError(f"batch {first} needs weight version {version}, which is not kept (a "
                              "checkpoint resumed with another max_policy_lag?); resume with the run's lag")
        threads = max(1, int(self.cfg.ray.cpus_per_worker))
        actor = self._actor_class.remote(self.cfg, self.model_config, self._ref(version, history[version]),
                                         version, threads, self.floor)
        for v in sorted(history):
            if v > version:
                actor.receive.options(concurrency_group="weights").remote(v, self._ref(v, history[v]))
        self.actors[i], self.next_submit[i] = actor, first

    def _submit(self, step: int) -> None:
        """Keep every worker's batches that are (or soon will be) admissible submitted."""
        horizon = min(self.cfg.steps, step + 1 + self.cfg.max_policy_lag + self.n)
        for i, actor in enumerate(self.actors):
            while self.next_submit[i] < horizon:
                b = self.next_submit[i]
                if b in self.ready:
                    self.next_submit[i] += self.n
                    continue
                self.pending[b] = actor.sample.options(concurrency_group="rollout").remote(b)
                self.next_submit[i] += self.n

    def publish(self, version: int, state: State) -> None:
        ref = self._ref(version, state)
        for actor in self.actors:
            actor.receive.options(concurrency_group="weights").remote(version, ref)
        needed = self.needed_versions()  # what a restarted actor may still need
        for v in [v for v in self.refs if v != version and (needed is None or v not in needed)]:
            del self.refs[v]

    def collect(self) -> None:
        """Finished batches stay in Ray's object store until asked for: nothing to do."""

    def needed_versions(self) -> range | None:
        """The weight versions a restarted actor could need (None: only the newest). Actors take
        their batches in order, so that is every version from the oldest pending batch's on."""
        first = min(self.pending, default=min(self.next_submit))
        if not self.cfg.deterministic or first >= self.cfg.steps:
            return None
        return range(max(self.floor, first - self.cfg.max_policy_lag), sys.maxsize)

    def ready_batches(self) -> list[RolloutBatch]:
        """Batches in hand and not consumed (the restored ones; Ray keeps the others)."""
        return [self.ready[b] for b in sorted(self.ready)]

    def next_batch(self, step: int) -> RolloutBatch:
        self._submit(step)  # keep the actors busy while restored batches are consumed
        if step in self.ready:
            return self.ready.pop(step)
        timeout = self.cfg.rollout.heartbeat_timeout_s
        while True:
            try:
                ready, _ = self.ray.wait([self.pending[step]], timeout=1.0)
                if not ready:
                    if timeout and self._silence(step % self.n) > timeout:
                        self.ray.kill(self.actors[step % self.n])  # hung: its sample call now fails
                    continue
                batch = self.ray.get(self.pending[step])
                del self.pending[step]
                return batch
            except self.ray.exceptions.RayTaskError as exc:  # the worker raised: a restart would repeat it
                cause = getattr(exc, "cause", None)
                if isinstance(cause, ParityError):
                    raise ParityError(f"rollout worker: {cause}") from None
                raise
            except self.ray.exceptions.RayActorError as exc:
                i = step % self.n
                if self.restarts >= self.max_restarts:
                    raise ParityError(f"rollout actor {i} died after {self.restarts} restarts; giving up at "
                                      f"batch {step} ({str(exc).splitlines()[0]})") from None
                self.restarts += 1
                log.warning("rollout actor %d died; restarting it from batch %d", i, step)
                for b in [b for b in self.pending if b % self.n == i]:
                    del self.pending[b]
                self._start_actor(i, step)
                self._submit(step)

    def _silence(self, i: int) -> float:
        """Seconds actor i has shown no sign of life (infinite when it does not even answer)."""
        try:
            return self.ray.get(self.actors[i].silence.remote(), timeout=30)
        except (self.ray.exceptions.GetTimeoutError, self.ray.exceptions.RayActorError):
            return float("inf")

    def close(self) -> None:
        for actor in self.actors:
            if actor is not None:
                try:
                    actor.stop.options(concurrency_group="weights").remote()
                    self.ray.kill(actor)
                except Exception:  # noqa: BLE001 - an actor already gone is fine
                    pass
        self.actors = [None] * self.n
        self.pending.clear()
        self.refs.clear()
        if self._head is not None:
            self.ray.shutdown()
            self._head.terminate()  # `ray start --block` stops every process it started
            try:
                self._head.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._head.kill()
            self._head = None
