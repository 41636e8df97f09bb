"""The Ray rollout backend: `rollout.workers` RolloutWorker actors on a Ray cluster.

- Each actor (`RolloutActor`, ray_actor.py) is one process holding model + engine + environment (and its
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
  unconsumed batches are submitted again; nothing consumed is repeated, nothing is lost. So is
  one whose finished batch was lost with its node (a finished batch lives in the store of the
  node that made it until the learner takes it in).
- With `ray.address` unset the run starts a Ray head on this machine (`ray start --head
  --block`, with enough logical CPUs for the workers) whose parent-death signal is set, so it
  takes every Ray process down with it even when the learner is killed; with an address the run
  joins that cluster, and Ray ends the run's actors when their owner, the learner, dies.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from ..config import TrainConfig
from ..errors import ConfigError, ParityError, WaitInterrupted
from ..model import ModelConfig
from .local import STARTUP_GRACE_S, split_threads
from .ray_actor import RolloutActor
from .ray_cluster import _private_head_auth, actor_gpus, check_reachable, require_ray, start_local_head
from .rollout_worker import (
    RestartBudget,
    State,
    first_batch,
    restored,
    resume_floor,
    start_version,
)
from .trajectory import RolloutBatch

log = logging.getLogger(__name__)

_GROUPS = {"weights": 1, "rollout": 1}


def _init_error(exc) -> str:
    """The last line of a Ray actor's start-up error (the exception raised in its constructor)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(getattr(exc, "error_msg", "") or exc))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b.*: ", ln)]
    line = (raised or lines or [type(exc).__name__])[-1]
    return line.removeprefix("parity.errors.")


class RayRollout:
    """Rollout on Ray actors, with the local backend's interface: start, publish, next_batch, close."""

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
        self.ready: dict[int, RolloutBatch] = {}  # in hand: restored from a checkpoint, or collected
        self.floor = 0  # the oldest version batches may ask for (see RolloutWorker.floor)
        self.refs: dict[int, object] = {}  # version -> ObjectRef of its weights
        self.budget = RestartBudget()  # actor restarts: 3 within any hour
        self.started_at = [0.0] * self.n  # per actor: when it was created (time.monotonic)
        self.killed_hung: set[int] = set()  # actors killed for silence (reported as hung)
        self.should_stop: Callable[[], bool] = lambda: False  # the controller's: a wait gives way
        self.unplaced_since: dict[int, float] = {}  # actor -> when it was first seen with no node
        self.warned_unplaced: set[int] = set()  # actors said to be waiting for a node
        self.node_refs: list = [None] * self.n  # per actor: ObjectRef of the id of its Ray node
        self.node_ids: list[str | None] = [None] * self.n  # ...and the id, once it answered
        self.charged: dict[str, float] = {}  # node -> when one of its actors' restarts was charged
        self.gpus = 0.0  # GPUs each actor reserves
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
                hint = "" if cfg.ray.address in (None, "auto", "local") else \
                    " (is it the head's GCS port, 6379 by default, or its ray:// client port?)"
                raise ParityError(f"cannot start or join Ray at {where}: {reason}{hint}") from None
        total = ray.cluster_resources().get("CPU", 0)
        if total < needed:
            raise ConfigError(f"the Ray cluster has {total:g} CPUs; rollout.workers={self.n} x "
                              f"ray.cpus_per_worker={cfg.ray.cpus_per_worker:g} need {needed}")
        # actors start from the cluster's environment: pass on the fault-injection settings, if any
        faults = {k: os.environ[k] for k in ("PARITY_FAULTS", "PARITY_FAULT_STATE") if k in os.environ}
        options = {"runtime_env": {"env_vars": faults}} if faults else {}
        self.gpus = actor_gpus(cfg, self.n, ray.cluster_resources().get("GPU", 0))
        if self.gpus:
            options["num_gpus"] = self.gpus
        self._actor_class = ray.remote(num_cpus=cfg.ray.cpus_per_worker, concurrency_groups=_GROUPS,
                                       max_restarts=0, **options)(RolloutActor)

    def _ref(self, version: int, state: State):
        """The object-store reference of a version's weights: one put per version."""
        if version not in self.refs:
            self.refs[version] = self.ray.put(state)
        return self.refs[version]

    @property
    def restarts(self) -> int:
        """Actor restarts so far in this run."""
        return self.budget.total

    @property
    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    # ------------------------------------------------------------------ the backend interface
    def start(self, start_batch: int, ready: list[RolloutBatch] | None = None) -> None:
        """Start the actors on batches start_batch, ...; `ready` batches (from a checkpoint) are
        served as they are."""
        self.floor = resume_floor(self.cfg, self.versions(), start_batch, ready)
        self.ready = restored(self.cfg, ready, start_batch, self.floor)
        self._connect()
        torch.set_num_threads(split_threads(self.cfg)[1])
        for i in range(self.n):
            self._start_actor(i, start_batch)
        self._submit(start_batch)
        waiting = dict(enumerate(self.node_refs))  # each actor up, or an error of the run's
        limit = max(self.cfg.rollout.heartbeat_timeout_s, STARTUP_GRACE_S)
        while waiting:
            done, _ = self.ray.wait(list(waiting.values()), num_returns=1, timeout=1.0)
            for i in [i for i, ref in waiting.items() if ref in done]:
                del waiting[i]
                try:
                    self._node_id(i, block=True)
                except self.ray.exceptions.RayActorError as exc:
                    what = "could not start" if getattr(exc, "actor_init_failed", False) else "died starting"
                    raise ParityError(f"rollout actor {i} {what}: {_init_error(exc)}") from None
            for i in waiting:  # one with no node to run on, or one whose start-up never ends
                if not self._unplaced(i) and time.monotonic() - self.started_at[i] > limit:
                    raise ParityError(f"rollout actor {i} did not finish starting in {limit:g} s")
        nodes = set(self.node_ids)
        log.info("%d rollout actor(s) on %d Ray node(s) (%g CPU each)", self.n, len(nodes),
                 self.cfg.ray.cpus_per_worker)

    def _start_actor(self, i: int, from_batch: int) -> None:
        history = self.versions()
        first = first_batch(i, self.n, from_batch)
        while first in self.ready:  # restored from a checkpoint: not sampled again
            first += self.n
        todo = [b for b in range(first, self.cfg.steps, self.n) if b not in self.ready]
        version = start_version(self.cfg, history, first) if todo else max(history)  # (none left: idle)
        need = max(self.floor, first - self.cfg.max_policy_lag)
        if todo and self.cfg.deterministic and need <= max(history) and need != version:
            raise ParityError(f"batch {first} needs weight version {need}, which was not kept (kept: "
                              f"{sorted(history)})")  # a bug: it would wait for it forever
        if version not in history:
            raise ParityError(f"batch {first} needs weight version {version}, which is not kept (a "
                              "checkpoint resumed with another max_policy_lag?); resume with the run's lag")
        threads = max(1, int(self.cfg.ray.cpus_per_worker))
        actor = self._actor_class.remote(self.cfg, self.model_config, self._ref(version, history[version]),
                                         version, threads, self.floor, todo)
        for v in sorted(history):
            if v > version:
                actor.receive.options(concurrency_group="weights").remote(v, self._ref(v, history[v]))
        self.actors[i], self.next_submit[i] = actor, first
        self.node_refs[i], self.node_ids[i] = actor.node.remote(), None
        self.unplaced_since.pop(i, None)
        self.warned_unplaced.discard(i)
        self.started_at[i] = time.monotonic()

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
        """Take in the batches Ray has finished: they are in hand (and in a checkpoint) and their
        weights are no longer needed. A task that failed (its actor died) is also 'finished' to
        Ray: it stays pending, for `next_batch` to restart the actor and sample it again."""
        if not self.pending:
            return
        refs = list(self.pending.values())
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(done)
        for b, ref in [(b, r) for b, r in self.pending.items() if r in done]:
            try:
                batch = self.ray.get(ref)
            except self.ray.exceptions.RayError:  # next_batch deals with it
                continue
            if batch is not None:  # (None: the actor was stopped)
                self.ready[b] = batch
                del self.pending[b]

    def needed_versions(self) -> set[int] | None:
        """The weight versions a restarted actor could need (None: only the newest): those of the
        submitted batches not collected yet, and every version from the first unsubmitted batch's
        on (the local backend's rule)."""
        if not self.cfg.deterministic:
            return None
        lag, floor = self.cfg.max_policy_lag, self.floor
        needed = {max(floor, b - lag) for b in self.pending}
        unsubmitted = min(self.next_submit)
        if unsubmitted < self.cfg.steps:
            needed.update(range(max(floor, unsubmitted - lag), max(self.versions()) + 1))
        return needed

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
                if not ready and self.should_stop():  # Ctrl-C / SIGTERM: save at this step boundary
                    raise WaitInterrupted
                if not ready:
                    if self._unplaced(step % self.n):
                        continue
                    if timeout and self._hung(step % self.n, timeout):
                        self.killed_hung.add(step % self.n)
                        self.ray.kill(self.actors[step % self.n])  # its sample call now fails
                    continue
                batch = self.ray.get(self.pending[step])
                del self.pending[step]
                return batch
            except self.ray.exceptions.RayTaskError as exc:  # the worker raised: a restart would repeat it
                cause = getattr(exc, "cause", None)
                if isinstance(cause, ParityError):
                    raise ParityError(f"rollout worker: {cause}") from None
                raise
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.ObjectLostError) as exc:
                # the actor died, or its node did and took a batch it had finished with it (its
                # only copy was in that node's store): a new actor samples from this batch on
                i = step % self.n
                node, dead = self._node_id(i), self._dead_node(i)
                lost = isinstance(exc, self.ray.exceptions.ObjectLostError)
                why = f"was hung (no sign of life for {timeout:g} s)" if i in self.killed_hung else \
                    f"lost batch {step} ({type(exc).__name__})" if lost else \
                    f"could not start ({_init_error(exc)})" if getattr(exc, "actor_init_failed", False) \
                    else "died"
                if dead:
                    why += f" with its node {node[:8]}"
                self.killed_hung.discard(i)
                try:
                    self.ray.kill(self.actors[i])  # (when only the batch was lost, the actor lives)
                except Exception:  # noqa: BLE001 - an actor already gone is fine
                    pass
                window = self.budget.window_s
                if dead and time.monotonic() - self.charged.get(node, -window) < window:
                    self.budget.spend(free=True)  # one lost node, one restart, however many actors
                elif not self.budget.spend():
                    raise ParityError(f"rollout actor {i} {why} after {len(self.budget.times)} restarts "
                                      f"within {window / 60:g} min; giving up at batch {step} "
                                      f"({str(exc).splitlines()[0]})") from None
                elif node is not None:
                    self.charged[node] = time.monotonic()
                log.warning("rollout actor %d %s; restarting it from batch %d", i, why, step)
                for b in [b for b in self.pending if b % self.n == i]:
                    del self.pending[b]
                self._start_actor(i, step)
                self._submit(step)

    def _node_id(self, i: int, block: bool = False) -> str | None:
        """The id of actor i's Ray node (None: it has not said yet). `block`: wait for the answer
        and raise the actor's error, if it died instead."""
        if self.node_ids[i] is None:
            try:
                self.node_ids[i] = self.ray.get(self.node_refs[i], timeout=None if block else 0)
            except self.ray.exceptions.RayError:
                if block:
                    raise
        return self.node_ids[i]

    def _dead_node(self, i: int) -> bool:
        """Whether Ray reports actor i's node dead."""
        node = self._node_id(i)
        try:
            return node is not None and any(n["NodeID"] == node and not n.get("Alive", True)
                                            for n in self.ray.nodes())
        except Exception:  # noqa: BLE001 - the cluster table out of reach: charge the restart
            return False

    def _unplaced(self, i: int) -> bool:
        """Whether actor i still waits for a node with room for it (Ray has given it no process:
        its replacement after a node was lost, on a cluster with no room left, say). Meanwhile its
        start-up grace does not run; a one-line error after `ray.placement_timeout_s`."""
        try:
            from ray._private import state  # (Ray's own actor table; without it, the heartbeat rules)
            info = state.actors(self.actors[i]._actor_id.hex())
        except Exception:  # noqa: BLE001 - a Ray without this table: judge by the heartbeat alone
            return False
        if info.get("State") not in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") or info.get("Pid"):
            self.unplaced_since.pop(i, None)
            return False
        now = time.monotonic()
        since = self.unplaced_since.setdefault(i, now)
        self.started_at[i] = now  # its start-up grace counts from when it has a process
        limit = self.cfg.ray.placement_timeout_s
        free = self.ray.available_resources()
        need = f"{self.cfg.ray.cpus_per_worker:g} CPU" + (f" and {self.gpus:g} GPU" if self.gpus else "")
        have = f"{free.get('CPU', 0.0):g} CPU" + (f" and {free.get('GPU', 0.0):g} GPU" if self.gpus else "")
        if now - since >= min(10.0, limit / 2) and i not in self.warned_unplaced:  # (a process takes
            self.warned_unplaced.add(i)                                     # a moment to start)
            log.warning("rollout actor %d waits for a Ray node with %s free (the cluster has %s free); "
                        "giving up after %g s", i, need, have, limit)
        if now - since > limit:
            raise ParityError(f"rollout actor {i} found no Ray node with {need} free in {limit:g} s "
                              f"(ray.placement_timeout_s; the cluster has {have} free): add a node, or "
                              "lower rollout.workers or ray.cpus_per_worker"
                              + (" or ray.gpus_per_worker" if self.gpus else ""))
        return True

    def _hung(self, i: int, timeout: float) -> bool:
        """Whether actor i has shown no sign of life for `timeout` seconds; one that does not
        answer yet while it starts (imports, weights, graph capture) gets the local backend's
        start-up grace first."""
        silence = self._silence(i)
        if silence == float("inf") and time.monotonic() - self.started_at[i] < max(timeout, STARTUP_GRACE_S):
            return False
        return silence > timeout

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
            try:  # and whatever of its session is left (the head leads it)
                os.killpg(self._head.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._head = None
