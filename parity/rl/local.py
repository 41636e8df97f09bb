"""The local rollout backend: `rollout.workers` RolloutWorkers in child processes beside the learner.

Worker i samples batches i, i + N, i + 2N, ... (N workers). Weights go learner -> each worker
through its own queue, one message per published version (torch shares the tensors' memory, so
nothing is copied per worker); batches go worker -> learner through files in a spool directory
(atomic rename), the worker's own queue carrying only their paths, so a worker that dies mid-send
leaves a partial file nobody reads, never a torn message or a lock held by a dead process. A dead
worker is restarted from the first batch of its that the learner has not received: what it held is
sampled again, nothing received is repeated, nothing pending is lost. A worker that has sent its
last batch stays alive until told to stop, so its queued messages are always delivered.

Batches that arrive ahead of the step that consumes them are taken in after every step
(`collect`) and held as ready; `needed_versions` are then the versions a restarted worker could
still ask for, so the learner keeps only those (not lag-many), and a checkpoint stores the ready
batches (`ready_batches`) rather than the weights that sampled them. In deterministic mode a worker
holding more than `rollout.max_held_versions` unused versions samples the batch of the newest out
of turn (batches are received in any order), so the versions needed stay a handful at any lag.

The controller sees `start`, `publish`, `next_batch`, `collect`, `needed_versions`, `ready_batches`
and `close`; the Ray backend (`rl/ray_backend.py`) provides the same.

Each worker process runs `local_worker.worker_main`, forked from a fork server that has imported
torch and parity once (`local_worker.worker_context`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.queues
import os
import pickle
import queue as queue_mod
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..errors import ParityError, WaitInterrupted
from ..model import ModelConfig
from ..ops import native
from ..procs import gone as process_gone
from .local_worker import main_without_a_file, worker_context, worker_main
from .rollout_worker import (
    RestartBudget,
    State,
    first_batch,
    restored,
    resume_floor,
    start_version,
)
from .shm import shared_memory_errors
from .trajectory import RolloutBatch

log = logging.getLogger(__name__)

STARTUP_GRACE_S = 120.0
"""A starting worker (imports, model, engine) is taken for hung only after this long without its
first beat, or heartbeat_timeout_s if longer."""

_CORES = max(1, torch.get_num_threads())  # read once, before any split changes it


def split_threads(cfg: TrainConfig) -> tuple[int, int]:
    """(threads per rollout worker, learner threads): with lag 0 the two sides alternate and both
    get every core; otherwise the cores are shared out, the rollout half among the workers."""
    if cfg.max_policy_lag == 0 or _CORES == 1:
        return max(1, _CORES // cfg.rollout.workers), _CORES
    return max(1, _CORES // 2 // cfg.rollout.workers), max(1, _CORES - _CORES // 2)



def remove_stale_spools(root: Path) -> list[Path]:
    """Remove the batch spools in `root` whose learner (the pid in the name) is gone: the second
    line of defence behind the orphaned worker's own cleanup (memory in /dev/shm). Returns them."""
    stale = []
    for path in root.glob("parity-batches-*-*"):
        if process_gone(path.name.split("-")[2]):
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return stale


# --------------------------------------------------------------------------- the learner's side
@dataclass
class _Slot:
    """One worker process and its queues."""

    index: int
    process: Any = None
    todo: list[int] = field(default_factory=list)  # its batches not received yet, in order
    weights_q: Any = None
    traj_q: Any = None
    stop: Any = None
    heartbeat: Any = None  # shared double: the worker's last sign of life (time.monotonic; 0: none yet)
    started: float = 0.0  # when the process was started (time.monotonic)
    error: str | None = None  # its last word, met by `collect`: raised when its next batch is asked for


class _WeightsQueue(multiprocessing.queues.Queue):
    """A queue whose feeder thread remembers a message it could not send (pickling the weights
    failed: /dev/shm full, too many open files). A plain queue printed a traceback and dropped
    it, and a worker waiting for that version waited for good, beating all the while."""

    def __init__(self, ctx):
        with shared_memory_errors():  # (its semaphores live in /dev/shm; a worker's first queue)
            super().__init__(ctx=ctx)
        self.dropped: BaseException | None = None

    def _on_queue_feeder_error(self, e, obj):  # called on the feeder thread (bound: not static)
        self.dropped = e

    def take_back(self, wait_s: float = 10.0) -> None:
        """Once its worker is gone, read back the versions it never took: each tensor's memory is
        held for the taker until taken (a run's last versions, never needed, kept two copies of the
        weights per run alive in a process that ran many, a study). A marker put last says all
        are read (at most `wait_s`)."""
        try:
            self.put(None)
        except ValueError:  # closed already (a restart that closed it, then failed to start)
            return
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(Exception):  # (a torn message: nothing more to take back)
            # (past the queue's read lock: a worker killed while it waited for weights holds it for good)
            while self._reader.poll(max(0.0, deadline - time.monotonic())):
                if ForkingPickler.loads(self._reader.recv_bytes()) is None:
                    return


class LocalRollout:
    """Runs `rollout.workers` rollout workers as child processes (`worker_context`) and hands their
    batches over in order."""


    def __init__(self, cfg: TrainConfig, model_config: ModelConfig,
                 versions: Callable[[], dict[int, State]]):
        """`versions()` returns the learner's kept weight versions (the newest is current)."""
        self.cfg = cfg
        self.model_config = model_config
        self.versions = versions
        self.ctx = worker_context(cfg.model.device)
        self.budget = RestartBudget()  # worker restarts: 3 within any hour
        self.slots = [_Slot(i) for i in range(cfg.rollout.workers)]
        self.spool: str | None = None
        self.ready: dict[int, RolloutBatch] = {}  # received ahead of the step that consumes them
        self.floor = 0  # the oldest version batches may ask for (see RolloutWorker.floor)
        self.should_stop: Callable[[], bool] = lambda: False  # the controller's: a wait gives way

    @property
    def pids(self) -> list[int | None]:
        return [s.process.pid if s.process is not None else None for s in self.slots]

    @property
    def restarts(self) -> int:
        """Worker restarts so far in this run."""
        return self.budget.total

    @property
    def pid(self) -> int | None:
        """The first worker's process id."""
        return self.pids[0]

    def start(self, start_batch: int, ready: list[RolloutBatch] | None = None) -> None:
        """Start the workers to sample batches start_batch, start_batch + 1, ...; `ready` batches
        (from a checkpoint) are served as they are and not sampled again."""
        if self.spool is None:
            shm = Path("/dev/shm")
            root = shm if shm.is_dir() else Path(tempfile.gettempdir())
            remove_stale_spools(root)
            # named by this process's pid: whose it is, if one is ever left behind
            self.spool = tempfile.mkdtemp(prefix=f"parity-batches-{os.getpid()}-", dir=root)
        self.floor = resume_floor(self.cfg, self.versions(), start_batch, ready)
        self.ready = restored(self.cfg, ready, start_batch, self.floor)
        n = len(self.slots)
        for slot in self.slots:
            first = first_batch(slot.index, n, start_batch)
            self._start(slot, [b for b in range(first, self.cfg.steps, n) if b not in self.ready])

    def _start(self, slot: _Slot, todo: list[int]) -> None:
        """(Re)start `slot`'s worker on the batches `todo`."""
        slot.todo, slot.error = list(todo), None
        if not todo:
            slot.process = None
            return
        if slot.stop is not None:  # (a worker replaced while alive, its fork server gone: it stops)
            slot.stop.set()
        self._close_queues(slot)
        slot.weights_q, slot.traj_q, slot.stop = _WeightsQueue(self.ctx), self.ctx.Queue(), self.ctx.Event()
        slot.heartbeat = self.ctx.Value("d", 0.0, lock=False)
        slot.started = time.monotonic()
        history = self.versions()
        version = start_version(self.cfg, history, todo[0])
        if version not in history:
            raise ParityError(f"batch {todo[0]} needs weight version {version}, which is not kept (a "
                              "checkpoint resumed with another max_policy_lag?); resume with the run's lag")
        rollout_threads, learner_threads = split_threads(self.cfg)
        torch.set_num_threads(learner_threads)
        with shared_memory_errors():  # (the weights it starts from go through /dev/shm)
            # pickled here, their tensors' memory handed over on request like a queued version's: as
            # the process's arguments each tensor was a file descriptor sent with the fork request,
            # which a fork server caps at 252 (a model of 28 layers has more tensors)
            start = bytes(ForkingPickler.dumps(history[version]))
        slot.process = self.ctx.Process(target=worker_main, daemon=True, args=(
            self.cfg, self.model_config, start, version, slot.todo, self.floor, slot.weights_q,
            slot.traj_q, slot.stop, slot.heartbeat, rollout_threads, self.spool, dict(os.environ),
            native.set_enabled(None)))
        try:
            with shared_memory_errors(), main_without_a_file():  # (/dev/shm: semaphores, the server socket)
                slot.process.start()
        except BaseException:
            with contextlib.suppress(Exception):  # the handles the worker never took, released
                ForkingPickler.loads(start)
            raise
        for v in sorted(history):
            if v > version:
                slot.weights_q.put((v, history[v]))

    def publish(self, version: int, state: State) -> None:
        """A new version for every worker (each loads it when admission or an in-flight update asks)."""
        for slot in self.slots:
            if slot.todo:
                slot.weights_q.put((version, state))

    def next_batch(self, step: int) -> RolloutBatch:
        """Batch `step`, from the worker that owns it; a dead worker is restarted from the first
        batch of its not received."""
        slot = self.slots[step % len(self.slots)]
        while step not in self.ready:
            if step not in slot.todo or not self._receive(slot, block=True):
                raise ParityError(f"batch {step} was asked for twice or past the run's end")
        return self.ready.pop(step)

    def collect(self) -> None:
        """Take in every batch the workers have finished (never waits). A worker's error met here
        is kept for the batch it failed: the step just trained is recorded whole, and the run
        stops where the learner asks for that batch (as on Ray)."""
        for slot in self.slots:
            while self._receive(slot, block=False):
                pass

    def needed_versions(self) -> set[int] | None:
        """The weight versions a worker restarted now could need (None: only the newest)."""
        if not self.cfg.deterministic:
            return None  # a restarted worker starts from the newest version
        lag = self.cfg.max_policy_lag
        return {max(self.floor, b - lag) for slot in self.slots for b in slot.todo}

    def ready_batches(self) -> list[RolloutBatch]:
        """The batches received and not consumed yet, in order (what a checkpoint keeps)."""
        return [self.ready[b] for b in sorted(self.ready)]

    def _receive(self, slot: _Slot, block: bool) -> bool:
        """Take one message from `slot` into `ready` (restarting a dead or hung worker); False when
        nothing was there (block=False) or the worker has no batch left to send."""
        if not slot.todo:
            return False
        if slot.error is not None:
            if block:
                raise ParityError(f"rollout worker: {slot.error}")
            return False
        timeout = self.cfg.rollout.heartbeat_timeout_s
        while True:
            try:
                kind, value = slot.traj_q.get(timeout=1.0) if block else slot.traj_q.get_nowait()
            except queue_mod.Empty:
                if not block:
                    return False
                if self.should_stop():  # Ctrl-C / SIGTERM: save at this step boundary, not after the batch
                    raise WaitInterrupted from None
                dropped = slot.weights_q.dropped
                if dropped is not None:  # it waits for a version it will never get
                    self._restart(slot, f"missed a weight version (sending it failed: {dropped})")
                    continue
                beat = slot.heartbeat.value
                silent = time.monotonic() - (beat or slot.started)
                limit = timeout if beat else max(timeout, STARTUP_GRACE_S)  # starting: imports, model
                if slot.process.is_alive() and not (timeout and silent > limit):
                    continue
                if slot.process.is_alive():  # alive but silent: hung
                    why = f"showed no sign of life for {silent:.0f} s"
                    slot.process.kill()
                    slot.process.join(10)
                else:
                    why = f"died (exit code {slot.process.exitcode})"
                self._restart(slot, why)
                continue
            if kind == "error":
                slot.error = value
                return self._receive(slot, block)
            batch = self._read(Path(value), slot.todo)
            if batch is None:  # unreadable: sample it again
                self._restart(slot, f"sent a corrupt batch file ({value})")
                continue
            self.ready[batch.index] = batch
            slot.todo.remove(batch.index)
            return True

    def _restart(self, slot: _Slot, why: str) -> None:
        step = slot.todo[0]
        if not self.budget.spend():
            raise ParityError(f"rollout worker {slot.index} {why} after {len(self.budget.times)} restarts "
                              f"within {self.budget.window_s / 60:g} min; giving up at batch {step}")
        log.warning("rollout worker %d %s; restarting it from batch %d", slot.index, why, step)
        if slot.process.is_alive():
            slot.process.kill()
            slot.process.join(10)
        elif slot.process.exitcode == 255 and not process_gone(slot.process.pid):  # its fork server died,
            with contextlib.suppress(OSError):  # the one that reported its status: it may live on
                os.kill(slot.process.pid, signal.SIGKILL)
        self._start(slot, slot.todo)

    @staticmethod
    def _read(path: Path, expected: list[int]) -> RolloutBatch | None:
        """The batch in `path`, or None when the file is not a whole batch of `expected`."""
        try:
            batch = pickle.loads(path.read_bytes())
        except Exception:  # noqa: BLE001 - any unpickling failure means a torn or corrupt file
            batch = None
        path.unlink(missing_ok=True)
        ok = isinstance(batch, RolloutBatch) and batch.index in expected
        return batch if ok else None

    @staticmethod
    def _close_queues(slot: _Slot) -> None:
        """Close `slot`'s queues, its worker gone (or going: SIGKILLed, its stop set)."""
        if slot.weights_q is not None:
            slot.weights_q.take_back()
        for q in (slot.weights_q, slot.traj_q):
            if q is not None:
                q.cancel_join_thread()  # unread weight messages must not block our exit
                q.close()

    def close(self) -> None:
        """Stop the workers and remove the spool directory."""
        started = [s for s in self.slots if s.process is not None and s.process.pid is not None]
        for slot in self.slots:
            if slot.stop is not None:
                slot.stop.set()
        for slot in started:
            slot.process.join(timeout=10)
            if slot.process.is_alive():
                slot.process.terminate()
        for slot in self.slots:
            self._close_queues(slot)
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)
