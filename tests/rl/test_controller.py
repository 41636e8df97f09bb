"""The trainer: the policy lag bound holds, deterministic runs repeat exactly, a killed rollout
worker is restarted without losing or repeating samples, configs are validated."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from parity.config import LearnerConfig, LossConfig, load_config, to_toml
from parity.errors import ConfigError
from parity.metrics.report import write_report
from parity.metrics.summary import deterministic_view
from parity.rl.controller import Controller
from parity.rl.learner import Learner

BASE = ["model.preset=\"tiny\"", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_tokens=8", "learner.lr=0.003", "learner.micro_batch_size=4", "task.targets=[7, 8]"]


def config(tmp_path, *extra):
    return load_config(None, BASE + [f"run_dir=\"{tmp_path}\"", *extra])


timeless = deterministic_view


@pytest.mark.parametrize("lag", [0, 1, 3])  # (lags of 8 and 64 could not be exceeded in 6 steps)
def test_policy_lag_bound_holds(tmp_path, lag):
    metrics = Controller(config(tmp_path, "steps=6", f"max_policy_lag={lag}")).run()
    assert [m["step"] for m in metrics] == list(range(6))
    assert all(m["lag/max"] <= lag for m in metrics)
    assert all(m["mismatch/kernel_max_abs"] == 0.0 for m in metrics)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6 and (tmp_path / "checkpoint-6" / "model.safetensors").exists()
    assert not (tmp_path / "report.md").exists()  # the apps write the report
    if lag == 0:
        md, png = write_report(tmp_path)
        assert "| learner steps | 6 |" in md.read_text() and png.stat().st_size > 10_000
        assert all(m["lag/max"] == 0 and m["is_weight/max"] == 1.0 for m in metrics)


def test_deterministic_runs_repeat_and_survive_a_killed_worker(tmp_path):
    args = ("steps=6", "max_policy_lag=2", "deterministic=true")
    first = Controller(config(tmp_path / "a", *args)).run()
    second = Controller(config(tmp_path / "b", *args)).run()
    assert timeless(first) == timeless(second)
    assert max(m["lag/max"] for m in first) == 2

    killed = Controller(config(tmp_path / "c", *args, "rollout.workers=2"))

    def kill_after_step_two(step, metrics):
        if step == 2:
            os.kill(killed.rollout.pids[1], signal.SIGKILL)

    third = killed.run(progress=kill_after_step_two)
    assert killed.rollout.restarts == 1  # the killed one, and only it: a finished worker is not "dead"
    assert timeless(third) == timeless(first)


def test_a_worker_that_finished_early_is_not_restarted(tmp_path):
    """With lag >= steps the worker samples every batch at once and has nothing left to do; it
    must stay until its batches are read (its queue flushed), not exit and be taken for dead."""
    controller = Controller(config(tmp_path, "steps=3", "max_policy_lag=8", "eval_every=0"))
    metrics = controller.run()
    assert [m["step"] for m in metrics] == [0, 1, 2] and controller.rollout.restarts == 0


def test_every_shipped_config_loads_and_validates():
    """configs/ and examples/ hold what the README, the study and scripts/gpu_check.sh run: each
    loads and validates (a study's every run and seed too), so a renamed or retired key shows here,
    not in a device call's training step."""
    from pathlib import Path

    from parity.apps.study_grid import load_study, run_config

    root = Path(__file__).resolve().parents[2]
    files = sorted([*root.glob("configs/*.toml"), *root.glob("examples/*.toml")])
    assert len(files) >= 7
    for path in files:
        if path.name.startswith("study"):
            study = load_study(str(path))
            assert [run_config(study, run, seed) for run in study.runs for seed in study.seeds], path
        else:
            assert load_config(path).steps > 0, path


def test_config_is_validated_and_round_trips(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key rollout.max_tokns"):
        load_config(None, ["rollout.max_tokns=3"])
    with pytest.raises(ConfigError, match="max_policy_lag"):
        load_config(None, ["max_policy_lag=-1"])
    with pytest.raises(ConfigError, match="unknown loss"):
        load_config(None, ["learner.loss=\"ppo\""])
    with pytest.raises(ConfigError, match="learner.lr must be a number, got .fast."):
        load_config(None, ["learner.lr=\"fast\""])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["steps"])
    with pytest.raises(ConfigError, match="group_size must be >= 2"):  # (every advantage 0: learned nothing)
        load_config(None, ["rollout.group_size=1"])
    from parity.rl.controller import _Clock

    untimed = [{"step": 0, "time/wall_s": 5.0}, {"step": 1, "train/loss": 0.0}]  # a record written after a
    clock = _Clock.resumed(untimed, 2)  # failure has no timings: counted from 0 over no time, 198,968/h
    assert clock.counted_from == 2 and clock.first is None
    cfg = config(tmp_path, "learner.tis_cap=3.0", "max_policy_lag=4")
    assert cfg.learner.loss_config.tis_cap == 3.0
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
    # a loss parameter spelled flat over a written config (its [learner.loss_config] table beside
    # it): "unknown config key learner.ppo_eps"; both spellings at once must agree
    assert load_config(path, ["learner.ppo_eps=0.3"]).learner.loss_config.ppo_eps == 0.3
    from parity.config import config_from_dict

    flat = tmp_path / "flat.toml"  # a file's own flat spelling, and an override of it: the override
    flat.write_text("[learner]\nppo_eps = 0.3\n")
    assert load_config(flat, ["learner.ppo_eps=0.1"]).learner.loss_config.ppo_eps == 0.1
    from parity.config.loading import set_dotted

    table = set_dotted({}, "learner.ppo_eps", 0.3)
    set_dotted(table, "learner.loss_config", {"aggregation": "token"})
    assert config_from_dict(table).learner.loss_config.ppo_eps == 0.3  # (a table set after: merged)
    both = {"learner": {"ppo_eps": 0.3, "loss_config": {"ppo_eps_high": 0.28}}}
    assert config_from_dict(both).learner.loss_config.ppo_eps == 0.3
    both["learner"]["loss_config"]["ppo_eps"] = 0.2
    with pytest.raises(ConfigError, match="ppo_eps = 0.3 and learner.loss_config.ppo_eps = 0.2 disagree"):
        config_from_dict(both)


def test_a_cosine_schedule_spans_the_run(tmp_path):
    """total_steps 0 is the run's steps, written down as a number; a schedule that ends before the
    run (the last steps at learning rate 0) or within its warm-up is refused, and so is a Learner
    given a cosine schedule of no length."""
    cfg = config(tmp_path, "steps=7", "learner.schedule=\"cosine\"", "learner.warmup_steps=2")
    assert cfg.learner.total_steps == 7
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
    from parity.rl.build import build_model

    learner = Learner(build_model(cfg), cfg.learner)
    factors = [learner._lr_factor(step) for step in range(8)]
    assert factors[2] == 1.0 and 0 < factors[6] < 0.1 and factors[7] == 0.0  # (0 after the run's last step)
    with pytest.raises(ConfigError, match=r"total_steps \(5\) < steps \(7\): .* learning rate 0"):
        config(tmp_path, "steps=7", "learner.schedule=\"cosine\"", "learner.total_steps=5")
    with pytest.raises(ConfigError, match=r"total_steps \(2\) must be more than warmup_steps \(2\)"):
        LearnerConfig(schedule="cosine", total_steps=2, warmup_steps=2)
    with pytest.raises(ConfigError, match="total_steps must be set for schedule 'cosine'"):
        Learner(build_model(cfg), LearnerConfig(schedule="cosine"))
    assert config(tmp_path, "steps=7").learner.total_steps == 0  # (constant: no length to fill in)
    # a config.toml written before (constant schedule, total_steps = 1000) reads as the same run
    assert config(tmp_path, "steps=7", "learner.total_steps=1000") == config(tmp_path, "steps=7")
    with pytest.raises(ConfigError, match=r"steps \(3\) must be more than learner.warmup_steps \(10\)"):
        config(tmp_path, "steps=3", "learner.schedule=\"cosine\"", "learner.warmup_steps=10")


def test_a_config_changed_after_construction_is_checked_again_when_the_run_starts(tmp_path):
    """A field set after the TrainConfig was built: the learner fields derived from it follow it
    (the learner scored at the old temperature: no log-prob matched, kernel mismatch 0.31), and
    a value of the wrong type is one line (it failed in a worker, four restarts later)."""
    cfg = config(tmp_path, "steps=1", "eval_every=0")
    cfg.rollout.temperature = 0.5
    controller = Controller(cfg)
    assert controller.cfg.learner.temperature == 0.5 and controller.learner.config.temperature == 0.5
    cfg.rollout.prompts_per_step = 2.0
    with pytest.raises(ConfigError, match="rollout.prompts_per_step must be an integer, got 2.0"):
        Controller(cfg)
    with pytest.raises(ConfigError, match="expected a TrainConfig, got dict"):
        Controller({"steps": 1})
    with pytest.raises(ConfigError, match="Learner config must be a LearnerConfig, got dict"):
        Learner(controller.model, {"lr": 1e-3})  # (an AttributeError)
    with pytest.raises(ConfigError, match="LossConfig.ppo_eps must be finite"):
        LossConfig(ppo_eps=float("inf"))  # (clipping silently off)


def test_interrupt_and_resume_match_an_uninterrupted_run(tmp_path):
    # (a warm-up and a cosine decay: the learning-rate schedule's state is part of what resumes; a
    # KL penalty: its reference policy too, the run's first weights, not the resumed ones)
    args = ("steps=6", "max_policy_lag=2", "deterministic=true", "model.dtype=\"bfloat16\"",
            "learner.warmup_steps=2", "learner.schedule=\"cosine\"", "learner.total_steps=6",
            "learner.kl_coef=0.05", "seed=1")  # (seed 1: the weights move before the interrupt)
    whole = Controller(config(tmp_path / "whole", *args)).run()
    kl = [m["train/kl_ref"] for m in whole]
    assert kl[0] == 0.0 and kl[2] > 0  # π = π_ref at version 0, not after the updates (the control)
    first = Controller(config(tmp_path / "cut", *args))

    def ctrl_c(step, metrics):
        if step == 2:
            first.interrupted = True  # what the SIGINT handler sets

    from parity.rl.controller import Interrupted

    with pytest.raises(Interrupted) as stop:
        first.run(progress=ctrl_c)
    assert stop.value.path.name == "checkpoint-3"
    resumed = Controller(config(tmp_path / "cut", *args), resume=True)
    assert resumed.start_step == 3 and resumed.learner.version == 3
    again = resumed.run()
    assert timeless(again) == timeless(whole)
    rates = [m["train/lr"] for m in whole]
    assert rates[0] < rates[1] and rates[2] > rates[5] > 0  # the schedule moved (so the check can fail)
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6
    # its clock goes on from the interrupted part (it restarted at 0: wall time went backwards
    # and steps/hour counted only the resumed steps)
    walls = [json.loads(x)["time/wall_s"] for x in lines]
    assert walls == sorted(walls) and walls[3] > walls[2]
    rate = json.loads(lines[-1])["throughput/steps_per_hour"]
    assert rate == pytest.approx(3600 * 6 / walls[-1])


@pytest.mark.parametrize("where", ["last step", "evaluation", "final evaluation"])
def test_a_run_stopped_at_its_end_or_in_an_evaluation_is_finished_by_a_resume(tmp_path, monkeypatch, where):
    """Ctrl-C / SIGTERM at the last step's end, or during an evaluation (the one before step 2, or
    the final one): an evaluation is dropped at its next engine step (it ran to its end, and the
    final one then exited 0), a checkpoint is saved, and a resume finishes the run to the same
    metrics as a run never stopped (a resume at the end was refused as 'already at step 3', and a
    study trained such a run again from scratch); once its report is written, a resume is refused."""
    import parity.rl.controller as controller_module
    from parity.apps.study import _restart
    from parity.errors import ParityError
    from parity.rl.controller import Interrupted

    args = ("steps=3", "eval_every=2", "eval_prompts=2", "deterministic=true", "max_policy_lag=1")
    whole = Controller(config(tmp_path / "whole", *args)).run()
    assert "eval/pass@1" in whole[2] and "eval/pass@1_final" in whole[2]
    cut = Controller(config(tmp_path / "cut", *args))
    calls, real = [], controller_module.evaluate

    def evaluate(*a, **k):  # the signal arrives while the evaluation runs
        calls.append(1)
        if (where == "evaluation" and len(calls) == 2) or (where == "final evaluation" and len(calls) == 3):
            cut.interrupted = "SIGTERM"
        return real(*a, **k)

    monkeypatch.setattr(controller_module, "evaluate", evaluate)

    def at_last(step, metrics):
        if where == "last step" and step == 2:
            cut.interrupted = "SIGTERM"

    with pytest.raises(Interrupted) as stop:
        cut.run(progress=at_last)
    assert stop.value.path.name == ("checkpoint-2" if where == "evaluation" else "checkpoint-3")
    assert _restart(config(tmp_path / "cut", *args)) == {"resume": True}  # (a study: {"overwrite": True})
    resumed = Controller(config(tmp_path / "cut", *args), resume=True)
    assert timeless(resumed.run()) == timeless(whole)
    write_report(tmp_path / "cut")
    with pytest.raises(ParityError, match="already at step 3; to train on, raise steps"):
        Controller(config(tmp_path / "cut", *args), resume=True)
    if where == "last step":  # resumed to go past that end: its report is stale from the start
        more = Controller(config(tmp_path / "cut", *args[1:], "steps=4"), resume=True)
        more.interrupted = "SIGTERM"  # (stops at once, after step 3)
        with pytest.raises(Interrupted):
            more.run()
        assert not (tmp_path / "cut" / "report.md").exists()


def test_a_run_stopped_at_its_end_without_its_metrics_still_gets_its_final_evaluation(tmp_path):
    """A run stopped at its last step whose metrics.jsonl is gone (lost with a node, deleted): the
    resume warns that the records are lost, and still runs and records the final evaluation (it
    was skipped without a word: there was no record to put it in), so that the report has it."""
    from parity.metrics.report import write_report
    from parity.rl.controller import Interrupted

    args = ("steps=2", "eval_every=2", "eval_prompts=2", "deterministic=true", "max_policy_lag=1")
    whole = Controller(config(tmp_path / "whole", *args)).run()
    cut = Controller(config(tmp_path / "cut", *args))

    def at_last(step, metrics):
        if step == 1:
            cut.interrupted = "SIGTERM"

    with pytest.raises(Interrupted):
        cut.run(progress=at_last)
    (tmp_path / "cut" / "metrics.jsonl").unlink()
    records = Controller(config(tmp_path / "cut", *args), resume=True).run()
    assert [r["step"] for r in records] == [1]
    assert records[0]["eval/pass@1_final"] == whole[-1]["eval/pass@1_final"]
    assert json.loads((tmp_path / "cut" / "metrics.jsonl").read_text())["eval/pass@1_final"] == \
        whole[-1]["eval/pass@1_final"]
    write_report(tmp_path / "cut")
    assert (tmp_path / "cut" / "report.md").exists()


def test_corrupt_checkpoint_is_refused(tmp_path):
    from parity.errors import CheckpointError

    Controller(config(tmp_path, "steps=2", "checkpoint_every=1")).run()
    state = tmp_path / "checkpoint-2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="do not match manifest.json.*checkpoint-1 is older and may be "
                                              "intact: move checkpoint-2 aside"):
        Controller(config(tmp_path, "steps=4"), resume=True)
    shutil.rmtree(tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-2" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json"):
        Controller(config(tmp_path, "steps=4"), resume=True)


def test_a_checkpoint_with_flipped_weight_bytes_is_refused_wherever_it_is_loaded(tmp_path, capsys):
    """Bytes overwritten inside a tensor's data give finite weights that pass every other load-time
    check: `parity eval --config` scored such a checkpoint as if intact. `load_model` now checks a
    training checkpoint's manifest first, and eval takes the newest intact checkpoint, saying so.
    The control: the same file without its manifest loads, so only the manifest catches it."""
    import struct

    from parity.cli import main
    from parity.errors import CheckpointError
    from parity.model import load_model

    Controller(config(tmp_path, "steps=2", "checkpoint_every=1")).run()
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little") + 256  # inside the first tensors' data
    raw[start:start + 256] = struct.pack("<f", 1e30) * 64
    weights.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="model.safetensors: contents do not match manifest.json"):
        load_model(tmp_path / "checkpoint-2")
    capsys.readouterr()
    assert main(["eval", "--config", str(tmp_path / "config.toml"), "--n", "2", "-k", "0", "--json"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint-2/model.safetensors: contents do not match manifest.json" in err
    assert "evaluating the older checkpoint-1" in err
    shutil.rmtree(tmp_path / "checkpoint-1")
    assert main(["eval", "--config", str(tmp_path / "config.toml"), "--n", "2", "-k", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no older checkpoint of this run is intact" in err[0]
    (tmp_path / "checkpoint-2" / "manifest.json").unlink()  # the control: nothing else sees it
    model = load_model(tmp_path / "checkpoint-2")
    values = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    assert torch.isfinite(values).all() and values.abs().max() == 1e30


def test_a_new_run_into_an_earlier_runs_dir_is_refused_or_starts_over(tmp_path, capsys):
    """An earlier run's checkpoints must not mix with a new run's (a resume takes the newest):
    `parity train` into its run dir is a one-line error that deletes nothing; --overwrite clears
    them first."""
    from parity.cli import main

    def train(*extra):
        sets = BASE + [f"run_dir=\"{tmp_path}\"", "eval_every=0", *extra]
        return [x for s in sets for x in ("--set", s)]

    assert main(["train", *train("steps=2")]) == 0
    capsys.readouterr()
    assert main(["train", *train("steps=1")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds checkpoint-2 of an earlier run" in err and "--resume" in err
    assert (tmp_path / "checkpoint-2").is_dir()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    (tmp_path / ".parity-demo").touch()  # as if a demo had run here: this run is no demo's
    (tmp_path / "tensorboard").mkdir(exist_ok=True)  # the earlier run's events (when installed)
    (tmp_path / "tensorboard" / "events.out.tfevents.1.earlier").write_bytes(b"x")
    assert main(["train", "--overwrite", *train("steps=1")]) == 0
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (tmp_path / "tensorboard" / "events.out.tfevents.1.earlier").exists()
    assert not (tmp_path / ".parity-demo").exists()  # a later demo would have replaced it unasked
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_inflight_weight_updates_keep_the_bound(tmp_path):
    cfg = config(tmp_path, "steps=6", "max_policy_lag=1", "rollout.weight_update=\"inflight\"",
                 "rollout.max_tokens=24")
    metrics = Controller(cfg).run()
    assert all(m["lag/max"] <= 1 for m in metrics)
    # tokens sampled over an older version's keys/values are reported apart (before, they made
    # the aligned kernels' mismatch read > 0); every other token's gap is exactly 0
    assert any(m.get("mismatch/stale_cache_frac", 0) > 0 for m in metrics), metrics
    assert all(m["mismatch/kernel_max_abs"] == 0.0 for m in metrics if "mismatch/kernel_max_abs" in m)
    assert any(m.get("mismatch/stale_cache_max_abs", 0) > 0 for m in metrics)
    with pytest.raises(ConfigError, match="deterministic"):
        config(tmp_path, "deterministic=true", "rollout.weight_update=\"inflight\"")


def test_tensorboard_scalars_when_installed(tmp_path, monkeypatch):
    import sys
    import types

    written = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, key, value, step):
            written.append((key, step))

        def close(self):
            written.append(("closed", -1))

    fake = types.SimpleNamespace(SummaryWriter=FakeWriter)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    Controller(config(tmp_path, "steps=2", "eval_every=0")).run()
    assert ("reward/mean", 1) in written and ("mismatch/kernel_max_abs", 0) in written
    assert written[-1] == ("closed", -1)


def _worker_scores(tmp_path, kernels):
    """A rollout worker samples batch 2 at lag 2 and scores it. Returns whether the scores equal
    (a) the learner's log-probs for the same sequences in other batches (filler sequences beside
    them) under the same weights, (b) the engine's own log-probs recorded while sampling."""
    import copy

    import torch

    from parity.model import sequence_logprobs
    from parity.rl.build import build_env, build_model
    from parity.rl.learner import Learner
    from parity.rl.rollout_worker import RolloutWorker
    from parity.rl.trajectory import TrajectoryBatch

    cfg = config(tmp_path, "max_policy_lag=2", f"model.kernels=\"{kernels}\"", "rollout.max_tokens=12",
                 "rollout.prompts_per_step=3")
    model = build_model(cfg)
    learner = Learner(copy.deepcopy(model), cfg.learner)
    worker = RolloutWorker(cfg, model, build_env(cfg, model.config.vocab_size), version=0)
    batch = TrajectoryBatch(worker.sample(2).trajectories)
    mask = batch.mask.bool()
    assert not batch.sampled_learner_logprobs[mask].isnan().any()  # every sampled token scored
    assert batch.sampled_learner_logprobs[~mask].isnan().all()
    gen = torch.Generator().manual_seed(0)
    same = True
    for fillers, length in ((1, 40), (3, 77), (5, 130)):  # other batch shapes than the worker's
        extra = [torch.randint(0, model.config.vocab_size, (length,), generator=gen) for _ in range(fillers)]
        with torch.no_grad():
            other = batch.pad([sequence_logprobs(learner.model, [s, *extra], cfg.learner.temperature)[0]
                               for s in batch.sequences])
        same &= torch.equal(batch.sampled_learner_logprobs[mask], other[mask])
    return same, torch.equal(batch.sampled_learner_logprobs[mask], batch.rollout_logprobs[mask])


def test_worker_scores_are_the_learners_own_log_probs(tmp_path):
    """The learner path run by the rollout worker at the sampling weights equals, bit for bit,
    what the learner computes for the same sequences in other batches and what the engine
    recorded (so the kernel mismatch it reports is exactly zero); the standard kernels' control
    differs from the engine."""
    assert _worker_scores(tmp_path / "aligned", "aligned") == (True, True)
    assert _worker_scores(tmp_path / "standard", "standard")[1] is False


def test_a_learner_process_that_computes_other_bits_shows_in_the_kernel_figure(tmp_path, monkeypatch):
    """The kernel figure of tokens at lag >= 1 compared the engine with the rollout worker's own
    run of the learner's code: a learner process computing other bits (another machine) showed
    only at step 0 (a -1e-3 shift read exactly 0 from step 1 on). The learner now re-scores a few
    rows of each batch its kept-back version sampled in its own process: the shift shows every
    `max_policy_lag` steps, and `mismatch/learner_recheck_max_abs` is exactly 0 without it."""
    import parity.rl.learner as learner_module

    args = ("steps=7", "max_policy_lag=2", "deterministic=true", "eval_every=0")
    clean = Controller(config(tmp_path / "clean", *args)).run()
    assert [m["step"] for m in clean if "mismatch/learner_recheck_max_abs" in m] == [1, 3, 5]
    assert all(m.get("mismatch/learner_recheck_max_abs", 0.0) == 0.0 for m in clean)
    real = learner_module.sequence_logprobs

    def shifted(*args, **kwargs):  # this process only: the rollout workers are processes of their own
        out = real(*args, **kwargs)
        return ([x - 1e-3 for x in out[0]], *out[1:]) if isinstance(out, tuple) else [x - 1e-3 for x in out]

    monkeypatch.setattr(learner_module, "sequence_logprobs", shifted)
    off = Controller(config(tmp_path / "off", *args)).run()
    for m in off[1:]:
        rechecked = "mismatch/learner_recheck_max_abs" in m
        assert m["step"] % 2 == 1 if rechecked else m["step"] % 2 == 0  # (steps 1, 3, 5)
        if rechecked:
            assert m["mismatch/learner_recheck_max_abs"] == pytest.approx(1e-3, rel=1e-3)
            assert m["mismatch/kernel_max_abs"] == pytest.approx(1e-3, rel=1e-3)
        else:  # (the control: the worker's own figures cannot see it)
            assert m["mismatch/kernel_max_abs"] == 0.0


def test_the_version_kept_back_is_re_scored_when_only_some_steps_are_decomposed(tmp_path, monkeypatch):
    """With `decompose_every` = 2 at lag 3 the version kept back was re-scored once: its batch
    fell on a step the worker does not score (batch b is sampled by version b - 3). The learner
    now keeps a version whose batch lands on a decomposed step, so the shifted learner process
    shows at steps 4 and 8 (versions 1 and 5) and nowhere else, and a clean run reads 0 there."""
    import parity.rl.learner as learner_module

    args = ("steps=10", "max_policy_lag=3", "deterministic=true", "eval_every=0", "learner.decompose_every=2")
    clean = Controller(config(tmp_path / "clean", *args)).run()
    assert [m["step"] for m in clean if "mismatch/learner_recheck_max_abs" in m] == [4, 8]
    assert all(m.get("mismatch/learner_recheck_max_abs", 0.0) == 0.0 for m in clean)
    assert max(m["sync/versions_kept"] for m in clean) <= 5  # (the lag's 4 and the one kept back)
    real = learner_module.sequence_logprobs

    def shifted(*args, **kwargs):  # this process only
        out = real(*args, **kwargs)
        return ([x - 1e-3 for x in out[0]], *out[1:]) if isinstance(out, tuple) else [x - 1e-3 for x in out]

    monkeypatch.setattr(learner_module, "sequence_logprobs", shifted)
    off = Controller(config(tmp_path / "off", *args)).run()
    split = {m["step"]: m["mismatch/kernel_max_abs"] for m in off if "mismatch/kernel_max_abs" in m}
    assert sorted(split) == [0, 2, 4, 6, 8]
    assert split[4] == pytest.approx(1e-3, rel=1e-3) and split[8] == pytest.approx(1e-3, rel=1e-3)
    assert split[2] == split[6] == 0.0  # (the control: the worker's own figures cannot see it)


def test_the_version_kept_back_follows_the_lag_batches_come_at():
    """Where the rollout side is the slower, batches come at a lag below the bound (1, say, at
    `max_policy_lag` 3): a version kept for a batch at the full lag was never re-scored with
    `decompose_every` = 3 (16 steps, no recheck). `keep_back` predicts from the lag of the batch
    at hand: at lag 1 it keeps the version of the step before a decomposed one."""
    from types import SimpleNamespace

    import torch

    from parity.rl.decompose import keep_back

    def step(s, lag_seen, scored=True):
        learner.version = learner.steps = s
        scores = torch.zeros(2, 4) if scored else torch.full((2, 4), torch.nan)
        batch = SimpleNamespace(versions=torch.full((2, 4), s - lag_seen), mask=torch.ones(2, 4),
                                routing=None, sampled_learner_logprobs=scores)
        keep_back(learner, batch)
        return next(iter(learner.kept_back), None)

    learner = SimpleNamespace(config=SimpleNamespace(max_policy_lag=3, decompose_every=3), kept_back={},
                              history={s: f"weights {s}" for s in range(20)}, version=0, steps=0)
    # at lag 1: 2 kept (its batch comes at step 3), let go at the bound (step 5: no batch can carry
    # it), 5 kept (batch at 6), ...; the old rule kept 3, 6, ... whose batches came at 4, 7: never scored
    assert [step(s, 1) for s in range(1, 9)] == [None, 2, 2, 2, 5, 5, 5, 8]
    learner.kept_back.clear()
    assert [step(s, 3) for s in range(9, 13)] == [9, 9, 9, 12]  # at the full lag: 9's batch at 12
    assert step(15, 3, scored=False) is None  # (a decomposed batch without the worker's scores)


def test_kept_weight_versions_do_not_grow_with_the_lag(tmp_path):
    """At lag 64 (deterministic: batch b is sampled by version 0 here) the learner ends up keeping
    only the current weights once no batch is left to sample, and the one version it keeps back
    for its own re-scoring (`recheck`), yet every sampled token of the last batch, four versions
    old, is split into kernel mismatch (exactly zero) and weight lag: the worker scored its own
    samples at the weights that drew them."""
    metrics = Controller(config(tmp_path, "steps=5", "max_policy_lag=64", "deterministic=true",
                                "eval_every=0")).run()
    assert metrics[-1]["sync/versions_kept"] == 2 and metrics[-1]["lag/max"] == 4
    assert metrics[1]["mismatch/learner_recheck_max_abs"] == 0.0  # (version 0's batch 1, re-scored here)
    assert all(m["mismatch/decomposed_frac"] == 1.0 and m["mismatch/kernel_max_abs"] == 0.0 for m in metrics)
    assert metrics[-1]["mismatch/weight_lag_mean_abs"] > 0


def test_checkpoint_keeps_batches_sampled_ahead(tmp_path, caplog):
    """A checkpoint stores the batches sampled for later steps as plain data and gives them back,
    unless the run resumed samples under another config."""
    import logging

    from parity.rl import checkpoint
    from parity.rl.build import build_model
    from parity.rl.learner import Learner
    from parity.rl.trajectory import RolloutBatch, Trajectory

    cfg = config(tmp_path, "steps=4")
    model = build_model(cfg)
    tr = Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.25], [-1, 0, 0], 1.0, 0,
                    sampled_learner_logprobs=[float("nan"), -0.5, -0.25])
    ready = [RolloutBatch(3, [tr], 0, 0.1, 0.0, {"rollout/turns": 1.0})]
    path = checkpoint.save(tmp_path, 2, model, Learner(model, cfg.learner), ready=ready,
                           sampled_under=checkpoint.sampling_fields(cfg))
    _, _, step, back = checkpoint.load(path, cfg)
    assert step == 2 and len(back) == 1 and back[0].index == 3
    assert back[0].trajectories[0].token_ids == [1, 2, 3]
    assert back[0].trajectories[0].sampled_learner_logprobs[1:] == [-0.5, -0.25]
    # resumed with another temperature or task: sampled again (were trained on as they were: the
    # old temperature's log-probs in the importance weights, the old targets' rewards)
    for change in ("rollout.temperature=0.5", "task.targets=[1]", 'model.kernels="standard"'):
        with caplog.at_level(logging.WARNING, logger="parity"):
            assert checkpoint.load(path, config(tmp_path, "steps=4", change))[3] == []
        assert f"sampled under another {change.split('=')[0]}" in caplog.text
    assert len(checkpoint.load(path, config(tmp_path, "steps=9", "learner.lr=0.1"))[3]) == 1  # unrelated


def test_a_run_resumed_with_a_smaller_lag_samples_again_the_batches_it_does_not_admit(tmp_path, caplog):
    """A lag-4 checkpoint's ready batches (index, version) (3, 0), (4, 0), (5, 1), (6, 2): resumed
    with lag 0 they were trained on at lags 3-4 under `lag/bound` 0. Now only the admitted ones
    are kept (the control: the same batches with the run's own lag are all kept)."""
    import logging

    from parity.rl.rollout_worker import restored
    from parity.rl.trajectory import RolloutBatch

    ready = [RolloutBatch(i, [], v, 0.0, 0.0) for i, v in ((3, 0), (4, 0), (5, 1), (6, 2))]
    for deterministic in ("true", "false"):
        same = config(tmp_path, "max_policy_lag=4", f"deterministic={deterministic}")
        assert sorted(restored(same, ready, 3, 0)) == [3, 4, 5, 6]
        assert sorted(restored(same, ready, 4, 0)) == [4, 5, 6]  # consumed ones never come back
    with caplog.at_level(logging.WARNING, logger="parity"):
        assert restored(config(tmp_path, "max_policy_lag=0", "deterministic=true"), ready, 3, 0) == {}
    assert "batches [3, 4, 5, 6] of the checkpoint" in caplog.text
    # a lag-2 run resumed at step 3 keeps version 3 only: batches 3 and 4 need versions 1 and 2,
    # gone, unless the checkpoint holds them sampled (it warned on every exact resume)
    from parity.rl.rollout_worker import resume_floor

    lag2 = config(tmp_path, "max_policy_lag=2", "deterministic=true", "steps=6")
    ahead = [RolloutBatch(3, [], 1, 0.0, 0.0), RolloutBatch(4, [], 2, 0.0, 0.0)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="parity"):
        assert resume_floor(lag2, {3: None}, 3, ahead) == 0
        assert "were not kept" not in caplog.text
        assert resume_floor(lag2, {3: None}, 3, ahead[:1]) == 3
        assert "batches 4 are sampled by version 3" in caplog.text
        assert resume_floor(lag2, {0: None}, 0, []) == 0 and caplog.text.count("were not kept") == 1
    ready.append(RolloutBatch(7, [], 6, 0.0, 0.0))
    natural = config(tmp_path, "max_policy_lag=3")  # natural staleness: version >= index - lag
    assert sorted(restored(natural, ready, 3, 0)) == [3, 7]
    fixed = config(tmp_path, "max_policy_lag=3", "deterministic=true")  # fixed: exactly index - lag
    assert sorted(restored(fixed, ready, 3, 0)) == [3]


def test_each_checkpoint_is_written_once_and_a_second_save_swaps_whole(tmp_path, monkeypatch):
    """steps=4 with checkpoint_every=2 wrote checkpoint-4 twice (the periodic save, then the
    end's), removing the finished one before renaming the new one in: a kill between left a
    partial checkpoint that resume picked. Now once; and a step saved again is swapped by renames."""
    from parity.rl import checkpoint

    saved = []
    real = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda run_dir, step, *a, **k: saved.append(step)
                        or real(run_dir, step, *a, **k))
    controller = Controller(config(tmp_path, "steps=4", "checkpoint_every=2", "eval_every=0"))
    controller.run()
    assert saved == [2, 4]
    again = real(tmp_path, 4, controller.model, controller.learner)
    checkpoint.verify(again)
    names = sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name)
    assert names == ["checkpoint-2", "checkpoint-4"]


def test_a_ray_actor_still_starting_is_not_taken_for_hung():
    """A replacement actor cannot answer until its start-up ends (imports, weights, graph
    capture): it was killed as hung after heartbeat_timeout_s (30 s here), again and again. It
    gets the local backend's start-up grace; one that answers is judged by its heartbeat."""
    import time as clock

    from parity.rl.local import STARTUP_GRACE_S
    from parity.rl.ray_backend import RayRollout

    rollout = object.__new__(RayRollout)
    silence = {0: float("inf")}
    rollout._silence = lambda i: silence[i]
    rollout.started_at = [clock.monotonic() - 40.0]
    assert not rollout._hung(0, 30.0)  # starting for 40 s, not answering yet
    rollout.started_at = [clock.monotonic() - STARTUP_GRACE_S - 1]
    assert rollout._hung(0, 30.0)  # past the grace: hung
    rollout.started_at = [clock.monotonic() - 40.0]
    silence[0] = 31.0
    assert rollout._hung(0, 30.0)  # up, then silent past the timeout
    silence[0] = 2.0
    assert not rollout._hung(0, 30.0)


def test_fixed_lag_batches_out_of_turn_give_the_same_run(tmp_path):
    """Deterministic mode: a worker holding more than rollout.max_held_versions versions samples
    the newest one's batch out of turn; the run is the same, bit for bit, as strictly in order."""
    args = ("steps=14", "max_policy_lag=6", "deterministic=true", "eval_every=0")
    bounded = Controller(config(tmp_path / "a", *args, "rollout.max_held_versions=1")).run()
    in_order = Controller(config(tmp_path / "b", *args, "rollout.max_held_versions=0")).run()
    assert timeless(bounded) == timeless(in_order)
    assert max(m["lag/max"] for m in bounded) == 6


def test_worker_holds_only_versions_its_batches_need_and_evicts_the_newest(tmp_path):
    from parity.rl.build import build_env, build_model
    from parity.rl.rollout_worker import RolloutWorker

    cfg = config(tmp_path, "steps=12", "max_policy_lag=4", "deterministic=true",
                 "rollout.max_held_versions=2")
    model = build_model(cfg)
    worker = RolloutWorker(cfg, model, build_env(cfg, model.config.vocab_size), version=0,
                           state=model.state_dict())
    worker.todo = todo = list(range(0, 12, 2))  # worker 0 of 2: batches 0, 2, ..., 10
    for v in range(1, 9):
        worker.receive(v, model.state_dict())
    assert sorted(worker.held) == [2, 4, 6]  # batches 6, 8, 10; odd versions are the other worker's
    assert worker.next_to_sample(todo) == 10  # three held > 2: the newest version's batch first
    worker.sample(10)
    todo.remove(10)
    assert worker.version == 6
    assert sorted(worker.held) == [0, 2, 4]  # version 0 kept: batches 0 and 2 still need it
    assert worker.next_to_sample(todo) == 8


def test_a_worker_not_in_deterministic_mode_holds_only_the_newest_version(tmp_path):
    """Without determinism a worker only ever loads the newest version it holds: it kept every
    newer one (lag + 1 weight copies alive in shared memory, nine at lag 8 behind a slow batch);
    in deterministic mode without a plan it still keeps them all (a batch may need an older one)."""
    from parity.rl.build import build_env, build_model
    from parity.rl.rollout_worker import RolloutWorker

    for deterministic, kept in (("false", [8]), ("true", list(range(1, 9)))):
        cfg = config(tmp_path, "steps=12", "max_policy_lag=8", f"deterministic={deterministic}")
        model = build_model(cfg)
        worker = RolloutWorker(cfg, model, build_env(cfg, model.config.vocab_size), version=0,
                               state=model.state_dict())
        for v in (1, 2, 3, 5, 4, 6, 7, 8):  # (one out of order)
            worker.receive(v, model.state_dict())
        assert sorted(worker.held) == kept
    worker.sample(8)
    assert worker.version == 0 and sorted(worker.held) == list(range(1, 9))  # (batch 8 needs version 0)


def test_a_fixed_lag_run_resumed_past_its_end_trains_on(tmp_path, caplog):
    """A finished deterministic run keeps only its last weights; resumed with more steps, the
    batches whose fixed-lag versions are gone are sampled by the oldest kept version."""
    import logging

    args = ("max_policy_lag=2", "deterministic=true", "eval_every=0")
    with caplog.at_level(logging.WARNING, logger="parity"):
        Controller(config(tmp_path, *args, "steps=3")).run()
    assert "fixed-lag versions were not kept" not in caplog.text  # a fresh run has them all
    with caplog.at_level(logging.WARNING, logger="parity"):
        more = Controller(config(tmp_path, *args, "steps=6"), resume=True).run()
    assert "batches 3, 4 are sampled by version 3" in caplog.text
    assert [m["step"] for m in more[-3:]] == [3, 4, 5]
    assert [m["lag/max"] for m in more[-3:]] == [0, 1, 2]  # versions 3, 3, 3: back to the lag


def test_steady_throughput_leaves_out_start_up_and_evaluations(tmp_path, monkeypatch):
    """The study's steps/hour counted the first step (process start-up, the first batch) and the
    in-loop evaluations: `throughput/steady_steps_per_hour` takes them out."""
    import time

    def slow_evaluation(self):
        time.sleep(0.3)
        return {}

    monkeypatch.setattr(Controller, "evaluate", slow_evaluation)
    metrics = Controller(config(tmp_path, "steps=4", "eval_every=1")).run()
    assert "throughput/steady_steps_per_hour" not in metrics[0]
    assert metrics[-1]["time/eval_s"] >= 4 * 0.3  # before steps 0..3 (the final one is after them)
    first = metrics[0]
    for step, m in enumerate(metrics[1:], 1):
        span = m["time/wall_s"] - first["time/wall_s"] - (m["time/eval_s"] - first["time/eval_s"])
        assert m["throughput/steady_steps_per_hour"] == pytest.approx(3600 * step / span)
        assert span < m["time/wall_s"] - 0.3 * step  # each evaluation's 0.3 s is out of it


def test_a_run_resumed_without_its_metrics_counts_only_the_steps_it_timed(tmp_path, caplog):
    """With metrics.jsonl gone, a resumed run's clock starts at 0: its steps/hour must count the
    steps since the resume, not every step since 0 (that read 51x too fast at step 50); a warning
    says the records are lost (it went on without a word)."""
    import logging

    Controller(config(tmp_path, "steps=2", "checkpoint_every=2", "eval_every=0")).run()
    (tmp_path / "metrics.jsonl").unlink()
    with caplog.at_level(logging.WARNING, logger="parity"):
        metrics = Controller(config(tmp_path, "steps=5", "eval_every=0"), resume=True).run()
    assert "metrics.jsonl is gone: the records of the 2 steps checkpoint-2 contains are lost" in caplog.text
    last = metrics[-1]
    assert last["step"] == 4
    assert last["throughput/steps_per_hour"] == pytest.approx(3600 * 3 / last["time/wall_s"])
    first = metrics[0]
    span = last["time/wall_s"] - first["time/wall_s"]
    assert last["throughput/steady_steps_per_hour"] == pytest.approx(3600 * 2 / span, rel=1e-3)


def test_a_resume_takes_the_runs_own_optimizer_settings_and_keeps_records_by_step(tmp_path, caplog):
    """A resume with a new lr, betas and weight decay trains with them (the restored optimizer
    state brought back the old ones while config.toml recorded the new); the kept records are
    those of the checkpoint's steps by number (a removed line made a line count keep step 3 and
    write it again), the missing one named."""
    import logging

    args = ("eval_every=0", "checkpoint_every=3")
    Controller(config(tmp_path, *args, "steps=5")).run()
    shutil.rmtree(tmp_path / "checkpoint-5")  # as if killed after step 4's record
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:1] + lines[2:]))  # step 1's line removed
    new = ("learner.lr=0.1", "learner.weight_decay=0.5", "learner.betas=[0.5, 0.6]")
    with caplog.at_level(logging.INFO, logger="parity"):
        run = Controller(config(tmp_path, *args, "steps=5", *new), resume=True)
        metrics = run.run()
    group = run.learner.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.1, (0.5, 0.6), 0.5)
    assert [m["train/lr"] for m in metrics[-2:]] == [0.1, 0.1]
    assert "learner.lr 0.003 -> 0.1" in caplog.text and "missing steps: 1" in caplog.text
    assert [m["step"] for m in metrics] == [0, 2, 3, 4]
    assert "throughput/steps_per_hour" in metrics[-1]


def test_a_run_dir_in_use_by_another_run_is_refused(tmp_path):
    """While a run trains in a run dir another process's run there, or a resume of it, is refused
    in one line naming the holder (both ran: the second's rewrite lost the first's records, and
    a resume mixed one's weights with the other's config); once it ends the dir is free."""
    import subprocess
    import sys

    from parity.errors import ParityError

    Controller(config(tmp_path, "steps=1", "eval_every=0")).run()
    over = Controller(config(tmp_path, "steps=1", "eval_every=0"), overwrite=True)  # built before the
    holder = subprocess.Popen([sys.executable, "-c", (  # other run takes the dir: it clears nothing
        "import sys, time; from parity.rl.checkpoint import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(60)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for resume in (False, True):
            with pytest.raises(ParityError, match=rf"in use by another run \(pid {holder.pid}\)"):
                Controller(config(tmp_path, "steps=1", "eval_every=0"), resume=resume)
        with pytest.raises(ParityError, match="in use by another run"):
            over.run()
        assert (tmp_path / "checkpoint-1").is_dir() and (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    Controller(config(tmp_path, "steps=1", "eval_every=0"), overwrite=True).run()  # its lock went with it
    Controller(config(tmp_path, "steps=2", "eval_every=0"), resume=True).run()  # and a run's with its end


def test_a_checkpoint_that_is_not_the_runs_is_refused(tmp_path):
    """Another model's checkpoint copied into a run dir, one renamed to another step, and a
    config.toml whose dtype was edited: each was resumed (trained a MoE model under a dense run's
    config, bf16 master weights rebuilt from a float32 run's); now one line names the mismatch."""
    from parity.errors import CheckpointError
    from parity.model import Model, ModelConfig
    from parity.rl import checkpoint

    cfg = config(tmp_path, "steps=4")
    moe = Model(ModelConfig.preset("tiny-moe"))
    path = checkpoint.save(tmp_path / "moe", 2, moe, Learner(moe, cfg.learner))
    with pytest.raises(CheckpointError, match="model_type = qwen3_moe; this run.s config describes qwen3"):
        checkpoint.load(path, cfg)
    dense = Model(ModelConfig.preset("tiny"))
    path = checkpoint.save(tmp_path / "dense", 2, dense, Learner(dense, cfg.learner))
    assert checkpoint.load(path, cfg)[2] == 2  # the control
    with pytest.raises(CheckpointError, match="torch_dtype 'float32'; this run's model.dtype is bfloat16"):
        checkpoint.load(path, config(tmp_path, "steps=4", 'model.dtype="bfloat16"'))
    path.rename(tmp_path / "dense" / "checkpoint-5")
    with pytest.raises(CheckpointError, match="holds step 2: not this run's checkpoint-5"):
        checkpoint.load(tmp_path / "dense" / "checkpoint-5", cfg)
