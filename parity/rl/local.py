"""The local rollout backend: one `RolloutWorker` in a child process beside the learner.

Weights go learner -> worker through a queue, one message per published version; batches go
worker -> learner through files in a spool directory (atomic rename), the queue carrying only
their paths, so a worker that dies mid-send leaves a partial file nobody reads, never a torn
message. A dead worker is restarted from the batch the learner waits for: what it held is
sampled again, nothing consumed is repeated, nothing pending is lost. A worker that has sent its
last batch stays alive until told to stop, so its queued messages are always delivered.

The controller sees only `start`, `publish`, `next_batch` and `close`; a distributed backend
(Ray actors) provides the same four.
"""

from __future__ import annotations

import logging
import pickle
import queue as queue_mod
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ..config import TrainConfig
from ..errors import ParityError
from ..model import ModelConfig
from .build import build_env, model_skeleton
from .rollout_worker import RolloutWorker, State
from .trajectory import RolloutBatch

log = logging.getLogger(__name__)

_CORES = max(1, torch.get_num_threads())  # read once, before any split changes it


def split_threads(cfg: TrainConfig) -> tuple[int, int]:
    """(rollout threads, learner threads): both get every core when they alternate (lag 0),
    the cores are shared out when they run at once."""
    if cfg.max_policy_lag == 0 or _CORES == 1:
        return _CORES, _CORES
    return max(1, _CORES // 2), max(1, _CORES - _CORES // 2)


# --------------------------------------------------------------------------- the child process
def _worker_main(cfg: TrainConfig, model_config: ModelConfig, state: State, version: int, start_batch: int,
                 weights_q, traj_q, stop, threads: int, spool: str) -> None:
    """Rollout worker process body."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    traj_q.cancel_join_thread()  # once told to stop, never block this process's exit on the queue
    parent = mp.parent_process()

    def orphaned() -> bool:
        if parent is not None and not parent.is_alive():
            stop.set()  # the controller is gone
        return stop.is_set()

    try:
        torch.set_num_threads(threads)
        model = model_skeleton(cfg, model_config)
        model.load_state_dict(state)
        env = build_env(cfg, model_config.vocab_size)

        def poll(block: bool) -> list[tuple[int, State]]:
            got: list[tuple[int, State]] = []
            if orphaned():
                return got
            try:
                while True:
                    got.append(weights_q.get(block=block, timeout=0.5 if block else None))
                    block = False
            except queue_mod.Empty:
                pass
            return got

        worker = RolloutWorker(cfg, model, env, version, poll)
        for b in range(start_batch, cfg.steps):
            wait_s = worker.wait_for(b, orphaned)
            if wait_s is None:
                return
            _send(traj_q, spool, worker.sample(b, wait_s))
    except ParityError as exc:  # a problem that a restart would only repeat
        traj_q.put(("error", str(exc)))
    while not orphaned():  # finished (or failed): stay until the controller has read everything
        stop.wait(0.5)


def _send(traj_q, spool: str, batch: RolloutBatch) -> None:
    path = Path(spool) / f"batch-{batch.index}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    tmp.rename(path)
    traj_q.put(("batch", str(path)))


# --------------------------------------------------------------------------- the learner's side
class LocalRollout:
    """Runs the rollout worker in a child process (spawned) and hands its batches over in order."""

    max_restarts = 3

    def __init__(self, cfg: TrainConfig, model_config: ModelConfig,
                 versions: Callable[[], dict[int, State]]):
        """`versions()` returns the learner's kept weight versions (the newest is current)."""
        self.cfg = cfg
        self.model_config = model_config
        self.versions = versions
        self.ctx = mp.get_context("spawn")
        self.restarts = 0
        self.process = None
        self.weights_q = self.traj_q = self.stop = None
        self.spool: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, start_batch: int) -> None:
        """(Re)start the worker to sample batches start_batch, start_batch + 1, ..."""
        self._close_queues()
        if self.spool is None:
            shm = Path("/dev/shm")
            self.spool = tempfile.mkdtemp(prefix="parity-batches-", dir=shm if shm.is_dir() else None)
        self.weights_q, self.traj_q, self.stop = self.ctx.Queue(), self.ctx.Queue(), self.ctx.Event()
        history = self.versions()
        version = max(history)
        if self.cfg.deterministic:  # the worker may need older versions than the newest
            version = max(0, start_batch - self.cfg.max_policy_lag)
        rollout_threads, learner_threads = split_threads(self.cfg)
        torch.set_num_threads(learner_threads)
        self.process = self.ctx.Process(target=_worker_main, daemon=True, args=(
            self.cfg, self.model_config, history[version], version, start_batch, self.weights_q,
            self.traj_q, self.stop, rollout_threads, self.spool))
        self.process.start()
        for v in sorted(history):
            if v > version:
                self.weights_q.put((v, history[v]))

    def publish(self, version: int, state: State) -> None:
        """A new version for the worker (it loads it when admission or an in-flight update asks)."""
        self.weights_q.put((version, state))

    def next_batch(self, step: int) -> RolloutBatch:
        """Batch `step`; a dead worker is restarted from that batch."""
        while True:
            try:
                kind, value = self.traj_q.get(timeout=1.0)
            except queue_mod.Empty:
                if self.process.is_alive():
                    continue
                if self.restarts >= self.max_restarts:
                    raise ParityError(f"the rollout worker died (exit code {self.process.exitcode}) "
                                      f"{self.restarts + 1} times; giving up at batch {step}") from None
                self.restarts += 1
                log.warning("rollout worker died (exit code %s); restarting it from batch %d",
                            self.process.exitcode, step)
                self.start(step)
                continue
            if kind == "error":
                raise ParityError(f"rollout worker: {value}")
            path = Path(value)
            batch = pickle.loads(path.read_bytes())
            path.unlink()
            return batch

    def _close_queues(self) -> None:
        for q in (self.weights_q, self.traj_q):
            if q is not None:
                q.cancel_join_thread()  # unread weight messages must not block our exit
                q.close()

    def close(self) -> None:
        """Stop the worker and remove the spool directory."""
        self._close_queues()
        if self.process is not None:
            self.stop.set()
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.terminate()
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)
