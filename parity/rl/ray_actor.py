"""The body of one Ray rollout actor: model, engine, environment (and its sandbox) around one
`RolloutWorker`, in one process. `RayRollout` (ray_backend.py) makes it a Ray actor class with two
concurrency groups of one thread each: "weights" (`receive`, `stop`) and "rollout" (`sample`, run
in submission order), so weights arrive while a batch is being sampled."""

from __future__ import annotations

import os
import queue
import threading
import time

import torch

from ..config import TrainConfig
from ..model import ModelConfig
from .build import build_env, model_skeleton
from .faults import actor_init_fault, worker_faults
from .rollout_worker import RolloutWorker, State
from .trajectory import RolloutBatch


class RolloutActor:
    """The body of a rollout-worker actor (made a Ray actor class by `RayRollout`)."""

    def __init__(self, cfg: TrainConfig, model_config: ModelConfig, state: State, version: int,
                 threads: int, floor: int = 0, todo: list[int] | None = None):
        torch.set_num_threads(threads)
        actor_init_fault(todo[0] if todo else -1)  # (fault-injection tests only)
        model = model_skeleton(cfg, model_config)
        model.load_state_dict(state)
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._last_beat = time.monotonic()
        self.worker = RolloutWorker(cfg, model, build_env(cfg, model_config.vocab_size), version, self._poll,
                                    self._beat)
        self.worker.floor = floor
        if cfg.deterministic and todo is not None:  # its plan: held versions only its batches need
            self.worker.todo = list(todo)

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
        if self.worker.todo is not None and batch_index in self.worker.todo:
            self.worker.todo.remove(batch_index)
        worker_faults(batch_index)  # (fault-injection tests only)
        return batch

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()
