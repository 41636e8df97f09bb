"""The local backend's worker process: the body each rollout worker runs, and how it is started.

Workers on the CPU are forked from a fork server that imported torch and parity once
(`worker_context`), so a worker starts in a tenth of a second rather than the seconds a fresh
interpreter takes: a run's second worker, a restarted one, the next run in the same process (a GPU
run's workers are spawned). Each starts from its learner's environment as it is at the start
(`worker_main`'s `environ`), as a spawned process would.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import shutil
import signal
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ..config import TrainConfig
from ..errors import ParityError
from ..model import ModelConfig
from ..ops import native
from .build import build_env, model_skeleton
from .faults import worker_faults
from .rollout_worker import RolloutWorker, State
from .trajectory import RolloutBatch


def worker_context(device: str = "cpu"):
    """The multiprocessing context rollout workers start in: a fork server that imports this module
    (torch, parity) once and forks each worker from it, where the platform has one; spawn elsewhere
    and for workers on a GPU (a process that asked whether CUDA is there may have initialised its
    driver, which a forked child cannot use). Never a plain fork of the learner: its threads (OpenMP,
    the queues' feeders) do not survive one."""
    if device != "cpu" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # (no effect once this process's fork server runs)
    return ctx


@contextlib.contextmanager
def main_without_a_file():
    """While a worker starts: a main module whose file is no file is left out of its preparation.

    A worker imports its parent's main module from that file first (multiprocessing's rule for
    spawned and fork-server children); a script read from stdin (`python - < train.py`) names
    '<stdin>', so every worker died on FileNotFoundError and the run gave up after 3 restarts. Such
    a main is skipped as `python -c`'s is (what it defines cannot reach a worker either way)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or not isinstance(path, str) or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def worker_main(cfg: TrainConfig, model_config: ModelConfig, start: bytes, version: int, todo: list[int],
                floor: int, weights_q, traj_q, stop, heartbeat, threads: int, spool: str,
                environ: dict[str, str], native_on: bool) -> None:
    """Rollout worker process body: the batches in `todo` (first, first + N, ... of N workers,
    less those already received), in order unless held weights ask otherwise. `start` is the
    pickled weights it starts from, `environ` its learner's environment when it was started (the
    fork server's is that of the first worker's start: PARITY_FAULTS, say, may have changed since)
    and `native_on` whether its learner uses the native kernels (read from PARITY_NATIVE when the
    server imported them, or switched since: `native.set_enabled`)."""
    os.environ.clear()
    os.environ.update(environ)
    native.set_enabled(native_on)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    traj_q.cancel_join_thread()  # once told to stop, never block this process's exit on the queue
    parent = mp.parent_process()

    def orphaned() -> bool:
        if parent is not None and not parent.is_alive():
            stop.set()  # the controller is gone, and the spool it would have removed is ours to
            shutil.rmtree(spool, ignore_errors=True)
        return stop.is_set()

    try:
        torch.set_num_threads(threads)
        state: State = ForkingPickler.loads(start)
        model = model_skeleton(cfg, model_config)
        model.load_state_dict(state)
        env = build_env(cfg, model_config.vocab_size)

        def poll(block: bool) -> list[tuple[int, State]]:
            got: list[tuple[int, State]] = []
            if orphaned():
                return got
            try:
                while True:
                    message = weights_q.get(block=block, timeout=0.5 if block else None)
                    if message is None:  # (its learner taking back what was left: it is being replaced)
                        return got
                    got.append(message)
                    block = False
            except queue_mod.Empty:
                pass
            except (OSError, EOFError):  # weights shared by a controller that died mid-transfer
                if orphaned():
                    return []
                raise
            return got

        def beat() -> None:
            heartbeat.value = time.monotonic()

        kept = state if cfg.deterministic else None  # kept while a later batch may need it again
        worker = RolloutWorker(cfg, model, env, version, poll, beat, state=kept)
        worker.todo = todo = list(todo)
        worker.floor = floor
        while todo:
            b = worker.next_to_sample(todo)
            wait_s = worker.wait_for(b, orphaned)
            if wait_s is None:
                return
            batch = worker.sample(b, wait_s)
            try:
                send(traj_q, spool, batch, corrupt=worker_faults(b))
            except OSError:
                if orphaned():  # the spool went with the controller
                    return
                raise
            todo.remove(b)
    except ParityError as exc:  # a problem that a restart would only repeat
        if os.environ.get("PARITY_DEBUG", "0") not in ("", "0"):  # (your task's code: where it raised)
            traceback.print_exc()
        traj_q.put(("error", str(exc)))
    except Exception as exc:  # unexpected: one line (its exit status tells the controller)
        orphaned()  # (removes the spool if the controller is gone)
        if os.environ.get("PARITY_DEBUG", "0") not in ("", "0"):
            raise
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        sys.stderr.write(f"parity: rollout worker failed: {type(exc).__name__}: {text} "
                         "(PARITY_DEBUG=1 shows the traceback)\n")
        raise SystemExit(1) from None  # (multiprocessing printed the traceback, once per restart)
    except BaseException:
        orphaned()
        raise
    while not orphaned():  # finished (or failed): stay until the controller has read everything
        stop.wait(0.5)


def send(traj_q, spool: str, batch: RolloutBatch, corrupt: bool = False) -> None:
    """Hand `batch` to the learner: a file in the spool (written, then renamed), its path queued."""
    path = Path(spool) / f"batch-{batch.index}.pkl"
    tmp = path.with_suffix(".tmp")
    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    tmp.write_bytes(data[: len(data) // 2] if corrupt else data)  # (corrupt: a fault-injection test)
    tmp.rename(path)
    traj_q.put(("batch", str(path)))
