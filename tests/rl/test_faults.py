"""What a week-long run meets, injected on purpose: a rollout worker that hangs, a corrupt batch
file, a worker killed by the kernel's OOM killer, SIGTERM from a scheduler, the learner killed in
the middle of writing a checkpoint, a full disk. Every deterministic run must end with the
metrics of an uninterrupted one (or a one-line error and nothing earlier lost)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from parity.config import load_config
from parity.metrics.sinks import read_metrics
from parity.metrics.summary import deterministic_view
from parity.rl import checkpoint
from parity.rl.controller import Controller

RUN = ["model.preset=\"tiny\"", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=8",
       "learner.lr=0.003", "learner.micro_batch_size=4", "task.targets=[7, 8]", "steps=6", "max_policy_lag=2",
       "deterministic=true", "eval_every=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run every faulty run must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    return deterministic_view(Controller(load_config(None, RUN + [f'run_dir="{run_dir}"'])).run())


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """Set PARITY_FAULTS for this test (each fault fires once)."""
    state = tmp_path / "fault-state"
    state.mkdir()
    monkeypatch.setenv("PARITY_FAULT_STATE", str(state))

    def inject(spec: str) -> None:
        monkeypatch.setenv("PARITY_FAULTS", spec)
    return inject


def run(tmp_path, *extra) -> Controller:
    return Controller(load_config(None, RUN + [f'run_dir="{tmp_path / "run"}"', *extra]))


def test_a_hung_worker_is_detected_and_its_batches_sampled_again(tmp_path, faults, reference):
    faults("worker-hang@2")
    controller = run(tmp_path, "rollout.heartbeat_timeout_s=3.0")
    t0 = time.monotonic()
    metrics = controller.run()
    assert controller.rollout.restarts == 1 and time.monotonic() - t0 < 60
    assert deterministic_view(metrics) == reference


def test_a_corrupt_batch_file_is_refused_and_sampled_again(tmp_path, faults, reference):
    faults("corrupt-batch@1")
    controller = run(tmp_path)
    assert deterministic_view(controller.run()) == reference and controller.rollout.restarts == 1


def test_a_rollout_that_gives_up_keeps_the_steps_trained_and_resumes(tmp_path, faults, reference, caplog):
    """Four worker deaths in a row use up the restarts (3 within an hour) at batch 4: the error
    ends the run, but steps 0-3 are saved at that step boundary (they were lost without a
    checkpoint_every), and the resumed run ends as the uninterrupted one."""
    import logging

    from parity.errors import ParityError

    faults("worker-exit@1,worker-exit@2,worker-exit@3,worker-exit@4")
    controller = run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="parity"), \
            pytest.raises(ParityError, match="after 3 restarts within 60 min; giving up at batch 4"):
        controller.run()
    assert "the rollout failed at batch 4; the 4 steps trained are in" in caplog.text
    saved = checkpoint.latest(tmp_path / "run")
    assert saved.name == "checkpoint-4"
    checkpoint.verify(saved)
    resumed = Controller(load_config(None, RUN + [f'run_dir="{tmp_path / "run"}"']), resume=True)
    resumed.run()
    assert deterministic_view(read_metrics(tmp_path / "run")) == reference


def _memory_cgroup(limit_bytes: int) -> Path | None:
    root = Path("/sys/fs/cgroup")
    base = root / "memory" if (root / "memory" / "cgroup.procs").exists() else root
    path = base / f"parity-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        (path / ("memory.limit_in_bytes" if base != root else "memory.max")).write_text(str(limit_bytes))
    except OSError:
        return None
    return path


def test_a_worker_killed_by_the_oom_killer_is_restarted(tmp_path, faults, reference):
    group = _memory_cgroup(256 << 20)
    if group is None:
        pytest.skip("no writable memory cgroup here")
    try:
        faults(f"worker-oom@3:{group}")
        controller = run(tmp_path)
        assert deterministic_view(controller.run()) == reference and controller.rollout.restarts == 1
    finally:
        group.rmdir()


def _train(run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    sets = [x for item in RUN + [f'run_dir="{run_dir}"', *extra] for x in ("--set", item)]
    return subprocess.Popen([sys.executable, "-m", "parity.cli", "train", *sets], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_saves_a_checkpoint_and_resume_matches(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc = _train(run_dir, "steps=60")
    deadline = time.monotonic() + 120
    while _lines(run_dir) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "interrupted (SIGTERM); checkpoint saved" in err
    saved = checkpoint.latest(run_dir)
    checkpoint.verify(saved)
    resumed = subprocess.run([sys.executable, "-m", "parity.cli", "train", "--resume", str(run_dir),
                              "--set", "steps=6"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert deterministic_view(read_metrics(run_dir)) == reference


def _spools(pid: int) -> list[Path]:
    """The batch spools of the controller with this pid (named by it: other runs on the machine,
    a concurrent CI job's included, leave theirs in the same /dev/shm)."""
    shm = Path("/dev/shm")
    return list((shm if shm.is_dir() else Path(tempfile.gettempdir())).glob(f"parity-batches-{pid}-*"))


def test_the_learner_killed_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, reference):
    """...and the batch spool in /dev/shm (memory) that the learner's close would have removed
    does not outlive the next run's start: its orphaned worker removes it, and the next run any
    a worker could not (they were left behind, one per killed run)."""
    run_dir = tmp_path / "run"
    (tmp_path / "state").mkdir()
    proc = _train(run_dir, "checkpoint_every=2",
                  env={"PARITY_FAULTS": "ckpt-kill@4", "PARITY_FAULT_STATE": str(tmp_path / "state")})
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert (run_dir / ".checkpoint-4.tmp").exists()  # the half-written one, never renamed
    last = checkpoint.latest(run_dir)
    assert last.name == "checkpoint-2"
    checkpoint.verify(last)
    resumed = subprocess.run([sys.executable, "-m", "parity.cli", "train", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert not (run_dir / ".checkpoint-4.tmp").exists()  # a model's size, removed when the run resumed
    assert not _spools(proc.pid), "the killed run's spool directory was left in /dev/shm"
    assert deterministic_view(read_metrics(run_dir)) == reference


def test_stale_spools_are_removed_and_live_ones_kept(tmp_path):
    """A spool whose learner is gone goes; one whose learner runs (this process) stays, and so does
    one named by digits that cannot be a pid (the cleanup raised OverflowError at a worker's start)."""
    from parity.rl.local import remove_stale_spools

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    gone, live = tmp_path / f"parity-batches-{dead}-abc", tmp_path / f"parity-batches-{os.getpid()}-def"
    huge = tmp_path / f"parity-batches-{10**30}-ghi"
    for path in (gone, live, huge):
        path.mkdir()
        (path / "batch-3.pkl").write_bytes(b"x")
    assert remove_stale_spools(tmp_path) == [gone]
    assert not gone.exists() and live.exists() and huge.exists()


def test_a_full_disk_is_a_one_line_error_and_nothing_earlier_is_lost(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(run_dir)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        proc = _train(run_dir, "steps=60", "checkpoint_every=1")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in err
        for path in run_dir.glob("checkpoint-*"):
            checkpoint.verify(path)  # every checkpoint that exists is whole
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(len(records)))
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)


def test_a_damaged_metrics_file_is_named_and_a_cut_last_line_does_not_stop_a_resume(tmp_path, caplog):
    """A kill in the middle of writing metrics.jsonl leaves its last line cut short: resume
    failed on it with a bare JSON error (the checkpoint was fine), and a line that was JSON but
    not a record raised a traceback, as did a value that is not a number (once the run had trained,
    writing its report). A cut last line is now left out with a warning; any other damage is one
    line naming the file and the line; a null (NaN as other tools write it) is read as NaN."""
    import logging

    from parity.errors import CheckpointError

    controller = run(tmp_path, "steps=3")
    controller.run()
    path = tmp_path / "run" / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole[:-200])  # the third record cut short, as a kill mid-write leaves it
    with caplog.at_level(logging.WARNING, logger="parity"):
        resumed = Controller(load_config(None, RUN + [f'run_dir="{tmp_path / "run"}"', "steps=4"]),
                             resume=True)
    assert "its last line (3) was cut short and is left out" in caplog.text
    assert [m["step"] for m in resumed.run()] == [0, 1, 3]
    lines = whole.splitlines()
    for damaged, message in ((["[1, 2, 3]", *lines[1:]], "line 1 is a JSON list, not a record"),
                             ([lines[0], "{bad", lines[2]], "line 2 is not a JSON record"),
                             ([lines[0], lines[1].replace("{", '{"x": "yes", ', 1)],
                              "line 2: 'x' is \"yes\", not a number"),  # (a traceback in a report)
                             ([lines[0].replace('"step": 0', '"step": "0"')], 'line 1: its "step" is "0"')):
        path.write_text("\n".join(damaged) + "\n")
        with pytest.raises(CheckpointError, match=f"metrics.jsonl {message}"):
            read_metrics(tmp_path / "run")
    record = json.loads(lines[0])  # NaN as pandas and jq write it: null, read back as NaN
    path.write_text(json.dumps({**record, "reward/mean": None}) + "\n")
    value = read_metrics(tmp_path / "run")[0]["reward/mean"]
    assert value != value and record["reward/mean"] == record["reward/mean"]
    path.write_bytes(b"\xae\xff\n")
    with pytest.raises(CheckpointError, match="metrics.jsonl is not UTF-8 text"):
        read_metrics(tmp_path / "run")


def _fail_once(target, name: str, at: int, exc: BaseException, after: bool = False) -> None:
    """Make `target.name` raise `exc` on its `at`-th call (1-based), before doing its work or
    (`after`) once it is done."""
    real, calls = getattr(target, name), []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == at and not after:
            raise exc
        out = real(*args, **kwargs)
        if len(calls) == at:
            raise exc
        return out
    setattr(target, name, flaky)


@pytest.mark.parametrize("where", ["learner", "publish"])
def test_a_failure_anywhere_in_a_step_keeps_the_steps_trained_and_resumes(tmp_path, reference, where, caplog):
    """The learner's step out of memory at step 3 (the batch in hand is kept with checkpoint-3),
    sending version 3 to the workers failing (checkpoint-3: the learner is past step 2): only a
    failed rollout saved a checkpoint, so with the default checkpoint_every every other error
    lost the whole run."""
    import logging

    controller = run(tmp_path)
    if where == "learner":
        _fail_once(controller.learner, "step", 4, RuntimeError("CUDA out of memory (injected)"))
    else:
        _fail_once(controller.rollout, "publish", 3, OSError(28, "No space left on device"))
    with caplog.at_level(logging.WARNING, logger="parity"), pytest.raises((RuntimeError, OSError)):
        controller.run()
    said = "the learner's step 4 failed" if where == "learner" else "recording step 3 failed"  # (1-based)
    assert f"{said}; the 3 steps trained are in" in caplog.text
    saved = checkpoint.latest(tmp_path / "run")
    assert saved.name == "checkpoint-3"
    checkpoint.verify(saved)
    (tmp_path / "run" / ".checkpoint-9.tmp").mkdir()  # as a killed save leaves it
    Controller(load_config(None, RUN + [f'run_dir="{tmp_path / "run"}"']), resume=True).run()
    assert deterministic_view(read_metrics(tmp_path / "run")) == reference
    assert not (tmp_path / "run" / ".checkpoint-9.tmp").exists()


def test_sigterm_while_the_learner_waits_for_a_batch_saves_at_once(tmp_path, faults, reference):
    """A scheduler's SIGTERM while the learner waits for a batch that takes long (here one held
    back for ten minutes): the wait gives way and checkpoint-3 is saved at once (the signal
    was only seen once the batch came, long after a scheduler's grace period)."""
    import threading

    from parity.errors import Interrupted

    faults(f"worker-hold@3:{tmp_path / 'never'}")
    controller = run(tmp_path)
    done = threading.Event()

    def signal_when_waiting():
        while len(controller.metrics) < 3 and not done.is_set():
            time.sleep(0.05)
        time.sleep(1.5)  # the learner is waiting for batch 3 by now
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_when_waiting, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted) as stop:
            controller.run()
    finally:
        done.set()
    assert time.monotonic() - t0 < 120 and stop.value.signal_name == "SIGTERM"
    assert Path(stop.value.path).name == "checkpoint-3"
    checkpoint.verify(stop.value.path)
    Controller(load_config(None, RUN + [f'run_dir="{tmp_path / "run"}"']), resume=True).run()
    assert deterministic_view(read_metrics(tmp_path / "run")) == reference


class _Unsendable:
    def __reduce__(self):
        raise OSError(28, "No space left on device")  # as /dev/shm full fails pickling the weights


def test_a_weight_version_that_could_not_be_sent_restarts_the_worker(tmp_path, reference):
    """The queue's feeder thread fails to send version 2 (it printed a traceback and dropped
    the message: the worker waited for that version for good, beating all the while, and the run
    hung): the worker is restarted with the versions it needs and the run ends as an
    uninterrupted one."""
    controller = run(tmp_path)
    real = controller.rollout.publish
    controller.rollout.publish = lambda version, state: real(
        version, {**state, "unsendable": _Unsendable()} if version == 2 else state)
    t0 = time.monotonic()
    assert deterministic_view(controller.run()) == reference
    assert controller.rollout.restarts == 1 and time.monotonic() - t0 < 120


def test_a_metrics_file_that_failed_a_write_takes_the_next_one(tmp_path):
    """After a full disk failed one write (a one-line error), space freed: the next write
    raised AttributeError ('NoneType' has no 'tell'), so nothing more could be recorded."""
    from parity.errors import ParityError
    from parity.metrics.sinks import MetricsSink

    sink = MetricsSink(tmp_path, [])
    sink.write({"step": 0})
    real = sink._file

    class Full:
        def tell(self):
            return real.tell()

        def write(self, text):
            raise OSError(28, "No space left on device")

        def close(self):
            real.close()

    sink._file = Full()
    with pytest.raises(ParityError, match="could not write step 1 .No space left on device.; earlier"):
        sink.write({"step": 1})
    sink.write({"step": 1})
    sink.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_stdout_piped_into_head_does_not_end_the_run(tmp_path, reference):
    """`parity train ... | head -n 1`: the progress display's broken pipe ended the run at its
    next step with "error: [Errno 32] Broken pipe" (exit 2, no checkpoint); now the display is
    dropped, the run trains to its end and exits as SIGPIPE would (141)."""
    run_dir = tmp_path / "run"
    proc = _train(run_dir)
    proc.stdout.readline()
    proc.stdout.close()  # the reader is gone
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err
    assert "the progress display failed ([Errno 32] Broken pipe); training goes on" in err
    assert deterministic_view(read_metrics(run_dir)) == reference
    assert checkpoint.latest(run_dir).name == "checkpoint-6"


SIGTERM_IN_TRITON_INIT = """
import os, signal, sys
state = {"sent": False}
def profile(frame, event, arg):  # ... and its initialisation calls back into Python: SIGTERM now
    if not state["sent"] and event == "call" and frame.f_code.co_filename.endswith("enum.py"):
        state["sent"] = True
        sys.setprofile(None)
        print("SIGTERM sent inside Triton's initialisation", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
def hook(event, args):  # Triton's C++ extension is being imported (by torch._dynamo)
    if event == "import" and args[0] == "triton._C.libtriton" and not state["sent"]:
        sys.setprofile(profile)
if __name__ == "__main__":  # (not again in each rollout worker, which imports this file first)
    run_dir, mode = sys.argv[1], sys.argv[2]
    if mode != "parity":  # torch's own AdamW, whose first call imports torch._dynamo and so Triton
        import torch
        import parity.rl.learner
        import parity.rl.optim
        if mode == "held":  # built under the signals held, as parity builds its optimizer
            parity.rl.optim.AdamW = torch.optim.AdamW
        else:  # the control: built as it was, without the signals held
            parity.rl.learner.adamw = torch.optim.AdamW
    sys.addaudithook(hook)
    from parity.cli import main
    sys.exit(main(["train", "--set", 'model.preset="tiny"', "--set", f'run_dir="{run_dir}"', "--set",
                   "steps=2", "--overwrite"]))
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed")
def test_sigterm_while_the_first_optimizer_imports_triton_is_one_line_not_an_abort(tmp_path):
    """torch's AdamW imports torch._dynamo and Triton on its first call, and Triton's C++ module
    init calls back into Python: the CLI's SIGTERM handler raised there, the exception crossed C++
    and the process aborted (SIGABRT, ~85 lines of C++ traceback). parity's AdamW (`rl/optim.py`)
    imports neither: a CPU run's learner never imports Triton, so no SIGTERM is sent and the run
    ends normally. torch's AdamW built with the signals held, as parity builds its optimizer: the
    signal is re-raised after, exit 143, one line. The control builds it as before, and aborts."""
    script = tmp_path / "sigterm.py"
    script.write_text(SIGTERM_IN_TRITON_INIT)
    runs = {}
    for mode in ("parity", "held", "control"):  # (a run directory named "parity" beside the script,
        # on its sys.path, shadowed the installed package as a namespace package in the next runs)
        runs[mode] = subprocess.run([sys.executable, str(script), str(tmp_path / f"run-{mode}"), mode],
                                    capture_output=True, text=True, timeout=300,
                                    cwd=Path(__file__).resolve().parents[2])
        sent = "SIGTERM sent inside Triton's initialisation" in runs[mode].stderr
        assert sent == (mode != "parity"), runs[mode].stderr[-2000:]
    assert runs["parity"].returncode == 0, runs["parity"].stderr[-2000:]
    assert runs["held"].returncode == 143, runs["held"].stderr[-2000:]
    assert runs["held"].stderr.strip().splitlines()[-1] == "parity: interrupted (SIGTERM)"
    assert "terminate called" not in runs["held"].stderr
    control = runs["control"]
    assert control.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT), control.stderr[-2000:]


CTRL_C_IN_CHECKPOINTING = """
import os, signal, sys
state = {"sent": False}
def profile(frame, event, arg):
    if not state["sent"] and event == "call" and frame.f_code.co_filename.endswith("enum.py"):
        state["sent"] = True
        sys.setprofile(None)
        print("SIGINT sent inside Triton's initialisation", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
def hook(event, args):
    if event == "import" and args[0] == "triton._C.libtriton" and not state["sent"]:
        sys.setprofile(profile)
if __name__ == "__main__":
    # Ctrl-C as in a terminal: a process started with SIGINT ignored (by a pytest-xdist worker some
    # earlier test left so, or a shell's background job) inherits that, and the re-raised SIGINT
    # was then ignored too (the run said "not interrupted")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import parity
    if sys.argv[1] == "control":
        import parity.model.decoder
        parity.model.decoder.import_held = lambda name: None
    model = parity.Model(parity.ModelConfig.preset("tiny"), seed=0)
    sys.addaudithook(hook)
    try:
        parity.sequence_logprobs(model, [[1, 2, 3, 4]], recompute=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(130)
    print("not interrupted")
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed")
def test_ctrl_c_while_activation_checkpointing_first_imports_triton_is_a_keyboard_interrupt(tmp_path):
    """torch's activation checkpointing imports torch._dynamo, and so Triton, at its first call: a
    Ctrl-C there (Python's own handler: KeyboardInterrupt, raised inside Triton's C++ init) aborted
    the process. The model imports it under the signals held first (`parity/signals.py`): the
    KeyboardInterrupt comes right after. The control, without that, aborts."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_IN_CHECKPOINTING)
    runs = {mode: subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                                 timeout=300, cwd=Path(__file__).resolve().parents[2])
            for mode in ("fixed", "control")}
    for run in runs.values():
        assert "SIGINT sent inside Triton's initialisation" in run.stderr, run.stderr[-2000:]
    assert runs["fixed"].returncode == 130 and runs["fixed"].stdout.strip() == "KeyboardInterrupt"
    control = runs["control"]
    assert control.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT), control.stderr[-2000:]


def test_dev_shm_out_of_room_is_named(tmp_path):
    """Local workers share weights, batches and queue semaphores through /dev/shm: out of room, the
    run ended on "[Errno 28] No space left on device" (a semaphore's: no file named) after a
    restart that met the same wall. Now one line names /dev/shm, its size and how to grow it, and
    the steps trained are kept. Where a mount namespace is out of reach, the classifier alone."""
    import errno as errno_mod
    import shutil as shutil_mod

    from parity.errors import ParityError
    from parity.rl import shm

    torch_full = RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left "
                              "on device (28)")  # (PyTorch's, sending weights: raised through the context)
    with pytest.raises(ParityError, match="no space left in /dev/shm .*--shm-size"):
        with shm.shared_memory_errors():
            raise torch_full
    bare = OSError(errno_mod.ENOSPC, "No space left on device")  # a semaphore's, or a full disk's write
    shm.check_shared_memory(bare)  # /dev/shm has room here: not taken for it
    full = shutil_mod.disk_usage(shm.SHM)._replace(free=4096)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shm.shutil, "disk_usage", lambda path: full)
        with pytest.raises(ParityError, match="no space left in /dev/shm .*--shm-size"):
            shm.check_shared_memory(bare)
        shm.check_shared_memory(OSError(errno_mod.ENOSPC, "No space left on device", "/data/x"))  # a file's
        shm.check_shared_memory(OSError(errno_mod.EMFILE, "Too many open files"))
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare -m)")
    run_dir = tmp_path / "run"
    sets = [s for s in RUN if s != "steps=6"] + ["steps=20", "rollout.workers=2", f'run_dir="{run_dir}"']
    cmd = " ".join(["mount -t tmpfs -o size=1m tmpfs /dev/shm &&", sys.executable, "-m", "parity.cli",
                    "train", *(f"'--set={s}'" for s in sets)])
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("parity: error: no space left in /dev/shm (1.0 MiB"), out.stderr[-2000:]
    assert checkpoint.found(run_dir)  # the steps trained are kept
