"""Several optimizer updates per batch (PPO's mini-batches and epochs) and AReaL's decoupled PPO
around the proximal policy the batch started from: what an update does, what a batch publishes,
and what a failure part-way leaves."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import parity
from parity.config import load_config
from parity.rl import Learner, LearnerConfig, TrajectoryBatch
from parity.rl import learner as learner_module
from parity.rl.controller import Controller

from .test_controller import BASE
from .test_learner import fail_on_call, model, ragged_batch, rollout

SEED = 8


def batch_of_four_groups():
    return rollout(parity.Engine(model(seed=SEED), max_num_seqs=8), n_groups=4, group_size=3, seed=SEED)


def learner(kernels="aligned", **cfg):
    base = dict(lr=1e-2, micro_batch_size=4, decompose_every=0, max_policy_lag=8)
    return Learner(model(kernels, seed=SEED), LearnerConfig(**{**base, **cfg}))


@pytest.mark.parametrize("mini_batches, epochs", [(2, 1), (2, 2)])
def test_a_batch_cut_into_mini_batches_trains_as_that_many_batches_would(mini_batches, epochs):
    """mini_batches × epochs AdamW steps on one batch (cut in order: `shuffle` off) leave the
    weights, bit for bit, where that many one-update steps on the mini-batches in turn leave them
    (each mini-batch two whole groups, so their advantages agree), yet publish one version and
    step the schedule once. The control: one update on the whole batch lands elsewhere."""
    batch = batch_of_four_groups()
    halves = [list(range(6)), list(range(6, 12))] if mini_batches == 2 else [list(range(12))]
    many = learner(mini_batches=mini_batches, epochs=epochs, shuffle=False)
    metrics = many.step(batch)
    assert metrics["train/updates"] == mini_batches * epochs and many.version == 1
    assert many.scheduler.last_epoch == 1
    assert all(s["step"] == mini_batches * epochs for s in many.optimizer.state.values())
    assert metrics["train/grad_norm_max"] >= metrics["train/grad_norm"] > 0
    one_each = learner()
    for _ in range(epochs):
        for idx in halves:
            one_each.step(batch.select(idx))
    assert all(torch.equal(a, b) for a, b in zip(many.master, one_each.master))
    once = learner()
    once.step(batch)
    assert not all(torch.equal(a, b) for a, b in zip(many.master, once.master))
    assert "train/updates" not in once.step(batch)  # one update per batch reports as before


def test_shuffled_mini_batches_are_dealt_anew_each_epoch_and_alike_on_a_rerun():
    """`shuffle` (the default) deals the batch's responses into mini-batches in a new order each
    epoch and each step, every response once per epoch; the deal comes from the learner's step,
    so another learner at that step (a resumed run) deals alike and lands on the same weights bit
    for bit. The control: cut in order, the weights land elsewhere."""
    batch = batch_of_four_groups()
    a = learner(mini_batches=2, epochs=2)
    passes = a._passes(len(batch))
    assert [sorted(passes[e] + passes[e + 1]) for e in (0, 2)] == [list(range(12))] * 2
    assert passes[:2] != passes[2:] and passes[:2] != [list(range(6)), list(range(6, 12))]
    assert a.step(batch)["train/updates"] == 4
    assert a._passes(len(batch)) != passes  # the next step deals anew
    b = learner(mini_batches=2, epochs=2)
    b.step(batch)
    assert all(torch.equal(x, y) for x, y in zip(a.master, b.master))
    in_order = learner(mini_batches=2, epochs=2, shuffle=False)
    in_order.step(batch)
    assert not all(torch.equal(x, y) for x, y in zip(a.master, in_order.master))


def record_gradients(monkeypatch) -> dict:
    """Each learner's gradients at each optimizer step, by `tag` (compared before AdamW: its first
    step is lr x sign(g), so the weights after it cannot show a gradient off in its last bits)."""
    seen: dict = {}
    real = Learner._optimizer_step

    def record(self):
        seen.setdefault(self.tag, []).append([m.grad.clone() for m in self.master])
        real(self)

    monkeypatch.setattr(Learner, "_optimizer_step", record)
    return seen


def tagged(tag: str, kernels: str = "aligned", **cfg) -> Learner:
    """A learner on `micro_batch_size` 5: of a mini-batch of 6 responses, the last is scored alone,
    while a batch scored up front holds it among others (on the standard kernels a response of a
    few tokens alone gets other bits on this CPU, at one thread and at two)."""
    x = learner(kernels, micro_batch_size=5, **cfg)
    x.tag = tag
    return x


@pytest.mark.parametrize("kernels", ["aligned", "standard"])
def test_the_kl_reference_is_scored_once_for_every_epoch_with_the_same_bits(monkeypatch, kernels):
    """With a KL penalty and several epochs the reference scores the batch once, not once per
    epoch: on aligned kernels its log-probs are the per-micro-batch ones bit for bit, so every
    update's gradient is the one scoring it every epoch gives. The controls: the standard kernels'
    gradients part at some update (the reference's bits moved with its micro-batches); without the
    penalty the last update's gradient is another (at the first the penalty's is 0)."""
    from parity.rl.reference import ReferencePolicy

    batch, seen = ragged_batch(), record_gradients(monkeypatch)
    calls = []
    real = ReferencePolicy.logprobs
    monkeypatch.setattr(ReferencePolicy, "logprobs",
                        lambda self, b, c: calls.append(len(b)) or real(self, b, c))
    metrics = tagged("once", kernels, mini_batches=2, epochs=3, kl_coef=0.5).step(batch)
    assert calls == [] and metrics["train/kl_ref"] > 0
    score = Learner._score  # the reference unscored up front: scored per micro-batch, every epoch
    monkeypatch.setattr(Learner, "_score", lambda self, model, *a: (
        (None,) if self.reference and model is self.reference.model else score(self, model, *a)))
    tagged("every", kernels, mini_batches=2, epochs=3, kl_coef=0.5).step(batch)
    assert sum(calls) == 3 * len(batch)  # each response once per epoch
    same = [all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(seen["once"], seen["every"])]
    assert len(same) == 6 and all(same) == (kernels == "aligned"), same
    tagged("plain", kernels, mini_batches=2, epochs=3).step(batch)
    assert not all(torch.equal(a, b) for a, b in zip(seen["once"][-1], seen["plain"][-1]))


@pytest.mark.parametrize("kernels", ["aligned", "standard"])
def test_decoupled_ppo_takes_its_first_update_as_reinforce_zero_and_clips_around_the_start_after(
        monkeypatch, kernels):
    """π_prox is the learner before the batch's first update, scored without gradients on other
    micro-batches: on aligned kernels it is the first update's own log-probs bit for bit, so r = 1
    there and that update's gradient is REINFORCE Zero's exactly (with one update per batch, every
    update is). Later updates clip r = π/π_prox, which REINFORCE Zero never does (the weights part
    after update 1). The control: on the standard kernels π_prox's bits moved with its
    micro-batches, and the first gradients part."""
    batch, seen = ragged_batch(), record_gradients(monkeypatch)
    metrics = tagged("decoupled_ppo", kernels, loss="decoupled_ppo", mini_batches=2, epochs=2,
                     lr=5e-2).step(batch)
    tagged("reinforce_zero", kernels, loss="reinforce_zero", mini_batches=2, epochs=2, lr=5e-2).step(batch)
    first = zip(seen["decoupled_ppo"][0], seen["reinforce_zero"][0])
    assert all(torch.equal(a, b) for a, b in first) == (kernels == "aligned")
    if kernels == "standard":
        return
    assert not all(torch.equal(a, b) for a, b in zip(seen["decoupled_ppo"][-1], seen["reinforce_zero"][-1]))
    assert metrics["loss/frac_clipped"] > 0
    start = learner().logprobs(batch)[batch.mask.bool()]  # (another policy sampled the batch)
    gap = (start - batch.rollout_logprobs[batch.mask.bool()]).abs().max()
    assert metrics["mismatch/max_abs"] == float(gap) > 0  # reported at the weights the batch started from
    one = {name: tagged(name + "/1", loss=name) for name in ("decoupled_ppo", "reinforce_zero")}
    for x in one.values():
        x.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(*(seen[x.tag][0] for x in one.values())))


def test_a_mini_batch_whose_loss_overflows_skips_only_its_own_update(tmp_path):
    """A response whose rollout log-prob is −200 on a live token makes its mini-batch's loss inf
    under REINFORCE Zero: that update is skipped and the batch saved; the other mini-batch's
    update lands and the version advances once."""
    batch = batch_of_four_groups()
    bad = batch.trajectories[7]  # (group 2: its advantage is not 0)
    lps = list(bad.rollout_logprobs)
    lps[next(i for i, m in enumerate(bad.loss_mask) if m)] = -200.0
    trajectories = list(batch.trajectories)
    trajectories[7] = dataclasses.replace(bad, rollout_logprobs=lps)
    batch = TrajectoryBatch(trajectories)
    x = learner(mini_batches=2, dump_dir=str(tmp_path))
    before = [m.detach().clone() for m in x.master]
    metrics = x.step(batch)
    assert metrics["train/skipped_nonfinite"] == 1.0 and metrics["train/updates"] == 1.0
    assert not math.isfinite(metrics["train/loss"])
    assert x.version == 1 and x.last_dump and torch.load(x.last_dump)
    assert not all(torch.equal(a, b) for a, b in zip(before, x.master))
    assert all(s["step"] == 1 for s in x.optimizer.state.values())


def test_a_failure_before_the_first_update_changes_nothing_and_after_it_tears_the_learner(monkeypatch):
    """A failure in the proximal forward or the diagnostics leaves the learner as it was (the retry
    matches an unfailed step bit for bit); one after the first of several updates has moved the
    weights, so the learner is torn and refuses to go on."""
    batch = batch_of_four_groups()
    clean, failed = learner(mini_batches=2), learner(mini_batches=2)
    clean.step(batch)
    fail_on_call(monkeypatch, learner_module, "response_stats", 1, MemoryError("injected"))
    with pytest.raises(MemoryError):
        failed.step(batch)
    assert failed.torn is None and failed.version == 0
    failed.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(failed.master, clean.master))
    fail_on_call(monkeypatch, Learner, "_backward", 2, MemoryError("second mini-batch"))
    with pytest.raises(MemoryError):
        failed.step(batch)
    assert failed.torn == "MemoryError: second mini-batch" and failed.version == 1
    with pytest.raises(parity.ParityError, match="failed part-way"):
        failed.publish()


def test_an_async_run_with_several_updates_per_batch_keeps_its_lag_bound_and_exact_kernels(tmp_path):
    """The trainer end to end with decoupled_ppo, 2 mini-batches and 2 epochs at lag 1: every step
    makes 4 updates and publishes one version, the lag bound holds and the kernel mismatch at the
    version that sampled each token is exactly 0."""
    cfg = load_config(None, BASE + [f"run_dir=\"{tmp_path}\"", "steps=4", "max_policy_lag=1",
                                    "learner.loss=\"decoupled_ppo\"", "learner.mini_batches=2",
                                    "learner.epochs=2"])
    metrics = Controller(cfg).run()
    assert [m["step"] for m in metrics] == list(range(4))
    assert all(m["train/updates"] == 4 and m["lag/max"] <= 1 for m in metrics)
    assert all(m["mismatch/kernel_max_abs"] == 0.0 for m in metrics)
    assert metrics[-1]["train/policy_version"] == 4


def test_bad_mini_batch_settings_are_one_line_errors(tmp_path):
    message = r"learner.mini_batches \(5\) must be at most the responses of a batch \(.* = 4\)"
    with pytest.raises(parity.ConfigError, match=message):
        load_config(None, BASE + [f"run_dir=\"{tmp_path}\"", "learner.mini_batches=5"])
    for field in ("mini_batches", "epochs"):
        with pytest.raises(parity.ConfigError, match=f"LearnerConfig.{field} must be >= 1, got 0"):
            LearnerConfig(**{field: 0})
    with pytest.raises(parity.ConfigError, match=r"behav_cap must be 0 \(no cap\) or > 1, got 0.5"):
        parity.rl.LossConfig(behav_cap=0.5)
