"""How the local backend starts its rollout workers: forked from one fork server per learner process,
each with its learner's environment and kernel switch as they are at that worker's start, the
weights it starts from sent whatever the number of tensors (a fork request carries at most 252 file
descriptors), and a fork server that dies under its workers replaced without a batch lost."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest

import parity
from parity.config import load_config
from parity.metrics.summary import deterministic_view
from parity.rl.controller import Controller

RUN = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=8", "learner.lr=0.003",
       "learner.micro_batch_size=4", "task.targets=[7, 8]", "max_policy_lag=1", "deterministic=true",
       "eval_every=0"]


def parent_of(pid: int) -> int | None:
    """`pid`'s parent, None once it is gone (a worker exited and reaped)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_watching_parents(run_dir: Path, *extra: str) -> tuple[Controller, list[dict], set[int]]:
    """A run of tiny, and the parent process of every worker seen at a step boundary."""
    controller = Controller(load_config(None, RUN + ['model.preset="tiny"', "steps=4", "rollout.workers=2",
                                                     f'run_dir="{run_dir}"', *extra]))
    parents: set[int] = set()

    def watch(step, metrics):
        parents.update(parent_of(p) for p in controller.rollout.pids if p is not None)

    metrics = controller.run(progress=watch)
    return controller, metrics, parents - {None}


def test_workers_fork_from_one_server_and_take_their_learner_s_environment(tmp_path, monkeypatch):
    """Two runs in this process: every worker of both is a child of the same process, which is not
    this one (the fork server). The second run's faults are set after that server started, and its
    worker still meets them: it took this process's environment at its start, not the server's."""
    _, first, parents = run_watching_parents(tmp_path / "first")
    (tmp_path / "fault-state").mkdir()
    monkeypatch.setenv("PARITY_FAULT_STATE", str(tmp_path / "fault-state"))
    monkeypatch.setenv("PARITY_FAULTS", "worker-exit@1")
    controller, second, more = run_watching_parents(tmp_path / "second")
    assert len(parents) == 1 and parents == more and os.getpid() not in parents
    assert controller.rollout.restarts == 1  # the fault fired in the worker
    assert deterministic_view(second) == deterministic_view(first)


def test_a_model_of_more_tensors_than_a_fork_request_carries_trains(tmp_path):
    """332 tensors (tiny at 30 layers). As the worker process's arguments each was a file descriptor
    sent with the fork request, and the fork server refused the request: "too many fds"."""
    model = parity.Model(dataclasses.replace(parity.ModelConfig.preset("tiny"), num_hidden_layers=30), seed=0)
    assert len(model.state_dict()) > 252
    model.save_pretrained(tmp_path / "model")
    metrics = Controller(load_config(None, RUN + [f'model.checkpoint="{tmp_path / "model"}"', "steps=2",
                                                  f'run_dir="{tmp_path / "run"}"'])).run()
    assert [m["step"] for m in metrics] == [0, 1] and metrics[-1]["mismatch/kernel_max_abs"] == 0.0


def test_a_gpu_run_s_workers_are_spawned_and_a_cpu_run_s_forked_from_the_server():
    """A fork server that asked whether CUDA is there may hold an initialised driver, which its forked
    children cannot use: workers on a GPU start as fresh interpreters."""
    from parity.rl.local_worker import worker_context

    assert worker_context("cuda").get_start_method() == "spawn"
    assert worker_context("cuda:1").get_start_method() == "spawn"
    assert worker_context("cpu").get_start_method() == "forkserver"


def test_a_worker_takes_its_learner_s_kernel_switch_at_its_start(tmp_path):
    """The native kernels switched off in this process between two runs (`native.set_enabled`): the
    second run's worker computes as the learner does. The fork server had imported the switch as
    PARITY_NATIVE was at its start, and its worker sampled on the native kernels while the learner
    scored on the pure-PyTorch ones: kernel mismatch 9.5e-07."""
    from parity.ops import native

    if native.library() is None:
        pytest.skip("no native kernels on this machine: both sides are the pure-PyTorch ones anyway")
    runs = []
    for name in ("native", "pure"):
        previous = native.set_enabled(name == "native")
        try:
            runs.append(Controller(load_config(None, RUN + ['model.preset="tiny"', "steps=2",
                                                            f'run_dir="{tmp_path / name}"'])).run())
        finally:
            native.set_enabled(previous)
    assert all(m["mismatch/kernel_max_abs"] == 0.0 for metrics in runs for m in metrics)
    assert [m["policy/entropy"] for m in runs[0]] != [m["policy/entropy"] for m in runs[1]]  # two kernels


def test_a_fork_server_killed_under_its_worker_is_replaced_and_the_worker_with_it(tmp_path, monkeypatch):
    """The fork server SIGKILLed while its worker holds batch 3: the worker's status came from that
    server, so it read as dead (exit 255) while it lived on. It is killed, a new server and worker
    sample batch 3 again, and the run ends as one never disturbed."""
    reference = Controller(load_config(None, RUN + ['model.preset="tiny"', "steps=5",
                                                    f'run_dir="{tmp_path / "reference"}"'])).run()
    (tmp_path / "fault-state").mkdir()
    monkeypatch.setenv("PARITY_FAULT_STATE", str(tmp_path / "fault-state"))
    monkeypatch.setenv("PARITY_FAULTS", f"worker-hold@3:{tmp_path / 'never'}")
    controller = Controller(load_config(None, RUN + ['model.preset="tiny"', "steps=5",
                                                     f'run_dir="{tmp_path / "run"}"']))
    old: list[int] = []

    def kill_the_server(step, metrics):
        if step == 1:
            old.append(controller.rollout.pid)
            os.kill(parent_of(old[0]), signal.SIGKILL)

    metrics = controller.run(progress=kill_the_server)
    assert controller.rollout.restarts == 1 and not alive(old[0])
    assert deterministic_view(metrics) == deterministic_view(reference)


def test_versions_no_worker_took_are_taken_back_when_a_run_ends(tmp_path):
    """A run's last published versions are never needed by its worker, and each tensor of each was
    held for the worker as an open file descriptor on shared memory until taken, for as long as the
    process lived (a study runs its whole grid in one): here 24 descriptors per run (one version of
    tiny); 24 MiB of /dev/shm per run of `small` (two versions). The run's end reads them back."""
    import gc

    def run(name: str) -> None:
        Controller(load_config(None, RUN + ['model.preset="tiny"', "steps=6", "max_policy_lag=2",
                                            f'run_dir="{tmp_path / name}"'])).run()
        gc.collect()

    run("warm")  # (the fork server, the resource sharer's thread)
    before = len(os.listdir("/proc/self/fd"))
    run("first")
    run("second")
    assert len(os.listdir("/proc/self/fd")) - before < 20


STDIN_RUN = """
import multiprocessing, os, sys
from parity.config import load_config
from parity.rl.controller import Controller
RUN = {run!r}
metrics = Controller(load_config(None, RUN)).run()
print("steps", len(metrics), "file", sys.modules["__main__"].__file__)
# the control: a fork-server child started from this main as multiprocessing starts one
child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
child.start()
child.join()
print("control exit", child.exitcode)
"""


def test_a_run_from_a_script_read_from_stdin_starts_its_workers(tmp_path):
    """`python - < train.py`: a worker imports its parent's main module from its file first, and
    '<stdin>' is none, so every worker died on FileNotFoundError and the run gave up after 3
    restarts. Such a main is left out of a worker's start; the control, a child started as
    multiprocessing starts one, still dies."""
    import subprocess
    import sys

    script = STDIN_RUN.format(run=RUN + ['model.preset="tiny"', "steps=2", f'run_dir="{tmp_path}"'])
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "steps 2 file <stdin>" in proc.stdout and "restarting" not in proc.stderr
    assert "control exit 1" in proc.stdout and "FileNotFoundError" in proc.stderr


def test_a_worker_error_met_while_batches_are_taken_in_waits_for_the_batch_it_failed(tmp_path):
    """A worker's error (your reward raised on batch 3) met by `collect`, while the learner records
    step 1, stopped the run there as "recording step 2 failed", that step's record without its
    transport figures. It is kept for the batch it failed: batches before it are served, and
    asking for that batch raises it."""
    import queue

    from parity.errors import ParityError
    from parity.rl.local import LocalRollout
    from parity.rl.trajectory import RolloutBatch

    cfg = load_config(None, RUN + ['model.preset="tiny"', "steps=4", f'run_dir="{tmp_path}"'])
    rollout = LocalRollout(cfg, cfg.model, lambda: {})
    slot = rollout.slots[0]
    slot.todo, slot.traj_q = [2, 3], queue.Queue()
    rollout.ready[2] = RolloutBatch(2, [], 0, 0.0, 0.0)  # (received before the error)
    slot.todo.remove(2)
    slot.traj_q.put(("error", "task.reward raised ValueError: judge down"))
    rollout.collect()  # not raised here
    assert rollout.next_batch(2).index == 2
    with pytest.raises(ParityError, match="^rollout worker: task.reward raised ValueError: judge down$"):
        rollout.next_batch(3)
